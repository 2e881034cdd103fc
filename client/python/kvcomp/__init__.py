"""kvcomp: KV-cache compression (scoring, budgets, compaction, moments, codecs) for LLM serving.

Arrays are NumPy (or DLPack, e.g. CUDA tensors with backend="cuda") shaped
[kv_heads, tokens, head_dim] or [layers, kv_heads, tokens, head_dim], float32, float16 or
bfloat16. bfloat16 arrives as an ml_dtypes.bfloat16 array, a torch tensor, or a uint16 array of
the raw bits with dtype="bf16".
"""

from ._kvcomp import CompressedCache, Policy, backend_description, cuda_available  # noqa: F401
from . import _kvcomp

__all__ = ["Policy", "CompressedCache", "score", "compress", "cuda_available",
           "backend_description", "attention"]


def _as_input(a, dtype):
    """A C-contiguous array the extension can read (CUDA/DLPack objects pass through)."""
    if a is None:
        return None
    if hasattr(a, "__cuda_array_interface__") or (
            hasattr(a, "__dlpack_device__") and a.__dlpack_device__()[0] != 1):
        return a
    import numpy as np
    arr = np.asarray(a)
    if arr.dtype.name == "bfloat16":  # ml_dtypes: hand the raw bits over
        arr = arr.view(np.uint16)
        dtype = "bf16"
    return np.ascontiguousarray(arr), dtype


def _prepare(a, dtype):
    r = _as_input(a, dtype)
    if isinstance(r, tuple):
        return r
    return r, dtype


def score(keys, scorer="manifold", *, backend="cpu", dtype=None, queries=None, **params):
    """Per-token scores (higher = keep), float32 [kv_heads, tokens] or [layers, kv_heads, tokens].

    params: any Policy field the scorer reads (window, n_sink, seed, snapkv_pool, ...).
    queries: snapkv's observation-window queries, [q_heads, w, head_dim] (per layer if 4-D).
    """
    policy = Policy(scorer=scorer, **params)
    k, dt = _prepare(keys, dtype or "")
    q = None
    if queries is not None:
        q, _ = _prepare(queries, dt)
    return _kvcomp._score(k, policy, backend=backend, dtype=dt or "", queries=q)


def compress(keys, values, policy=None, backend="cpu", *, dtype=None, queries=None,
             num_q_heads=None):
    """Compresses one sequence's KV cache under `policy` (default Policy()).

    Returns a CompressedCache: kept_positions(layer, head), keys(layer, head),
    values(layer, head), nbytes, original_nbytes, to_bytes(), CompressedCache.from_bytes(b).
    """
    if policy is None:
        policy = Policy()
    k, dt = _prepare(keys, dtype or "")
    v, dt_v = _prepare(values, dt)
    q = None
    if queries is not None:
        q, _ = _prepare(queries, dt)
    return _kvcomp._compress(k, v, policy, backend=backend, dtype=dt or dt_v or "", queries=q,
                             num_q_heads=num_q_heads)


def attention(q, cache, layer, correct=True, *, backend="cpu", scale=0.0):
    """Decode-side attention over one layer of a compressed cache (issue 4, docs/moments.md).

    q: queries [q_heads, n_queries, head_dim] (float32/float16/bfloat16, host memory), GQA over
    the cache's kv heads. Softmax over the kept tokens plus, when `correct` and the cache has
    moments, each kv head's evicted-set virtual token. Returns float32 [q_heads, n_queries,
    head_dim]. scale: logit scale, 0 = 1/sqrt(head_dim).
    """
    import numpy as np
    arr = np.asarray(q)
    if arr.dtype.name == "bfloat16":
        raise ValueError("pass bfloat16 queries as float32 (numpy has no native bfloat16)")
    return _kvcomp._attention(np.ascontiguousarray(arr), cache, layer, correct=correct,
                              backend=backend, scale=scale)

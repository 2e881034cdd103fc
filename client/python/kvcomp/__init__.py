"""kvcomp: KV-cache compression (scoring, budgets, compaction, moments, codecs) for LLM serving.

Arrays are NumPy (or DLPack, e.g. CUDA tensors with backend="cuda") shaped
[kv_heads, tokens, head_dim] or [layers, kv_heads, tokens, head_dim], float32, float16 or
bfloat16. bfloat16 arrives as an ml_dtypes.bfloat16 array, a torch tensor, or a uint16 array of
the raw bits with dtype="bf16".

Streams (backend="cuda"): a call runs on `stream` (an int cudaStream_t, a torch.cuda.Stream or
a CuPy stream); by default on torch's current stream of the inputs' device when a torch CUDA
tensor is among them, else on a stream of the calling thread's own. CUDA inputs are read after
their producer's pending writes: DLPack producers are asked for them on the call's stream
(__dlpack__(stream=...)), __cuda_array_interface__ objects are waited for through the "stream"
they name. Nothing synchronises the whole device. Arrays written for the caller (attention's
`out`) are ordered on the call's stream; returned NumPy arrays and caches are complete.
"""

from ._version import __version__  # noqa: F401
from ._kvcomp import CompressedCache, Policy, backend_description, cuda_available  # noqa: F401
from ._kvcomp import merge_heads, slice_heads, split_heads  # noqa: F401
from . import _kvcomp
from .client import Client, DeviceGetStream, DevicePutStream, PutStream  # noqa: F401
from .client import EXPANSION_WARNING

if not hasattr(_kvcomp, "_Client"):  # a KVCOMP_CORE_ONLY build (e.g. the GPU machine): no SDK
    class Client:  # noqa: F811
        """Not in this build (KVCOMP_CORE_ONLY): constructing one raises NotImplementedError."""

        def __init__(self, *args, **kwargs):
            raise NotImplementedError(
                "kvcomp.Client: this build of kvcomp has no client (the extension was built "
                "with KVCOMP_CORE_ONLY=ON, without UCX); the engine functions (compress, "
                "decompress, calibrate, attention, ...) work. Build with KVCOMP_CORE_ONLY=OFF "
                "for the client.")

__all__ = ["__version__", "Policy", "CompressedCache", "score", "compress", "cuda_available",
           "backend_description", "attention", "Client", "PutStream", "split_heads",
           "slice_heads", "merge_heads", "preset", "PRESETS"]

# Named presets (docs/research.md, "Presets"; the same table as kvcomp::PolicyPreset in C++):
#   lossless  every token, raw keys and values, no moments: the cache as given.
#   codec     every token, the calibrated basis codec, keys 3 bits and values 2 bits per
#             element (pq, "k3v2": 6.4x, within 0.32% loss on every model measured), no
#             moments: compress(..., pq=kvcomp.calibrate_pq(...)) with the model's calibration
#             at those bits (an error naming calibrate_pq without one; never other codecs in
#             its place); the CPU and CUDA backends encode it, the same bytes.
#   balanced  manifold eviction of a third of the tokens with 85% of the kept budget recent,
#             hq4 keys and hq3 values, no moments (6.2x, within 2% on every model measured).
#   default   Policy() as constructed.
PRESETS = {
    "lossless": dict(ratio=0.0, moments=False),
    "codec": dict(ratio=0.0, moments=False, key_codec="pq", value_codec="pq", key_bits=3,
                  value_bits=2),
    "balanced": dict(scorer="manifold", ratio=0.33, recent_fraction=0.85, moments=False,
                     key_codec="hq4", value_codec="hq3"),
    "default": dict(),
}


def preset(name, **overrides):
    """The Policy of a named preset (PRESETS), with any field overridden by keyword."""
    if name not in PRESETS:
        raise ValueError(f"unknown policy preset {name!r}; one of: {', '.join(PRESETS)}")
    return Policy(**{**PRESETS[name], **overrides})


def _warn_if_expanded(stored, original, what):
    """A compressed cache larger than its input says so (e.g. moment summaries of short chunks,
    or codec side data at few tokens)."""
    if stored > EXPANSION_WARNING * original:
        import warnings
        warnings.warn(f"{what}: the stored cache ({stored} bytes) is larger than the original "
                      f"({original} bytes, {stored / max(original, 1):.2f}x); the policy does "
                      f"not pay for itself at this size (docs/research.md, \"Presets\")",
                      RuntimeWarning, stacklevel=3)

_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


def _is_cuda(a):
    """True for a CUDA array (DLPack device CUDA, or __cuda_array_interface__)."""
    if a is None:
        return False
    if hasattr(a, "__dlpack_device__"):
        return a.__dlpack_device__()[0] in (_DL_CUDA, _DL_CUDA_MANAGED)
    return hasattr(a, "__cuda_array_interface__")


def _is_torch(a):
    return type(a).__module__.split(".")[0] == "torch"


def _call_stream(stream, arrays):
    """The stream a CUDA call runs on, as a number (module docstring); None = the binding's own
    stream for the calling thread."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            v = getattr(stream, attr, None)
            if isinstance(v, int):
                return v
        raise TypeError("stream must be an int (cudaStream_t), a torch.cuda.Stream or a CuPy "
                        "stream")
    for a in arrays:
        if _is_torch(a) and _is_cuda(a):
            import torch
            return torch.cuda.current_stream(a.device).cuda_stream
    return None


def _as_input(a, dtype):
    """A C-contiguous array the extension can read (CUDA/DLPack objects pass through)."""
    if a is None:
        return None
    if _is_cuda(a):
        if _is_torch(a):  # DLPack refuses tensors that need grad; kvcomp reads dense memory
            a = a.detach()
            if not a.is_contiguous():
                a = a.contiguous()
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


def score(keys, scorer="manifold", *, backend="cpu", dtype=None, queries=None, stream=None,
          **params):
    """Per-token scores (higher = keep), float32 [kv_heads, tokens] or [layers, kv_heads, tokens].

    params: any Policy field the scorer reads (window, n_sink, seed, snapkv_pool, ...).
    queries: snapkv's observation-window queries, [q_heads, w, head_dim] (per layer if 4-D).
    stream: the CUDA stream the call runs on (module docstring).
    """
    policy = Policy(scorer=scorer, **params)
    k, dt = _prepare(keys, dtype or "")
    q = None
    if queries is not None:
        q, _ = _prepare(queries, dt)
    return _kvcomp._score(k, policy, backend=backend, dtype=dt or "", queries=q,
                          stream=_call_stream(stream, (keys, queries)))


def compress(keys, values, policy=None, backend="cpu", *, dtype=None, queries=None,
             num_q_heads=None, projection=None, pq=None, stream=None, k_scale=None,
             v_scale=None):
    """Compresses one sequence's KV cache under `policy` (default Policy()).

    fp8 (e4m3) keys and values (torch float8_e4m3fn tensors, ml_dtypes float8_e4m3fn arrays)
    are taken with their scales k_scale and v_scale (numbers, or arrays broadcasting against the
    cache, e.g. per kv head) as float32 (kvcomp.layouts.dequantize_fp8: quantizing a decoded
    token back with the same scale gives its fp8 bytes); the cache is then a float32 one.

    Value codecs other than "none" need `projection` (kvcomp.calibrate); the cache records its
    version, and kvcomp.decompress(cache, projection) returns the dense kept keys and values.
    The pq codecs (key_codec / value_codec "pq", the calibrated basis codec at the policy's
    key_bits / value_bits) need `pq`, the model's kvcomp.PqCalibration (kvcomp.calibrate_pq,
    fitted at those bits; RuntimeError naming it otherwise); the CPU and CUDA backends give the
    same bytes; kvcomp.decompress(cache, pq=...) decodes them.

    Returns a CompressedCache: kept_positions(layer, head), keys(layer, head),
    values(layer, head), nbytes, original_nbytes, to_bytes(), CompressedCache.from_bytes(b).
    stream: the CUDA stream the call runs on (module docstring).
    """
    if policy is None:
        policy = Policy()
    from .layouts import dequantize_fp8, is_fp8
    if is_fp8(keys) or is_fp8(values):
        if k_scale is None or v_scale is None:
            raise ValueError("fp8 keys and values need their scales (k_scale, v_scale)")
        keys, values = dequantize_fp8(keys, k_scale), dequantize_fp8(values, v_scale)
        dtype = None
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale and v_scale are for fp8 (float8_e4m3fn) keys and values")
    st = _call_stream(stream, (keys, values, queries))
    k, dt = _prepare(keys, dtype or "")
    v, dt_v = _prepare(values, dt)
    q = None
    if queries is not None:
        q, _ = _prepare(queries, dt)
    if policy.key_codec != "raw" or policy.value_codec != "none":  # KVSplice
        raw = _kvcomp._compress(k, v, _kvcomp._raw_codecs(policy), backend=backend,
                                dtype=dt or dt_v or "", queries=q, num_q_heads=num_q_heads,
                                stream=st)
        out = _kvcomp._encode_kept(raw, policy, projection, backend, stream=st, pq=pq)
    else:
        out = _kvcomp._compress(k, v, policy, backend=backend, dtype=dt or dt_v or "",
                                queries=q, num_q_heads=num_q_heads, stream=st)
    _warn_if_expanded(out.nbytes, out.original_nbytes, "kvcomp.compress")
    return out


def attention(q, cache, layer, correct=True, *, backend="cpu", scale=0.0, out=None,
              stream=None, projection=None, expand_in_attention=False):
    """Decode-side attention over one layer of a compressed cache (docs/moments.md).

    q: queries [q_heads, n_queries, head_dim] (float32/float16/bfloat16; host memory, or a CUDA
    array with backend="cuda"), GQA over the cache's kv heads. Softmax over the kept tokens plus,
    when `correct` and the cache has moments, each kv head's evicted-set virtual token. Returns
    float32 [q_heads, n_queries, head_dim]: a new NumPy array, or `out` (float32, shaped like q,
    host or CUDA memory) written in place on the call's stream. scale: logit scale, 0 =
    1/sqrt(head_dim). stream: the CUDA stream the call runs on (module docstring).
    projection: the kvcomp.Projection a KVSplice-encoded cache was encoded with (required for
    such a cache, ValueError without it; KeyError for another version). expand_in_attention:
    attend over the values' latent codes instead of decoding them first (same result within
    float rounding; docs/kvsplice.md).
    """
    st = _call_stream(stream, (q, out))
    if _is_cuda(q):
        arr, _ = _prepare(q, "")
    else:
        import numpy as np
        arr = np.asarray(q)
        if arr.dtype.name == "bfloat16":
            raise ValueError("pass bfloat16 queries as float32 (numpy has no native bfloat16)")
        arr = np.ascontiguousarray(arr)
    return _kvcomp._attention(arr, cache, layer, correct=correct, backend=backend, scale=scale,
                              out=out, stream=st, projection=projection,
                              expand_in_attention=expand_in_attention)


# --- KVSplice (docs/kvsplice.md) ---
from ._kvcomp import Projection  # noqa: E402,F401

__all__ += ["Projection", "calibrate", "decompress", "cache_codecs", "PqCalibration",
            "calibrate_pq"]
from ._kvcomp import PqCalibration  # noqa: E402,F401


def _f32_4d(a, what):
    if _is_cuda(a):  # read in place by backend="cuda" (float32, float16 or bfloat16)
        a, _ = _prepare(a, "")
        return a[None] if len(a.shape) == 3 else a
    import numpy as np
    arr = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4:
        raise ValueError(f"{what} must be [layers, kv_heads, tokens, head_dim]")
    return arr


def calibrate(values, rank=None, error_budget=None, *, keys=None, queries=None, metric="value",
              codec="orthogonal_int8", group_size=32, gamma_aware=True, model_id="",
              backend="cpu", max_samples=1024, max_queries=256, seed=0, stream=None):
    """Calibrates a KVSplice projection from value caches (PCA per layer and kv head).

    values: one array [layers, kv_heads, tokens, head_dim] (or [kv_heads, tokens, head_dim]), or
    a list of them (many caches). rank: basis rows to keep (default head_dim). error_budget: the
    auto-tuner picks per layer the smallest rank whose relative error (metric "value": value
    reconstruction; "attention": attention output over sample queries, or the keys as queries)
    with `codec` meets it; the result's tuned_rank / tuned_error report the choice. keys (same
    shapes as values) are needed for the attention metric; queries: [layers, q_heads, n, d].
    CUDA arrays (backend="cuda", any float dtype) are read in place on `stream` (module
    docstring); the auto-tuner needs host arrays (it measures on host samples).
    Returns a kvcomp.Projection (save(path) / Projection.load(path)).
    """
    vals = values if isinstance(values, (list, tuple)) else [values]
    st = _call_stream(stream, list(vals) + (list(keys) if isinstance(keys, (list, tuple))
                                            else [keys]))
    vals = [_f32_4d(v, "values") for v in vals]
    ks = []
    if keys is not None:
        ks = keys if isinstance(keys, (list, tuple)) else [keys]
        ks = [_f32_4d(k, "keys") for k in ks]
    qs = []
    if queries is not None:
        qs = queries if isinstance(queries, (list, tuple)) else [queries]
        qs = [_f32_4d(q, "queries") for q in qs]
    if rank is not None and error_budget is not None:
        raise ValueError("give rank or error_budget, not both")
    return _kvcomp._calibrate(vals, ks, qs, int(rank or 0), float(error_budget or 0.0), metric,
                              codec, int(group_size), bool(gamma_aware), model_id, backend,
                              int(max_samples), int(max_queries), int(seed), stream=st)


def calibrate_pq(keys, values, key_bits=3, value_bits=2, *, model_id=""):
    """Calibrates the pq codec (the calibrated basis codec, docs/format.md) for one model.

    keys, values: one array each [layers, kv_heads, tokens, head_dim] (or [kv_heads, tokens,
    head_dim]), or lists of them (many caches, concatenated along tokens; host arrays, any float
    dtype, taken as float32), at least 2 tokens in all. key_bits / value_bits: bits per element
    the bases are fitted at (1..8; "k3v2" = 3 and 2, the `codec` preset's). Returns a
    kvcomp.PqCalibration (save(path) / PqCalibration.load(path)) for kvcomp.compress(...,
    pq=...) with a policy whose key_bits / value_bits are the same.
    """
    import numpy as np

    def join(arrays, what):
        arrays = arrays if isinstance(arrays, (list, tuple)) else [arrays]
        if not arrays:
            raise ValueError(f"calibrate_pq: no {what} given")
        parts = [_f32_4d(_host(a), what) for a in arrays]
        return np.ascontiguousarray(np.concatenate(parts, axis=2))

    k, v = join(keys, "keys"), join(values, "values")
    if k.shape != v.shape:
        raise ValueError(f"calibrate_pq: keys {k.shape} and values {v.shape} differ in shape")
    return _kvcomp._calibrate_pq(k, v, int(key_bits), int(value_bits), model_id)


def _host(a):
    if _is_cuda(a):
        raise ValueError("calibrate_pq takes host arrays (copy CUDA tensors with .cpu())")
    return a


def _save_bytes(self, path):
    with open(path, "wb") as f:
        f.write(self.to_bytes())


def _loader(cls):
    def load(path):
        with open(path, "rb") as f:
            return cls.from_bytes(f.read())
    return staticmethod(load)


# A calibration (KVSplice projection or pq bases) to a file and back, in its byte format.
for _cls in (Projection, PqCalibration):
    _cls.save = _save_bytes
    _cls.load = _loader(_cls)
del _cls


def decompress(cache, projection=None, *, pq=None, backend="cpu", stream=None, out=None):
    """Decodes a compressed cache's kept tokens: (keys, values), float32.

    When every (layer, kv head) kept the same number of tokens the arrays are
    [layers, kv_heads, kept, head_dim]; otherwise (AdaKV) they are lists [layer][kv_head] of
    [kept, head_dim] arrays. Kept positions: cache.kept_positions(layer, head). A cache whose
    values were encoded needs the projection it names (KeyError when it is missing or another);
    a cache of the pq codecs needs `pq`, the kvcomp.PqCalibration it names (KeyError likewise;
    the CPU backend only).

    out=(keys, values): decode into these arrays instead and return them: C-contiguous, one
    float dtype (float32, float16 or bfloat16), sum(cache.kept) * head_dim elements each, rows
    in (layer, kv head, kept token) order, so [layers, kv_heads, kept, head_dim] tensors when
    the counts are equal. With backend "cuda" they are CUDA arrays (torch, CuPy...) decoded in
    place on the device: only the encoded arrays cross to it; ordered after the arrays'
    producer's stream as other calls are.
    """
    if out is not None:
        keys, values = out
        _kvcomp._decompress_into(cache, projection, keys, values, backend,
                                 stream=_call_stream(stream, (keys, values)), pq=pq)
        return keys, values
    k, v, off = _kvcomp._decompress(cache, projection, backend, stream=_call_stream(stream, ()),
                                    pq=pq)
    layers, heads, d = cache.num_layers, cache.num_kv_heads, cache.head_dim
    counts = [int(off[i + 1] - off[i]) for i in range(len(off) - 1)]
    if len(set(counts)) <= 1:
        n = counts[0] if counts else 0
        return k.reshape(layers, heads, n, d), v.reshape(layers, heads, n, d)
    ks = [[k[off[l * heads + h]:off[l * heads + h + 1]] for h in range(heads)] for l in range(layers)]
    vs = [[v[off[l * heads + h]:off[l * heads + h + 1]] for h in range(heads)] for l in range(layers)]
    return ks, vs


def cache_codecs(cache):
    """How a cache's kept tokens are encoded and where its bytes go (header, positions, keys,
    key_scales, values, value_scales, raw_values, moments, total), per-layer ranks and the
    count of KVSplice outlier rows kept raw (raw_value_rows)."""
    return _kvcomp._cache_codecs(cache)

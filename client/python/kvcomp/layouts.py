"""Cache layouts the engine's kernels do not take directly, mapped onto ones they do.

The kernels are built for head dims 64, 128 and 256 with keys and values of one head dim. A head
of another size (Phi-3's 96), or keys and values of different sizes (an MLA latent), is stored
zero-padded to the next kernel head dim: a zero channel changes no dot product, norm, cosine or
distance the scorers compute, and decoding drops it again. The padding is stored (a raw 96-wide
head costs 128 channels); docs/integrations.md lists what each architecture costs.

Heads are split and merged for tensor parallelism by kvcomp.split_heads / kvcomp.merge_heads;
rank_heads and reshard map the caches one tensor-parallel size put onto a rank of another.

fp8 (e4m3) caches with their scales are taken as float32 (dequantize_fp8; quantizing back with the
same scale gives the same bytes); kvcomp.compress does it for float8_e4m3fn inputs given k_scale
and v_scale.
"""

from __future__ import annotations

from typing import Any

KERNEL_HEAD_DIMS = (64, 128, 256)

__all__ = ["KERNEL_HEAD_DIMS", "kernel_head_dim", "pad_head_dim", "is_fp8", "dequantize_fp8",
           "rank_heads", "reshard"]


def kernel_head_dim(*dims: int) -> int:
    """The smallest kernel head dim holding every one of `dims` (key and value head dims).
    ValueError when one is not positive or above the largest (256)."""
    if not dims:
        raise ValueError("kernel_head_dim: no head dim given")
    for d in dims:
        if int(d) <= 0:
            raise ValueError(f"head_dim {d} must be positive")
    top = max(int(d) for d in dims)
    for k in KERNEL_HEAD_DIMS:
        if top <= k:
            return k
    raise ValueError(f"head_dim {top} is above the largest kernel head dim "
                     f"({KERNEL_HEAD_DIMS[-1]}); kvcomp stores heads of at most "
                     f"{KERNEL_HEAD_DIMS[-1]} channels")


def pad_head_dim(x: Any, d: int) -> Any:
    """`x` (NumPy array or torch tensor, head dim last) zero-padded to `d` channels; `x` itself
    when it has them already. ValueError when it has more."""
    have = int(x.shape[-1])
    if have == d:
        return x
    if have > d:
        raise ValueError(f"pad_head_dim: {have} channels do not fit in {d}")
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        return torch.nn.functional.pad(x, (0, d - have))
    import numpy as np
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - have)])


# --- fp8 (e4m3) caches ---

def _e4m3_table():
    """float32 value of every e4m3fn byte (1 sign, 4 exponent bits biased by 7, 3 mantissa
    bits; exponent 0 subnormal; 0x7f and 0xff NaN; no infinities)."""
    import numpy as np
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = sign * val
    val[(exp == 15) & (man == 7)] = np.nan
    return val.astype(np.float32)


_E4M3 = None


def is_fp8(x: Any) -> bool:
    """True for a torch float8_e4m3fn tensor or a NumPy/ml_dtypes float8_e4m3fn array."""
    return "float8_e4m3fn" in str(getattr(x, "dtype", ""))


def dequantize_fp8(x: Any, scale: Any = 1.0) -> Any:
    """An fp8 e4m3 cache (a torch float8_e4m3fn tensor, on any device, an ml_dtypes
    float8_e4m3fn array, or a uint8 array of e4m3 bytes) times its scale, in float32: the
    e4m3 value is exact in float32 and the product is rounded once (2^-24 relative), far below
    e4m3's own step, so quantizing the result with the same scale gives back the same bytes.
    scale: a number or an array/tensor broadcasting
    against x (per tensor as vLLM's k_scale/v_scale, per kv head as [heads, 1, 1], ...).
    ValueError for another dtype."""
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        if x.dtype != torch.float8_e4m3fn:
            raise ValueError(f"dequantize_fp8: dtype {x.dtype}, not float8_e4m3fn")
        s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        return x.to(torch.float32) * s
    import numpy as np
    global _E4M3
    if _E4M3 is None:
        _E4M3 = _e4m3_table()
    a = np.asarray(x)
    if is_fp8(a):
        a = a.view(np.uint8)
    if a.dtype != np.uint8:
        raise ValueError(f"dequantize_fp8: dtype {a.dtype}, not float8_e4m3fn or uint8 bytes")
    return _E4M3[a] * np.asarray(scale, np.float32)


# --- tensor-parallel shares of kv heads ---

def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int):
    """(begin, end): the kv heads tensor-parallel rank `tp_rank` of `tp_size` holds, as vLLM
    and Megatron split them: num_kv_heads / tp_size consecutive heads each when tp_size divides
    the heads; when there are more ranks than heads, each head is replicated on tp_size /
    num_kv_heads consecutive ranks (one head each). ValueError for sizes that do neither."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size or num_kv_heads <= 0:
        raise ValueError(f"rank {tp_rank} of {tp_size} over {num_kv_heads} kv heads")
    if num_kv_heads % tp_size == 0:
        n = num_kv_heads // tp_size
        return tp_rank * n, (tp_rank + 1) * n
    if tp_size % num_kv_heads == 0:
        h = tp_rank // (tp_size // num_kv_heads)
        return h, h + 1
    raise ValueError(f"{num_kv_heads} kv heads do not split over {tp_size} ranks")


def reshard(parts, num_kv_heads: int, tp_rank: int, tp_size: int):
    """The cache of rank `tp_rank` of `tp_size` from the caches `parts` that the ranks of
    another tensor-parallel size put (one per rank, in rank order, e.g. read back from their
    shards): the parts are merged into the whole cache (replicas, when that size had more ranks
    than heads, counted once) and the new rank's heads are sliced from it. Byte for byte what
    those heads hold (kvcomp.merge_heads / slice_heads)."""
    import kvcomp
    old = len(parts)
    unique = []
    for r in range(old):
        begin, _ = rank_heads(num_kv_heads, old, r)
        if not unique or begin >= unique[-1][0] + unique[-1][1].num_kv_heads:
            unique.append((begin, parts[r]))
    whole = kvcomp.merge_heads([p for _, p in unique])
    if whole.num_kv_heads != num_kv_heads:
        raise ValueError(f"the parts hold {whole.num_kv_heads} kv heads, not {num_kv_heads}")
    begin, end = rank_heads(num_kv_heads, tp_size, tp_rank)
    return whole if (begin, end) == (0, num_kv_heads) else kvcomp.slice_heads(whole, begin, end)

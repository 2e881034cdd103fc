"""Cache layouts the engine's kernels do not take directly, mapped onto ones they do.

The kernels are built for head dims 64, 128 and 256 with keys and values of one head dim. A head
of another size (Phi-3's 96), or keys and values of different sizes (an MLA latent), is stored
zero-padded to the next kernel head dim: a zero channel changes no dot product, norm, cosine or
distance the scorers compute, and decoding drops it again. The padding is stored (a raw 96-wide
head costs 128 channels); docs/integrations.md lists what each architecture costs.

Heads are split and merged for tensor parallelism by kvcomp.split_heads / kvcomp.merge_heads.
"""

from __future__ import annotations

from typing import Any

KERNEL_HEAD_DIMS = (64, 128, 256)

__all__ = ["KERNEL_HEAD_DIMS", "kernel_head_dim", "pad_head_dim"]


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

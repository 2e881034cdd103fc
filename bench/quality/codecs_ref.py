"""Float torch references of full-length KV codecs: kvcomp's candidates and the peers' schemes,
with the bytes each stores (research; bench/quality/suite.py).

Every codec takes a cache tensor X [L, H, N, d] (float32, bf16-rounded) and returns
(decoded X, stored bytes, code entropy bytes or None). Bytes count codes, scales and any
per-head constants; "entropy" is the order-0 entropy of the codes (per layer and tensor) plus
the same side data: what an entropy coder of the codes (zstd's Huffman stage, rANS) can reach,
before its framing.

Codecs (spec strings):
  bf16                  the cache as is
  fp8                   float8 e4m3 per element, no scale (LMCache's fp8 serde's format)
  int{b}t               symmetric int-b per token and head (one fp16 scale per d values)
  kivi{b}               KIVI: keys per channel in groups of 32 tokens, values per token in groups
                        of 32 channels, asymmetric (fp16 scale and zero per group); no
                        full-precision residual window at full length
  tq{b}                 TurboQuant (MSE variant): randomized Hadamard rotation, fp16 norm per
                        vector, each coordinate of the unit vector on the Lloyd-Max codebook of
                        N(0, 1/d) at b bits
  hq{b}[c][g{G}]        kvcomp candidate: optional per-channel centring and scaling over the
                        sequence (c: per head, fp16 mean and scale per channel; the per-channel
                        key outliers), randomized Hadamard rotation, asymmetric int-b per token
                        in groups of G (default d) with fp16 scale and minimum
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch


def _f16(x):
    return x.half().float()


@lru_cache(maxsize=8)
def _hadamard_np(d: int):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    rs = np.random.default_rng(0x6b76).choice([-1.0, 1.0], size=d)  # fixed random signs
    return (h * rs[None, :]) / math.sqrt(d)  # rows: x -> x @ H^T


def hadamard(d, device):
    return torch.tensor(_hadamard_np(d), dtype=torch.float32, device=device)


def _entropy_bits(codes: torch.Tensor) -> float:
    """Order-0 entropy (total bits) of integer codes, per leading (layer) slice."""
    tot = 0.0
    for c in codes:
        v = c.reshape(-1).long()
        v = v - v.min()
        cnt = torch.bincount(v).float()
        p = cnt[cnt > 0] / v.numel()
        tot += float(-(p * p.log2()).sum()) * v.numel()
    return tot


def _asym(x, bits, group):
    """Asymmetric int-b along the last dim in groups; returns decoded, codes, n groups."""
    shp = x.shape
    n = shp[-1]
    xg = x.reshape(*shp[:-1], n // group, group)
    lo = _f16(xg.amin(-1, keepdim=True))
    hi = xg.amax(-1, keepdim=True)
    qmax = 2 ** bits - 1
    sc = _f16(((hi - lo) / qmax).clamp_min(1e-4))
    q = ((xg - lo) / sc).round().clamp(0, qmax)
    return (q * sc + lo).reshape(shp), q.reshape(shp), xg.numel() // group


def _sym(x, bits, group):
    shp = x.shape
    n = shp[-1]
    xg = x.reshape(*shp[:-1], n // group, group)
    qmax = 2 ** (bits - 1) - 1
    sc = _f16((xg.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-4))
    q = (xg / sc).round().clamp(-qmax, qmax)
    return (q * sc).reshape(shp), q.reshape(shp), xg.numel() // group


@lru_cache(maxsize=16)
def lloyd_max(bits: int):
    """Lloyd-Max centroids of N(0, 1) at `bits` bits (numerical, on a fine grid)."""
    x = np.linspace(-6, 6, 24001)
    p = np.exp(-x * x / 2)
    k = 2 ** bits
    c = np.quantile(np.random.default_rng(0).standard_normal(200000), (np.arange(k) + 0.5) / k)
    for _ in range(200):
        b = (c[1:] + c[:-1]) / 2
        idx = np.searchsorted(b, x)
        c = np.array([(x[idx == i] * p[idx == i]).sum() / max(p[idx == i].sum(), 1e-30)
                      for i in range(k)])
    return c


def encode(spec: str, X: torch.Tensor, is_key: bool):
    L, H, N, d = X.shape
    elts = X.numel()
    if spec == "bf16":
        return X, 2.0 * elts, None
    if spec == "fp8":
        y = X.to(torch.float8_e4m3fn).float()
        return y, 1.0 * elts, None
    if spec.startswith("int") and spec.endswith("t"):
        b = int(spec[3:-1])
        y, q, ng = _sym(X, b, d)
        return y, elts * b / 8 + 2 * ng, _entropy_bits(q) / 8 + 2 * ng
    if spec.startswith("kivi"):
        b = int(spec[4:])
        if is_key:  # per channel, groups of 32 tokens
            xt = X.transpose(2, 3)
            pad = (-N) % 32
            if pad:
                xt = torch.nn.functional.pad(xt.reshape(-1, d, N), (0, pad),
                                             mode="replicate").reshape(L, H, d, N + pad)
            y, q, ng = _asym(xt, b, 32)
            y = y[..., :N].transpose(2, 3)
        else:
            y, q, ng = _asym(X, b, 32)
        return y, elts * b / 8 + 4 * ng, _entropy_bits(q) / 8 + 4 * ng
    if spec.startswith("tq"):
        b = int(spec[2:])
        Hm = hadamard(d, X.device)
        nrm = X.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        u = (X / nrm) @ Hm.T * math.sqrt(d)  # ~ N(0, 1) per coordinate
        c = torch.tensor(lloyd_max(b), dtype=torch.float32, device=X.device)
        bnd = (c[1:] + c[:-1]) / 2
        q = torch.bucketize(u, bnd)
        y = (c[q] / math.sqrt(d)) @ Hm * _f16(nrm)
        nv = elts // d
        return y, elts * b / 8 + 2 * nv, _entropy_bits(q) / 8 + 2 * nv
    if spec.startswith("hq"):
        rest = spec[2:]
        g = d
        if "g" in rest:
            rest, gs = rest.split("g")
            g = int(gs)
        centre = rest.endswith("c")
        b = int(rest.rstrip("c"))
        side = 0.0
        Z = X
        if centre:
            mu = _f16(X.mean(dim=2, keepdim=True))
            sd = _f16(X.std(dim=2, keepdim=True).clamp_min(1e-4))
            Z = (X - mu) / sd
            side = L * H * d * 4.0
        Hm = hadamard(d, X.device)
        R = Z @ Hm.T
        yq, q, ng = _asym(R, b, g)
        y = yq @ Hm
        if centre:
            y = y * sd + mu
        return y, elts * b / 8 + 4 * ng + side, _entropy_bits(q) / 8 + 4 * ng + side
    raise ValueError(f"unknown codec {spec}")

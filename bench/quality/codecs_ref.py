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
  kvhq{b}               kvcomp's engine codec hq{b} (codecs/src/hq.cc, docs/format.md "The
                        Hadamard codec"), operation for operation: the fixed signs, the
                        unnormalized butterfly transform, f16 minimum rounded down and step
                        rounded up, round-half-even codes; its codes are bit-identical to the
                        engine's (tests/python/test_hq_mirror.py checks it against kvcomp)
"""

from __future__ import annotations

import math
import os
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


HQ_SIGNS = (0x9e3779b97f4a7c15, 0xbf58476d1ce4e5b9, 0x94d049bb133111eb, 0x2545f4914f6cdd1d)


def hq_signs(d, device=None):
    s = [-1.0 if (HQ_SIGNS[(i >> 6) & 3] >> (i & 63)) & 1 else 1.0 for i in range(d)]
    return torch.tensor(s, dtype=torch.float32, device=device)


def hq_fwht(u):
    """The engine's unnormalized Walsh-Hadamard transform along the last dim (f32, the same
    butterflies in the same order: stage h pairs j and j + h within blocks of 2h)."""
    shp = u.shape
    d = shp[-1]
    h = 1
    while h < d:
        v = u.reshape(*shp[:-1], d // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        u = torch.stack([a + b, a - b], dim=-2).reshape(shp)
        h *= 2
    return u


def _half_bits_step(h, up):
    """The next f16 up (or down) in value order of f16 tensor h, through its bits."""
    b = h.view(torch.int16).to(torch.int32) & 0xFFFF
    zero = (b & 0x7FFF) == 0
    neg = (b & 0x8000) != 0
    if up:
        nb = torch.where(zero, torch.full_like(b, 0x0001), torch.where(neg, b - 1, b + 1))
    else:
        nb = torch.where(zero, torch.full_like(b, 0x8001), torch.where(neg, b + 1, b - 1))
    nb = torch.where(nb >= 0x8000, nb - 0x10000, nb).to(torch.int16)
    return nb.view(torch.float16)


def _half_at_most(v):
    h = v.half()
    return torch.where(h.float() > v, _half_bits_step(h, False), h)


def _half_at_least(v):
    h = v.half()
    return torch.where(h.float() < v, _half_bits_step(h, True), h)


def hq_engine_encode(X, bits):
    """X [..., d] f32 -> (codes int64 [..., d], lo f16 [...], step f16 [...])."""
    d = X.shape[-1]
    c = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32, device=X.device)
    y = hq_fwht(X.float() * hq_signs(d, X.device)) * c
    mn, mx = y.amin(-1), y.amax(-1)
    if not bool(torch.isfinite(y).all()) or float(mn.min()) < -65504 or float(mx.max()) > 65504:
        raise ValueError("hq: non-finite row or outside the f16 range")
    lo = _half_at_most(mn)
    lof = lo.float()
    qmax = float(2 ** bits - 1)
    s = (mx - lof) / torch.tensor(qmax, dtype=torch.float32, device=X.device)
    step = torch.where(s > 0, _half_at_least(s), torch.zeros_like(s).half())
    stf = step.float()
    t = torch.round((y - lof[..., None]) / torch.where(stf > 0, stf, torch.ones_like(stf))[..., None])
    q = torch.where(stf[..., None] > 0, t.clamp(0, qmax), torch.zeros_like(t)).to(torch.int64)
    return q, lo, step


def hq_engine_decode(q, lo, step):
    d = q.shape[-1]
    c = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32, device=q.device)
    # fma(q, step, lo): the f64 product and sum are exact here, so one rounding to f32
    y = (q.double() * step.double()[..., None] + lo.double()[..., None]).float()
    return hq_signs(d, q.device) * (hq_fwht(y) * c)


def hq_engine_records(q, lo, step, bits):
    """The engine's row records (bytes) of codes q [rows, d]: lo, step (u16 LE), packed codes."""
    qn = q.cpu().numpy().astype(np.uint8)
    rows, d = qn.shape
    bitsarr = np.unpackbits(qn[..., None], axis=-1, bitorder="little")[..., :bits]
    packed = np.packbits(bitsarr.reshape(rows, d * bits), axis=-1, bitorder="little")
    head = np.stack([lo.cpu().numpy().view(np.uint16), step.cpu().numpy().view(np.uint16)], -1)
    return np.concatenate([head.astype("<u2").view(np.uint8).reshape(rows, 4), packed], axis=1)


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
    if spec.startswith("kvhq"):
        b = int(spec[4:])
        q, lo, step = hq_engine_encode(X, b)
        y = hq_engine_decode(q, lo, step)
        rows = elts // d
        return y, elts * b / 8 + 4 * rows, _entropy_bits(q) / 8 + 4 * rows
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


# --- calibrated decorrelation (KVTC-style): per layer and kv head, a PCA basis of the cache's
# keys or values fitted once per model on calibration windows; every token's centred vector is
# projected on it, each component gets an integer bit width by reverse water-filling of the
# calibration variances (greedy: the next bit goes where it lowers the expected squared error
# most, Lloyd-Max Gaussian distortion per width), and is coded on the Lloyd-Max codebook of
# N(0, 1) scaled by the component's calibration deviation. A zero-width component decodes to the
# calibration mean. The per-row record is ceil(sum of widths / 8) bytes, nothing else; the
# basis, mean, deviations and widths are stored once per model (like KVSplice's projections),
# not per cache. "n": an f16 scale per row (the row's RMS in units of the deviations) divides
# the components before coding (outlier rows, e.g. attention sinks).
#
# spec: pca{bits}[n], bits the average width per element (e.g. pca2.5, pca3n).

_PCA = {}  # "K" / "V": dict(mu [L,H,d], U [L,H,d,d] (columns by falling variance), sd [L,H,d])
PCA_MAXBITS = 8


def pca_calibrate(Ks, Vs):
    """Fits the bases on calibration caches (lists of [L, H, N, d] float32)."""
    for name, Xs in (("K", Ks), ("V", Vs)):
        X = torch.cat([x.double() for x in Xs], dim=2)
        mu = X.mean(dim=2)
        Xc = X - mu[:, :, None]
        C = torch.einsum("lhnd,lhne->lhde", Xc, Xc) / X.shape[2]
        lam, U = torch.linalg.eigh(C)
        lam, U = lam.flip(-1).clamp_min(0), U.flip(-1)
        _PCA[name] = {"mu": mu.float(), "U": U.float(), "sd": lam.sqrt().float(), "alloc": {}}
        _PCA[name + "_cal"] = [x for x in Xs]


@lru_cache(maxsize=16)
def _lm_mse(bits):
    """Expected squared error of the Lloyd-Max quantizer of N(0, 1) at `bits` (0: 1)."""
    if bits == 0:
        return 1.0
    c = lloyd_max(bits)
    x = np.linspace(-8, 8, 64001)
    p = np.exp(-x * x / 2)
    p /= p.sum()
    b = (c[1:] + c[:-1]) / 2
    q = c[np.searchsorted(b, x)]
    return float(((x - q) ** 2 * p).sum())


def pca_widths(sd, total):
    """Integer widths [..., d] summing to `total` per row of sd [..., d] (greedy water-filling)."""
    shp = sd.shape
    s2 = (sd.double() ** 2).reshape(-1, shp[-1]).cpu().numpy()
    w = np.zeros_like(s2, dtype=np.int64)
    gain = [_lm_mse(b) - _lm_mse(b + 1) for b in range(PCA_MAXBITS)] + [0.0]
    for r in range(s2.shape[0]):
        for _ in range(total):
            g = s2[r] * np.array([gain[b] for b in w[r]])
            i = int(np.argmax(g))
            w[r, i] += 1
    return torch.tensor(w.reshape(shp))


def _pca_quant(z, w):
    """z [..., d] in deviation units, widths w [..., d] (broadcast): codes and decoded values."""
    out = torch.zeros_like(z)
    codes = torch.zeros(z.shape, dtype=torch.int64, device=z.device)
    for b in range(1, PCA_MAXBITS + 1):
        sel = (w == b)
        if not bool(sel.any()):
            continue
        c = torch.tensor(lloyd_max(b), dtype=torch.float32, device=z.device)
        q = torch.bucketize(z, (c[1:] + c[:-1]) / 2)
        out = torch.where(sel, c[q], out)
        codes = torch.where(sel, q, codes)
    return codes, out


def pca_encode(spec, X, is_key):
    name = "K" if is_key else "V"
    st = _PCA[name]
    L, H, N, d = X.shape
    per_row = spec.endswith("n")
    avg = float(spec[3:].rstrip("n"))
    total = int(round(avg * d))
    if total not in st["alloc"]:
        st["alloc"][total] = pca_widths(st["sd"], total).to(X.device)  # [L, H, d]
    w = st["alloc"][total][:, :, None, :]
    mu, U, sd = (st[k].to(X.device) for k in ("mu", "U", "sd"))
    z = torch.einsum("lhnd,lhde->lhne", X - mu[:, :, None], U) / sd[:, :, None].clamp_min(1e-12)
    side = 0.0
    r = None
    if per_row:  # RMS over the coded components, f16
        wm = (w > 0).float()
        r = _f16(((z * z * wm).sum(-1, keepdim=True) / wm.sum(-1, keepdim=True).clamp_min(1))
                 .sqrt().clamp_min(1e-3))
        z = z / r
        side = 2.0 * L * H * N
    codes, zq = _pca_quant(z, w)
    if r is not None:
        zq = zq * r
    y = torch.einsum("lhne,lhde->lhnd", zq * sd[:, :, None], U) + mu[:, :, None]
    rec = math.ceil(total / 8)
    b = L * H * N * rec + side
    # static entropy coding: per (layer, head, component) code frequencies of the calibration
    # windows (tables stored once per model), cross-entropy of this cache's codes under them
    key = ("freq", total, per_row)
    if key not in st:
        Xc = torch.cat(_PCA[name + "_cal"], dim=2).to(X.device)
        zc = torch.einsum("lhnd,lhde->lhne", Xc - mu[:, :, None], U) / sd[:, :, None].clamp_min(1e-12)
        if per_row:
            wm = (w > 0).float()
            rc = _f16(((zc * zc * wm).sum(-1, keepdim=True) / wm.sum(-1, keepdim=True)
                       .clamp_min(1)).sqrt().clamp_min(1e-3))
            zc = zc / rc
        cc, _ = _pca_quant(zc, w)
        M = 2 ** PCA_MAXBITS
        oh = torch.zeros(L, H, d, M, device=X.device)
        oh.scatter_add_(3, cc.permute(0, 1, 3, 2), torch.ones_like(cc.permute(0, 1, 3, 2),
                                                                    dtype=torch.float32))
        lv = (2.0 ** w[:, :, 0, :]).float()  # levels per component
        p = (oh + 0.5) / (oh.sum(-1, keepdim=True) + 0.5 * lv[..., None])
        st[key] = -p.log2()  # bits per code [L, H, d, M]
    nb = st[key]
    bits = torch.gather(nb, 3, codes.permute(0, 1, 3, 2)).sum()
    e = float(bits) / 8 + side + L * H * 4  # + 4 bytes per (layer, head) stream for its length
    return y, b, e


_encode_base = encode


def encode(spec: str, X: torch.Tensor, is_key: bool):  # noqa: F811 - extends the one above
    if spec.startswith("pca"):
        return pca_encode(spec, X, is_key)
    return _encode_base(spec, X, is_key)


# --- the engine's calibrated basis codec (codecs/src/pq.cc, docs/format.md "The calibrated basis
# codec"), operation for operation in numpy f32: the same record bytes and decoded values ---

_PQ_INC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "codecs", "src", "pq_codebooks.inc")


@lru_cache(maxsize=1)
def pq_codebooks():
    """{width: f32 centroids} and the f32 boundaries, read from the engine's codebook file."""
    text = open(_PQ_INC).read()
    cents = {}
    for w in range(1, 9):
        body = text.split(f"kCentroids{w}[")[1].split("{", 1)[1].split("}", 1)[0]
        vals = [float.fromhex(v.strip().rstrip("f")) for v in body.split(",") if v.strip()]
        cents[w] = np.array(vals, dtype=np.float32)
    bounds = {w: ((c[:-1] + c[1:]) * np.float32(0.5)).astype(np.float32)
              for w, c in cents.items()}
    return cents, bounds


def pq_engine_encode(basis, head, x):
    """basis: dict of numpy arrays mean [heads, d], inv_scale [heads, d], widths [heads, d]
    (uint8), basis [heads, d, d], bits_total; x [rows, d] f32 -> records [rows, RecordBytes]."""
    _, bounds = pq_codebooks()
    x = np.asarray(x, np.float32)
    d = x.shape[1]
    B = basis["basis"][head].astype(np.float32)
    wd = basis["widths"][head]
    idx = np.nonzero(wd)[0]
    t = (x - basis["mean"][head].astype(np.float32)[None]).astype(np.float32)
    bt = B[idx].T  # [d, nc]
    acc = (bt[0][None] * t[:, :1]).astype(np.float32)
    for j in range(1, d):
        acc = (acc + (bt[j][None] * t[:, j:j + 1]).astype(np.float32)).astype(np.float32)
    u = (acc * basis["inv_scale"][head][idx].astype(np.float32)[None]).astype(np.float32)
    if np.isnan(u).any():
        raise ValueError("pq: overflow in the projection")
    rec = (int(basis["bits_total"]) + 7) // 8
    bits = np.zeros((x.shape[0], rec * 8), np.uint8)
    off = 0
    for k, c in enumerate(idx):
        w = int(wd[c])
        code = np.searchsorted(bounds[w], u[:, k], side="left")  # boundaries < u
        for i in range(w):
            bits[:, off + i] = (code >> i) & 1
        off += w
    return np.packbits(bits, axis=1, bitorder="little")


def pq_engine_decode(basis, head, records):
    cents, _ = pq_codebooks()
    rec = np.asarray(records, np.uint8)
    bits = np.unpackbits(rec, axis=1, bitorder="little").astype(np.int64)
    B = basis["basis"][head].astype(np.float32)
    wd = basis["widths"][head]
    d = B.shape[1]
    a = None
    off = 0
    for c in range(d):
        w = int(wd[c])
        if w == 0:
            continue
        code = sum(bits[:, off + i] << i for i in range(w))
        off += w
        v = (cents[w][code] * np.float32(basis["scale"][head][c])).astype(np.float32)
        term = (v[:, None] * B[c][None]).astype(np.float32)
        a = term if a is None else (a + term).astype(np.float32)
    mean = basis["mean"][head].astype(np.float32)[None]
    if a is None:
        return np.repeat(mean, rec.shape[0], axis=0)
    return (mean + a).astype(np.float32)


def pq_basis_bytes(basis):
    """The basis' serialized form (KVPQ version 1) and its fingerprint."""
    L, H, d = basis["num_layers"], basis["num_kv_heads"], basis["mean"].shape[1]
    pay = bytearray()
    for h in range(L * H):
        for k in ("mean", "scale", "inv_scale"):
            pay += np.asarray(basis[k][h], "<f4").tobytes()
        pay += np.asarray(basis["basis"][h], "<f4").tobytes()
        pay += np.asarray(basis["widths"][h], np.uint8).tobytes()
    fp = 0xcbf29ce484222325
    for byte in bytes(pay):
        fp = ((fp ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    fp = fp or 1
    head = b"KVPQ" + bytes([1, 0, 0, 0]) + np.array([L, H, d, basis["bits_total"]],
                                                     "<u4").tobytes() + np.array([fp], "<u8").tobytes()
    return head + bytes(pay), fp

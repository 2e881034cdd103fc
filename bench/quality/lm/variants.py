"""Float torch references of eviction policies, corrections of the evicted set and codecs,
measured on a transformers model without kvcomp's extension (research; eval.py --variants).

Everything here runs in float32 torch on the model's device, on the cache as kvcomp receives it
(keys and values rounded to bf16). Nothing here is the product: a variant that earns its place is
implemented in the engine (CPU and CUDA) afterwards.

Policies (which tokens of each kv head are kept; kept = int(n * (1 - ratio)) per head, the first
4 positions always kept, as kvcomp's default protection):
  manifold           ||k - mean(k)|| (kvcomp's manifold)
  keydiff            -cos(k, mean of k/||k||) (kvcomp's keydiff)
  streaming          sink + most recent (kvcomp's streaming)
  manifold_rF        manifold with the most recent F x kept tokens protected (n_recent)
  mix, mix_rF        manifold and keydiff ranks added per head (rank-combined), then top-kept
  pyramid_rF         manifold_rF with per-layer budgets falling linearly from 1.5x to 0.5x the
                     uniform budget (same total)
  adakv_rF           manifold_rF scores, AdaKV head budgets (safeguard 0.2, layer-wide top)
  knorm, random      kvcomp's knorm (-||k||) and random scorers
  windowed           kvcomp's windowed_manifold, window 1024 (mean of the window's keys)
  snapkv             kvcomp's SnapKV: attention of the context's last 64 queries, pooled over 5
Corrections (what stands in for each head's evicted set in every softmax; t = 1/sqrt(d)):
  none
  first              kvcomp's MomentKV virtual token: logit t q.mu_k + ln n, value mu_v + t C q,
                     C = Cov(v, k) (count, key sum, value sum, d x d sum of v k^T, float32)
  first_fp16         the same, the d x d sum stored in fp16
  first_lrR          the same, C replaced by its best rank-R approximation (two d x R factors)
  second             first plus the second-order partition term t^2/2 q^T S q (S = Cov(k, k))
  second_diag        first plus t^2/2 sum_i q_i^2 S_ii (diagonal of S only)
  second_sP          first plus P% of the second-order term
  first_mP           first with the evicted mass scaled to P% (logit + ln(P/100))
  kfirstK            K k-means clusters of the evicted keys, each a first-order token with its
                     own C (logit t q.mu_k,c + ln n_c, value mu_v,c + t C_c q)
  kmeansK            evicted keys clustered (K-means, K clusters, 10 iterations); one virtual
                     token per cluster: logit t q.mu_k,c + ln n_c, value mu_v,c (no C)
  windowW            one virtual token per window of W positions over the evicted tokens in it
  merge_v            every evicted token joins the kept token of the same head whose key is
                     nearest in cosine; that token's value becomes the group's mean value and
                     its logit gains ln(group size) (key unchanged)
  merge_kv           the same with the key also the group's mean
Every correction is exact when nothing is evicted (no virtual token, counts 1) and is a sum over
the evicted tokens (mergeable across blocks), except kmeans (its clusters are re-fitted when
blocks merge: weighted K-means over the union of the blocks' centroids) and merge_* (block-local:
an evicted token joins a kept token of its own block).
Codecs (kept tokens; moments are taken from the uncoded cache): keys raw bf16, int8 (scale per
head and channel, f32), int4 (scale per head, channel and group of 128 tokens, f16); values raw
bf16 or KVSplice-like: projection on the top-r eigenvectors of the value second moment of
calibration windows (per layer and head), latents int8 (r = d/2) or int4 (r = 3d/4) with an f16
scale per token and group of 32 latents.

Bytes per token are counted at the context length N of the pass-key samples: kept tokens x (key
+ value + 4-byte position) + the correction's stored summaries + the codecs' scales, per kv head,
against the bf16 cache (2 x 2 x d bytes per head and token). kvcomp's own encoding adds a
fixed header and section table (about 0.5% at 4K).
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache

REF_ATTN = "kvcomp_ref"
N_SINK = 4


# --- prefill ---

SNAPKV_WINDOW, SNAPKV_POOL = 64, 5
_QUERIES: List[torch.Tensor] = []


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa, recording the last SNAPKV_WINDOW queries of every layer (after RoPE)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    _QUERIES.append(query[0, :, -SNAPKV_WINDOW:].float())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("kvcomp_capture", _capture_attention)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, with_queries: bool = False):
    """keys, values [L, Hk, N, d] (bf16-rounded, float32) and the last position's logits; with
    with_queries also the last SNAPKV_WINDOW queries [L, Hq, w, d] (bf16-rounded)."""
    _QUERIES.clear()
    model.set_attn_implementation("kvcomp_capture" if with_queries else "sdpa")
    try:
        out = model(ids[None].to(model.device), use_cache=True)
    finally:
        model.set_attn_implementation("sdpa")
    pkv = out.past_key_values
    K = torch.stack([pkv.layers[l].keys[0] for l in range(len(pkv.layers))])
    V = torch.stack([pkv.layers[l].values[0] for l in range(len(pkv.layers))])
    rnd = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    if with_queries:
        Q = rnd(torch.stack(list(_QUERIES)))
        _QUERIES.clear()
        return rnd(K), rnd(V), out.logits[0, -1].float(), Q
    return rnd(K), rnd(V), out.logits[0, -1].float()


# --- policies: keep masks [L, H, N] ---

def _scores_manifold(K):
    return (K - K.mean(dim=2, keepdim=True)).norm(dim=-1)


def _scores_keydiff(K):
    a = (K / K.norm(dim=-1, keepdim=True).clamp_min(1e-8)).mean(dim=2, keepdim=True)
    cos = (K * a).sum(-1) / (K.norm(dim=-1) * a.norm(dim=-1)).clamp_min(1e-8)
    return -cos


def _scores_knorm(K):
    return -K.norm(dim=-1)


def _scores_windowed(K, window=1024):
    L, H, N, d = K.shape
    s = torch.empty(L, H, N, device=K.device)
    for w0 in range(0, N, window):
        Kw = K[:, :, w0:w0 + window]
        s[:, :, w0:w0 + window] = (Kw - Kw.mean(dim=2, keepdim=True)).norm(dim=-1)
    return s


def _scores_random(K, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.rand(K.shape[:3], generator=g).to(K.device)


def _scores_snapkv(K, Q):
    """kvcomp's SnapKV: the window's queries attend causally over all keys; weights on the
    prefix averaged over queries, average-pooled (zero padding, / width), averaged over the GQA
    group; the window's own tokens get the maximum."""
    L, H, N, d = K.shape
    hq, w = Q.shape[1], Q.shape[2]
    g = hq // H
    Kq = K.repeat_interleave(g, dim=1)
    lg = torch.einsum("lhwd,lhnd->lhwn", Q, Kq) / math.sqrt(d)
    qpos = torch.arange(N - w, N, device=K.device)[:, None]
    lg = lg.masked_fill(torch.arange(N, device=K.device)[None, :] > qpos, float("-inf"))
    a = torch.softmax(lg, dim=-1)[..., :N - w].mean(dim=2)  # [L, hq, N - w]
    a = torch.nn.functional.avg_pool1d(a.reshape(L * hq, 1, -1), SNAPKV_POOL, 1,
                                       SNAPKV_POOL // 2, count_include_pad=True).reshape(L, hq, -1)
    a = a.reshape(L, H, g, -1).mean(dim=2)
    s = torch.full((L, H, N), 0.0, device=K.device)
    s[..., :N - w] = a
    s[..., N - w:] = a.amax() + 1.0
    return s


def _ranks(s):
    """Rank of each score within its head (0 = lowest), float."""
    return s.argsort(dim=-1).argsort(dim=-1).float()


def _protect(s, n_recent, n_sink=N_SINK):
    s = s.clone()
    s[..., :n_sink] = float("inf")
    if n_recent > 0:
        s[..., -n_recent:] = float("inf")
    return s


def _topk_mask(s, kept):
    m = torch.zeros_like(s, dtype=torch.bool)
    idx = s.topk(kept, dim=-1).indices
    m.scatter_(-1, idx, True)
    return m


def policy_mask(name: str, K: torch.Tensor, ratio: float, Q=None, seed=0) -> torch.Tensor:
    L, H, N, _ = K.shape
    kept = int(N * (1.0 - ratio))
    if ratio <= 0:
        return torch.ones(L, H, N, dtype=torch.bool, device=K.device)
    # NAME_rNN: NN% of the kept budget the most recent tokens; NAME_rNNsS: and S sink tokens
    # (default N_SINK)
    base, _, frac = name.partition("_r")
    frac, _, sink = frac.partition("s")
    n_recent = int(kept * int(frac) / 100) if frac else 0
    if sink:
        n_sink = int(sink)
        n_recent = min(n_recent, kept - n_sink)  # the engine's cap: the sink keeps its room
        if base != "manifold":
            raise ValueError(f"sink size only with manifold: {name}")
        return _topk_mask(_protect(_scores_manifold(K), n_recent, n_sink), kept)
    if base == "streaming":
        s = torch.arange(N, device=K.device, dtype=torch.float32).expand(L, H, N)
        return _topk_mask(_protect(s, 0), kept)
    if base == "keydiff":
        return _topk_mask(_protect(_scores_keydiff(K), n_recent), kept)
    if base == "knorm":
        return _topk_mask(_protect(_scores_knorm(K), n_recent), kept)
    if base == "windowed":  # windowed_manifold, window 1024
        return _topk_mask(_protect(_scores_windowed(K), n_recent), kept)
    if base == "random":
        return _topk_mask(_protect(_scores_random(K, seed), n_recent), kept)
    if base == "snapkv":
        return _topk_mask(_protect(_scores_snapkv(K, Q), n_recent), kept)
    if base == "manifold":
        return _topk_mask(_protect(_scores_manifold(K), n_recent), kept)
    if base == "mix":
        s = _ranks(_scores_manifold(K)) + _ranks(_scores_keydiff(K))
        return _topk_mask(_protect(s, n_recent), kept)
    if base == "pyramid":
        s = _protect(_scores_manifold(K), n_recent)
        m = torch.zeros(L, H, N, dtype=torch.bool, device=K.device)
        w = np.linspace(1.5, 0.5, L) if L > 1 else np.ones(1)
        for l in range(L):
            b = min(N, max(N_SINK + n_recent, int(round(kept * w[l]))))
            m[l] = _topk_mask(s[l], b)
        return m
    if base == "adakv":
        s = _protect(_scores_manifold(K), n_recent)
        safe = max(int(kept * 0.2), min(kept, N_SINK + n_recent))
        m = _topk_mask(s, safe)
        rest = H * kept - H * safe
        for l in range(L):
            sl = s[l].masked_fill(m[l], float("-inf")).reshape(-1)
            idx = sl.topk(rest).indices
            ml = m[l].reshape(-1).clone()
            ml[idx] = True
            m[l] = ml.reshape(H, N)
        return m
    raise ValueError(f"unknown policy {name}")


# --- codecs of the kept tokens ---

def calibrate_values(Vs: List[torch.Tensor], rank: int) -> torch.Tensor:
    """Per layer and head, the top-`rank` eigenvectors of the values' second moment: [L, H, d, r]."""
    V = torch.cat(Vs, dim=2)
    M = torch.einsum("lhnd,lhne->lhde", V, V) / V.shape[2]
    _, vec = torch.linalg.eigh(M.double())
    return vec[..., -rank:].flip(-1).float()


def _quant_groups(x, bits, group, dim):
    """Symmetric quantise-dequantise of x in groups of `group` along dim (f16 scales)."""
    qmax = 2 ** (bits - 1) - 1
    xs = x.movedim(dim, -1)
    shp = xs.shape
    n = shp[-1]
    pad = (-n) % group
    xp = torch.nn.functional.pad(xs, (0, pad)).reshape(*shp[:-1], -1, group)
    sc = (xp.abs().amax(-1, keepdim=True) / qmax).half().float().clamp_min(1e-12)
    q = (xp / sc).round().clamp(-qmax - 1, qmax) * sc
    return q.reshape(*shp[:-1], -1)[..., :n].movedim(-1, dim)


def code_keys(K, mask, codec):
    """Keys after the key codec (kept rows only matter)."""
    if codec == "raw":
        return K
    if codec == "int8":  # f32 scale per (head, channel) over the kept keys
        sc = (K.abs() * mask[..., None]).amax(dim=2, keepdim=True) / 127
        sc = sc.clamp_min(1e-12)
        return (K / sc).round().clamp(-127, 127) * sc
    if codec == "int4":  # per (head, channel), groups of 128 tokens along the sequence
        return _quant_groups(K * mask[..., None], 4, 128, dim=2)
    raise ValueError(codec)


def code_values(V, codec, proj):
    if codec == "raw":
        return V
    bits = {"splice8": 8, "splice4": 4}[codec]
    z = torch.einsum("lhnd,lhdr->lhnr", V, proj)
    z = _quant_groups(z, bits, 32, dim=-1)
    return torch.einsum("lhnr,lhdr->lhnd", z, proj)


def codec_bytes(key_codec, value_codec, d, proj_rank):
    """(bytes per kept token and head, bytes per head fixed) of the codecs."""
    kb = {"raw": 2 * d, "int8": d, "int4": d / 2 + 2 * d / 128}[key_codec]
    kfix = {"raw": 0, "int8": 4 * d, "int4": 0}[key_codec]
    if value_codec == "raw":
        vb = 2 * d
    else:
        bits = {"splice8": 8, "splice4": 4}[value_codec]
        vb = proj_rank * bits / 8 + 2 * math.ceil(proj_rank / 32)
    return kb + vb + 4, kfix


# --- corrections: per layer, a prefix for attention ---

class Prefix:
    """keys, values [H, n, d] (kept, padded), bias [H, n] (0 or ln count; -inf padding); virtual
    tokens vk, vv [H, M, d], vbias [H, M] (ln n; -inf empty); vC [H, d, d] (value t C q, M = 1);
    vS [H, d, d] (logit t^2/2 q^T S q, M = 1)."""

    def __init__(self, keys, values, bias, vk=None, vv=None, vbias=None, vC=None, vS=None):
        self.keys, self.values, self.bias = keys, values, bias
        self.vk, self.vv, self.vbias, self.vC, self.vS = vk, vv, vbias, vC, vS


def _gather(mask_l, X):
    """Kept rows of X [H, N, d] padded to the layer's largest head: [H, n, d], bias [H, n]."""
    H, N, d = X.shape
    cnt = mask_l.sum(-1)
    n = int(cnt.max())
    idx = torch.sort((~mask_l).to(torch.int8), dim=-1, stable=True).indices[:, :n]
    out = torch.gather(X, 1, idx[..., None].expand(H, n, d))
    valid = torch.arange(n, device=X.device)[None, :] < cnt[:, None]
    bias = torch.where(valid, 0.0, float("-inf"))
    return out, bias, idx, valid


def _kmeans(X, w, k, iters=10):
    """Weighted K-means per batch row: X [H, N, d], w [H, N] (0/1). Centroid sums and counts."""
    H, N, d = X.shape
    # initial centroids: the weighted tokens at evenly spaced ranks of position
    csum = w.cumsum(-1)
    tot = csum[:, -1:]
    targets = (torch.arange(k, device=X.device)[None, :] + 0.5) / k * tot
    init = torch.searchsorted(csum.contiguous(), targets.contiguous()).clamp(max=N - 1)
    C = torch.gather(X, 1, init[..., None].expand(H, k, d))
    for _ in range(iters):
        dist = (X * X).sum(-1, keepdim=True) - 2 * X @ C.transpose(1, 2) + \
            (C * C).sum(-1)[:, None, :]
        a = dist.argmin(-1)
        oh = torch.nn.functional.one_hot(a, k).float() * w[..., None]
        cnt = oh.sum(1)
        C = torch.where(cnt[..., None] > 0, oh.transpose(1, 2) @ X / cnt.clamp_min(1)[..., None], C)
    return a, oh, cnt


def build_prefixes(K, V, mask, corr, Kc=None, Vc=None, window_n=None):
    """Per layer Prefix for keep mask [L, H, N] under correction `corr`; Kc/Vc the coded keys and
    values of the kept tokens (default K, V). Moments come from the uncoded K, V."""
    Kc = K if Kc is None else Kc
    Vc = V if Vc is None else Vc
    L, H, N, d = K.shape
    out = []
    for l in range(L):
        m = mask[l]
        ev = (~m).float()
        nev = ev.sum(-1)  # [H]
        kk, bias, idx, valid = _gather(m, Kc[l])
        vv, _, _, _ = _gather(m, Vc[l])
        p = Prefix(kk, vv, bias)
        if corr == "none" or float(nev.max()) == 0:
            out.append(p)
            continue
        logn = torch.where(nev > 0, nev.clamp_min(1).log(), float("-inf"))
        if corr.startswith("kfirst"):  # clusters, each a first-order token with its own C
            k = int(corr[len("kfirst"):])
            _, oh, cnt = _kmeans(K[l], ev, k)
            n_ = cnt.clamp_min(1)[..., None]
            mk = oh.transpose(1, 2) @ K[l] / n_
            mv = oh.transpose(1, 2) @ V[l] / n_
            S = torch.einsum("hnc,hni,hnj->hcij", oh, V[l], K[l]) / n_[..., None]
            p.vk, p.vv = mk, mv
            p.vbias = torch.where(cnt > 0, cnt.clamp_min(1).log(), float("-inf"))
            p.vC = S - mv[..., :, None] * mk[..., None, :]
        elif corr.startswith("first") or corr.startswith("second"):
            ks = torch.einsum("hn,hnd->hd", ev, K[l])
            vs = torch.einsum("hn,hnd->hd", ev, V[l])
            S = torch.einsum("hn,hni,hnj->hij", ev, V[l], K[l])
            if corr == "first_fp16":
                S = S.half().float()
            n_ = nev.clamp_min(1)[:, None]
            mk, mv = ks / n_, vs / n_
            C = S / n_[..., None] - mv[:, :, None] * mk[:, None, :]
            if corr.startswith("first_lr"):
                r = int(corr[len("first_lr"):])
                U, sv, Vh = torch.linalg.svd(C)
                C = (U[..., :r] * sv[:, None, :r]) @ Vh[:, :r]
            p.vk, p.vv, p.vbias, p.vC = mk[:, None], mv[:, None], logn[:, None], C
            if corr.startswith("first_m"):  # the evicted mass scaled by m/100
                p.vbias = p.vbias + math.log(int(corr[len("first_m"):]) / 100)
            if corr.startswith("second"):
                Sk = torch.einsum("hn,hni,hnj->hij", ev, K[l], K[l]) / n_[..., None] - \
                    mk[:, :, None] * mk[:, None, :]
                if corr == "second_diag":
                    Sk = torch.diag_embed(torch.diagonal(Sk, dim1=-2, dim2=-1))
                if corr.startswith("second_s"):  # the second-order term shrunk to s/100
                    Sk = Sk * (int(corr[len("second_s"):]) / 100)
                p.vS = Sk
        elif corr.startswith("kmeans"):
            k = int(corr[len("kmeans"):])
            _, oh, cnt = _kmeans(K[l], ev, k)
            n_ = cnt.clamp_min(1)[..., None]
            p.vk = oh.transpose(1, 2) @ K[l] / n_
            p.vv = oh.transpose(1, 2) @ V[l] / n_
            p.vbias = torch.where(cnt > 0, cnt.clamp_min(1).log(), float("-inf"))
        elif corr.startswith("window"):
            W = int(corr[len("window"):])
            nw = (N + W - 1) // W
            wid = torch.arange(N, device=K.device) // W
            oh = torch.nn.functional.one_hot(wid, nw).float()[None] * ev[..., None]  # [H,N,nw]
            cnt = oh.sum(1)
            n_ = cnt.clamp_min(1)[..., None]
            p.vk = oh.transpose(1, 2) @ K[l] / n_
            p.vv = oh.transpose(1, 2) @ V[l] / n_
            p.vbias = torch.where(cnt > 0, cnt.clamp_min(1).log(), float("-inf"))
        elif corr.startswith("merge"):
            kn = K[l] / K[l].norm(dim=-1, keepdim=True).clamp_min(1e-8)
            kkn = _gather(m, kn)[0]
            sim = torch.einsum("hnd,hjd->hnj", kn, kkn).masked_fill(~valid[:, None, :],
                                                                  float("-inf"))
            a = sim.argmax(-1)  # [H, N] the kept slot each token would join
            # kept tokens join their own slot
            own = torch.full((H, N), -1, dtype=torch.long, device=K.device)
            slots = torch.arange(idx.shape[1], device=K.device)[None].expand(H, -1)
            own.scatter_(1, idx, torch.where(valid, slots, -1))
            a = torch.where(m, own, a)
            oh = torch.nn.functional.one_hot(a.clamp_min(0), idx.shape[1]).float()
            cnt = oh.sum(1)  # [H, n]
            n_ = cnt.clamp_min(1)[..., None]
            p.values = oh.transpose(1, 2) @ Vc[l] / n_
            if corr == "merge_kv":
                p.keys = oh.transpose(1, 2) @ Kc[l] / n_
            p.bias = torch.where(valid, cnt.clamp_min(1).log(), float("-inf"))
        else:
            raise ValueError(f"unknown correction {corr}")
        out.append(p)
    return out


def correction_bytes(corr, d, N, kept_total_per_head):
    """Bytes per kv head of a correction's stored summaries at context N."""
    if corr == "none":
        return 0
    first = 8 + 8 * d
    if corr == "first":
        return first + 4 * d * d
    if corr == "first_fp16":
        return first + 2 * d * d
    if corr.startswith("first_m"):
        return first + 4 * d * d
    if corr.startswith("second_s"):
        return first + 4 * d * d + 4 * d * (d + 1) / 2
    if corr.startswith("kfirst"):
        return int(corr[6:]) * (8 + 8 * d + 4 * d * d)
    if corr.startswith("first_lr"):
        return first + 4 * 2 * int(corr[8:]) * d
    if corr == "second":
        return first + 4 * d * d + 4 * d * (d + 1) / 2
    if corr == "second_diag":
        return first + 4 * d * d + 4 * d
    if corr.startswith("kmeans"):
        return int(corr[6:]) * (8 + 8 * d)
    if corr.startswith("window"):
        return math.ceil(N / int(corr[6:])) * (8 + 8 * d)
    if corr.startswith("merge"):
        return 2 * kept_total_per_head  # an f16 count per kept token
    raise ValueError(corr)


# --- attention over a prefix ---

def prefix_attention(query, pf: Prefix, new_keys, new_values, scaling):
    _, hq, m, d = query.shape
    hk = pf.keys.shape[0]
    g = hq // hk
    q = query[0].float().reshape(hk, g, m, d)
    parts = [torch.einsum("hgmd,hnd->hgmn", q, pf.keys) * scaling + pf.bias[:, None, None, :]]
    M = 0
    if pf.vk is not None:
        lv = torch.einsum("hgmd,hMd->hgmM", q, pf.vk) * scaling + pf.vbias[:, None, None, :]
        if pf.vS is not None:
            lv = lv + 0.5 * scaling ** 2 * torch.einsum("hgmi,hij,hgmj->hgm", q, pf.vS,
                                                        q)[..., None]
        parts.append(lv)
        M = pf.vk.shape[1]
    kn = new_keys[0].float()
    s = kn.shape[1]
    ln = torch.einsum("hgmd,hsd->hgms", q, kn) * scaling
    qi = torch.arange(m, device=q.device)[:, None] + (s - m)
    kj = torch.arange(s, device=q.device)[None, :]
    parts.append(ln.masked_fill(kj > qi, float("-inf")))
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    n = pf.keys.shape[1]
    out = torch.einsum("hgmn,hnd->hgmd", p[..., :n], pf.values)
    if M:
        pv = p[..., n:n + M]
        out = out + torch.einsum("hgmM,hMd->hgmd", pv, pf.vv)
        if pf.vC is not None and pf.vC.dim() == 3:
            cq = torch.einsum("hij,hgmj->hgmi", pf.vC, q)
            out = out + pv[..., :1] * scaling * cq
        elif pf.vC is not None:  # one C per virtual token
            cq = torch.einsum("hMij,hgmj->hgmMi", pf.vC, q)
            out = out + scaling * torch.einsum("hgmM,hgmMi->hgmi", pv, cq)
    out = out + torch.einsum("hgms,hsd->hgmd", p[..., n + M:], new_values[0].float())
    return out.reshape(hq, m, d).transpose(0, 1)[None].to(query.dtype)


class RefCache(DynamicCache):
    """A cache whose first `original_length` positions are the given prefixes; later tokens are
    cached as usual and attend to the prefixes through prefix_attention."""

    def __init__(self, prefixes, original_length):
        super().__init__()
        self.prefixes, self.original_length = prefixes, original_length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.original_length + super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.get_seq_length(layer_idx) + query_length, 0


_CURRENT: List[RefCache] = []


def _ref_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    c = _CURRENT[-1]
    return prefix_attention(query, c.prefixes[module.layer_idx], key, value, scaling), None


AttentionInterface.register(REF_ATTN, _ref_attention)


@torch.no_grad()
def _forward(model, prefixes, N, ids):
    c = RefCache(prefixes, N)
    _CURRENT.append(c)
    try:
        model.set_attn_implementation(REF_ATTN)
        return model(ids[None], past_key_values=c, use_cache=True).logits[0].float()
    finally:
        _CURRENT.pop()
        model.set_attn_implementation("sdpa")


def continuation_nll(model, prefixes, N, first_logits, cont, skip=0):
    """Mean NLL of cont[skip:] after the prefixes (cont[:skip] fed, not scored)."""
    cont = cont.to(model.device)
    lg = torch.cat([first_logits[None], _forward(model, prefixes, N, cont[:-1])])
    return float(torch.nn.functional.cross_entropy(lg[skip:], cont[skip:], reduction="mean"))


def greedy_matches(model, prefixes, N, question, target):
    question, target = question.to(model.device), target.to(model.device)
    lg = _forward(model, prefixes, N, torch.cat([question, target[:-1]]))
    pred = lg[question.numel() - 1:][: target.numel()].argmax(-1)
    return bool(torch.equal(pred, target))


# --- the grid ---

def default_grid(quick: bool = False):
    """Cells (policy, ratio, correction, key codec, value codec)."""
    ratios = [0.5, 0.75, 0.9]
    pols = ["manifold", "keydiff", "streaming", "manifold_r25", "manifold_r50", "mix",
            "mix_r25", "pyramid_r25", "adakv_r25"]
    corrs_all = ["none", "first"]
    corrs_study = ["first_fp16", "first_lr16", "second", "second_diag", "kmeans4", "kmeans8",
                   "kmeans16", "window256", "window64", "merge_v", "merge_kv"]
    if quick:
        ratios = [0.75]
        pols = ["manifold", "manifold_r25"]
        corrs_study = ["second", "kmeans8", "window256", "merge_v"]
    cells = [("full", 0.0, "none", "raw", "raw")]
    for p in pols:
        for r in ratios:
            for c in corrs_all:
                cells.append((p, r, c, "raw", "raw"))
    for p in (["manifold", "manifold_r25", "manifold_r50"] if not quick else pols):
        for r in ratios if not quick else [0.75]:
            for c in corrs_study:
                cells.append((p, r, c, "raw", "raw"))
    # bytes against loss: codecs x lighter eviction, cheap corrections
    codecs = [("int8", "splice8"), ("int8", "splice4"), ("int4", "splice4")]
    if quick:
        codecs = [("int4", "splice4")]
    for kc, vc in codecs:
        cells.append(("full", 0.0, "none", kc, vc))
        for p in (["manifold_r50", "streaming"] if not quick else ["manifold_r25"]):
            for r in ([0.25, 0.4, 0.5, 0.6, 0.75] if not quick else [0.5]):
                for c in (["none", "kmeans8", "merge_v"] if not quick else ["kmeans8"]):
                    cells.append((p, r, c, kc, vc))
    return cells


SCORERS = ["knorm", "keydiff", "manifold", "windowed", "streaming", "snapkv", "random"]


def decisive_grid():
    """Every kvcomp scorer (windowed = windowed_manifold, window 1024), AdaKV and the
    recent-window policies at 0.5 / 0.75 / 0.9 without correction; kvcomp's first-order
    correction on manifold and manifold_r50; more correction variants at 0.75."""
    cells = [("full", 0.0, "none", "raw", "raw")]
    for p in SCORERS + ["adakv", "manifold_r25", "manifold_r50", "adakv_r50"]:
        for r in [0.5, 0.75, 0.9]:
            cells.append((p, r, "none", "raw", "raw"))
    for p in ["manifold", "manifold_r50"]:
        for r in [0.5, 0.75, 0.9]:
            cells.append((p, r, "first", "raw", "raw"))
        for c in ["first_m50", "second_s25", "kfirst4", "kfirst8"]:
            cells.append((p, 0.75, c, "raw", "raw"))
    return cells


def recency_grid():
    """The recent window's share of the budget (0, 25, 50, 75, 90%) against streaming and the
    scorers nearest it, no correction, at 0.5 / 0.75 / 0.9."""
    cells = [("full", 0.0, "none", "raw", "raw")]
    for p in ["streaming", "snapkv", "windowed", "manifold", "manifold_r25", "manifold_r50",
              "manifold_r75", "manifold_r90", "keydiff_r50"]:
        for r in [0.5, 0.75, 0.9]:
            cells.append((p, r, "none", "raw", "raw"))
    return cells


def run(model, args, loss_windows, pk_samples, calib_ids, log, N_bytes):
    """Evaluates the grid: loss windows (ctx ids, tail ids), pass-key samples (kind, context,
    question, answer ids). Returns rows. The decisive grid also scores a far loss per window:
    the first half compressed, the third quarter fed uncompressed, NLL of the last quarter."""
    decisive = args.variants in ("decisive", "recency")
    cells = (decisive_grid() if args.variants == "decisive" else recency_grid()
             if args.variants == "recency" else default_grid(args.variants == "quick"))
    need_q = any(c[0].startswith("snapkv") for c in cells)
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    projs = {}
    need = {vc for *_, vc in cells if vc != "raw"}
    if need:
        Vs = [prefill(model, t)[1] for t in calib_ids]
        for vc in need:
            projs[vc] = calibrate_values(Vs, d // 2 if vc == "splice8" else d * 3 // 4)
        log(f"value projections calibrated on {len(calib_ids)} windows")
    res: Dict[tuple, Dict[str, list]] = {c: {"loss": [], "loss_far": [], "passkey_1": [],
                                            "passkey_3": []} for c in cells}

    failed = set()
    n_sample = [0]

    def sample(kind, ctx, tail, answer=None, skip=0):
        pre = prefill(model, ctx, with_queries=need_q)
        K, V, first = pre[:3]
        Q = pre[3] if need_q else None
        L, H, N, _ = K.shape
        masks = {}
        coded = {}
        n_sample[0] += 1
        for cell in cells:
            pol, r, corr, kc, vc = cell
            if kind != "loss" and kc != "raw" and corr != "none":
                continue  # codec cells: pass-keys without a correction only
            mk = (pol, r)
            if mk not in masks:
                masks[mk] = policy_mask(pol if pol != "full" else "manifold", K, r, Q=Q,
                                        seed=n_sample[0])
            m = masks[mk]
            ck = (mk, kc, vc)
            if ck not in coded:
                coded[ck] = (code_keys(K, m, kc), code_values(V, vc, projs.get(vc)))
            Kc, Vc = coded[ck]
            try:
                pf = build_prefixes(K, V, m, corr, Kc, Vc)
                if kind.startswith("loss"):
                    v = continuation_nll(model, pf, N, first, tail, skip)
                else:
                    v = float(greedy_matches(model, pf, N, tail, answer))
            except (RuntimeError, ValueError) as e:  # one failing cell must not end the run
                if cell not in failed:
                    log(f"variants: cell {cell} failed: {e}")
                failed.add(cell)
                v = float("nan")
            res[cell][kind].append(v)

    for j, (ctx, tail) in enumerate(loss_windows):
        sample("loss", ctx, tail)
        if decisive:
            w = torch.cat([ctx, tail])
            half, q3 = w.numel() // 2, w.numel() * 3 // 4
            sample("loss_far", w[:half], w[half:], skip=q3 - half)
        log(f"variants: loss window {j + 1}/{len(loss_windows)}")
    t_pk = time.time()
    taken = 0
    for j, (kind, ctx, q, ans) in enumerate(pk_samples):
        if args.budget_seconds and time.time() - args._t0 > args.budget_seconds:
            log(f"variants: time budget reached after {j} pass-key samples")
            break
        sample(kind, ctx, q, ans)
        taken = j + 1
        if (j + 1) % 10 == 0:
            log(f"variants: pass-key samples {j + 1}/{len(pk_samples)} "
                f"({time.time() - t_pk:.0f} s)")
    full = float(np.mean(res[cells[0]]["loss"]))
    full_far = float(np.mean(res[cells[0]]["loss_far"])) if decisive else None
    rows = []
    L = model.config.num_hidden_layers
    H = model.config.num_key_value_heads
    bf16 = 4 * d
    for cell in cells:
        pol, r, corr, kc, vc = cell
        r_ = res[cell]
        kept_frac = int(N_bytes * (1 - r)) / N_bytes if r > 0 else 1.0
        per_tok, fixed = codec_bytes(kc, vc, d, projs[vc].shape[-1] if vc in projs else 0)
        kept_tokens = kept_frac * N_bytes
        b_head = kept_tokens * per_tok + fixed + correction_bytes(corr, d, N_bytes, kept_tokens)
        bpt = b_head * L * H / N_bytes
        rows.append({
            "policy": pol, "ratio": r, "correction": corr, "key_codec": kc, "value_codec": vc,
            "loss": float(np.mean(r_["loss"])),
            "loss_vs_full_pct": 100 * (float(np.mean(r_["loss"])) / full - 1),
            "passkey_1": float(np.mean(r_["passkey_1"])) if r_["passkey_1"] else None,
            "passkey_3": float(np.mean(r_["passkey_3"])) if r_["passkey_3"] else None,
            "n_passkey_1": len(r_["passkey_1"]), "n_passkey_3": len(r_["passkey_3"]),
            "bytes_per_token": bpt, "x_vs_bf16": bf16 * L * H / bpt,
            "loss_far": float(np.mean(r_["loss_far"])) if r_["loss_far"] else None,
            "loss_far_vs_full_pct": (100 * (float(np.mean(r_["loss_far"])) / full_far - 1)
                                     if r_["loss_far"] else None),
            "loss_windows": list(map(float, r_["loss"])),
            "loss_far_windows": list(map(float, r_["loss_far"])),
            "passkey_1_samples": list(map(float, r_["passkey_1"])),
            "passkey_3_samples": list(map(float, r_["passkey_3"])),
        })
    # loss gap closed per correction (same policy, ratio and codecs)
    by = {(r["policy"], r["ratio"], r["key_codec"], r["value_codec"], r["correction"]): r
          for r in rows}
    for r in rows:
        base = by.get((r["policy"], r["ratio"], r["key_codec"], r["value_codec"], "none"))
        r["gap_closed"] = r["gap_closed_far"] = None
        if base is not None and r["correction"] != "none" and base["loss"] - full > 1e-9:
            r["gap_closed"] = (base["loss"] - r["loss"]) / (base["loss"] - full)
        if (base is not None and r["correction"] != "none" and full_far is not None
                and base["loss_far"] - full_far > 1e-9):
            r["gap_closed_far"] = (base["loss_far"] - r["loss_far"]) / (base["loss_far"] -
                                                                        full_far)
    return rows, taken


def write_md(path, meta, rows):
    full = next(r for r in rows if r["policy"] == "full" and r["key_codec"] == "raw")
    f = lambda v, s=".2f": "-" if v is None else format(v, s)  # noqa: E731
    lines = [
        f"# Policy and correction variants (float torch references): {meta['model']}",
        "",
        f"date {meta['date']}, commit {meta['commit']}, {meta['card']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}; context {meta['ctx']} bytes; loss = mean NLL "
        f"(nats/byte) over the last quarter of {meta['n_loss']} windows after compressing the "
        f"first three quarters (full cache {full['loss']:.4f}); pass-key n = "
        f"{meta['n_passkey']} per kind and cell; bytes per token counted at "
        f"{meta['bytes_ctx']} tokens against the bf16 cache; held-out digest "
        f"{meta['heldout_digest']}; {meta['seconds']:.0f} s.",
        "",
        "| policy | ratio | correction | keys | values | bytes/token | x vs bf16 | pass-key 1 | "
        "pass-key 3 | n | loss | vs full | gap closed | far loss vs full | far gap closed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    for r in rows:
        far = r.get("loss_far_vs_full_pct")
        lines.append(
            f"| {r['policy']} | {r['ratio']} | {r['correction']} | {r['key_codec']} | "
            f"{r['value_codec']} | {r['bytes_per_token']:.0f} | {r['x_vs_bf16']:.2f} | "
            f"{f(r['passkey_1'])} | {f(r['passkey_3'])} | {r['n_passkey_1']}/{r['n_passkey_3']} | "
            f"{r['loss']:.4f} | {r['loss_vs_full_pct']:+.2f}% | {pct(r['gap_closed'])} | "
            f"{'-' if far is None else format(far, '+.2f') + '%'} | "
            f"{pct(r.get('gap_closed_far'))} |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")

"""NumPy reference of the engine's eviction and of MomentKV (docs/engine.md, docs/moments.md).

Used by the quality harness when the kvcomp module is not built, and by the tests to check the
module against it. Scorers, budgets and protection follow docs/engine.md and kvcomp/core/policy.h;
the moment-aware rule is docs/moment_aware.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import numpy as np

SCORERS = ("knorm", "keydiff", "manifold", "windowed_manifold", "streaming", "random")

# docs/moment_aware.md: weight of the distance-to-summary percentile in the combined score.
MOMENT_AWARE_BETA = 0.5


@dataclasses.dataclass
class HeadMoments:
    count: int
    key_sum: np.ndarray    # [d] f64
    value_sum: np.ndarray  # [d] f64
    vk_sum: np.ndarray     # [d, d] f64, [i, j] = sum v_i k_j

    @staticmethod
    def empty(d: int) -> "HeadMoments":
        return HeadMoments(0, np.zeros(d), np.zeros(d), np.zeros((d, d)))

    @staticmethod
    def of(k: np.ndarray, v: np.ndarray) -> "HeadMoments":
        k = k.astype(np.float64)
        v = v.astype(np.float64)
        return HeadMoments(len(k), k.sum(0), v.sum(0), v.T @ k)

    def merged(self, o: "HeadMoments") -> "HeadMoments":
        return HeadMoments(self.count + o.count, self.key_sum + o.key_sum,
                           self.value_sum + o.value_sum, self.vk_sum + o.vk_sum)


@dataclasses.dataclass
class CompressedLayer:
    kept: List[np.ndarray]           # per kv head, ascending token indices
    moments: List[HeadMoments]       # per kv head, of the evicted tokens


def scores(keys: np.ndarray, scorer: str, window: int = 4096, n_sink: int = 4,
           seed: int = 0, head: int = 0) -> np.ndarray:
    """Score of every token of one head's keys [N, d] (higher = keep)."""
    k = keys.astype(np.float64)
    n = len(k)
    if scorer == "knorm":
        return -np.linalg.norm(k, axis=1)
    if scorer == "keydiff":
        nk = k / np.maximum(np.linalg.norm(k, axis=1, keepdims=True), 1e-8)
        a = nk.mean(0)
        return -(nk @ a) / max(np.linalg.norm(a), 1e-8)
    if scorer == "manifold":
        return np.linalg.norm(k - k.mean(0), axis=1)
    if scorer == "windowed_manifold":
        s = np.empty(n)
        for b in range(0, n, window):
            w = k[b:b + window]
            s[b:b + window] = np.linalg.norm(w - w.mean(0), axis=1)
        return s
    if scorer == "streaming":
        s = np.arange(n, dtype=np.float64)
        s[:n_sink] = 3.0e38
        return s
    if scorer == "random":
        return np.random.default_rng([seed, head]).random(n)
    raise ValueError(f"unknown scorer {scorer}")


def select(s: np.ndarray, kept: int, n_sink: int = 4) -> np.ndarray:
    """Ascending indices of the `kept` highest scores; the first n_sink tokens always kept; ties
    by lower index."""
    eff = s.astype(np.float64).copy()
    eff[:n_sink] = np.inf
    order = np.lexsort((np.arange(len(eff)), -eff))  # by score desc, then index asc
    return np.sort(order[:kept])


def percentile_rank(x: np.ndarray) -> np.ndarray:
    """rank / (n - 1) in [0, 1], ties by lower index."""
    n = len(x)
    r = np.empty(n)
    r[np.lexsort((np.arange(n), x))] = np.arange(n)
    return r / max(n - 1, 1)


def moment_aware_select(keys: np.ndarray, s: np.ndarray, kept: int, prior: HeadMoments,
                        n_sink: int = 4, beta: float = MOMENT_AWARE_BETA) -> np.ndarray:
    """docs/moment_aware.md: provisional eviction by score, summary mean of (prior + provisional
    evicted keys), then keep by (1 - beta) pct(score) + beta pct(distance to that mean)."""
    first = select(s, kept, n_sink)
    mask = np.ones(len(s), bool)
    mask[first] = False
    k = keys.astype(np.float64)
    n = prior.count + int(mask.sum())
    if n == 0:
        return first
    mu = (prior.key_sum + k[mask].sum(0)) / n
    dist = np.linalg.norm(k - mu, axis=1).astype(np.float32)  # ranked in f32, as the engine
    combined = (1.0 - beta) * percentile_rank(s) + beta * percentile_rank(dist)
    return select(combined, kept, n_sink)


def compress_layer(keys: np.ndarray, values: np.ndarray, scorer: str, ratio: float,
                   moment_aware: bool = False, window: int = 4096, seed: int = 0,
                   layer: int = 0) -> CompressedLayer:
    """keys/values [Hk, N, d]: per head kept = int(N * (1 - ratio)), moments of the rest."""
    hk, n, d = keys.shape
    kept_n = max(1, int(n * (1.0 - ratio)))
    out = CompressedLayer([], [])
    for h in range(hk):
        s = scores(keys[h], scorer, window=window, seed=seed, head=layer * hk + h)
        if moment_aware:
            idx = moment_aware_select(keys[h], s, kept_n, HeadMoments.empty(d))
        else:
            idx = select(s, kept_n)
        mask = np.ones(n, bool)
        mask[idx] = False
        out.kept.append(idx)
        out.moments.append(HeadMoments.of(keys[h][mask], values[h][mask]))
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, m: Optional[HeadMoments],
              correct: bool = True) -> np.ndarray:
    """Queries [nq, d] over kept k, v [n, d] plus the virtual token of m (docs/moments.md), in
    float64."""
    d = q.shape[1]
    t = 1.0 / math.sqrt(d)
    q = q.astype(np.float64)
    logits = t * q @ k.astype(np.float64).T
    le = ve = None
    if correct and m is not None and m.count > 0:
        n = float(m.count)
        mu_k, mu_v = m.key_sum / n, m.value_sum / n
        c = m.vk_sum / n - np.outer(mu_v, mu_k)
        le = t * q @ mu_k + math.log(n)           # [nq]
        ve = mu_v[None, :] + t * q @ c.T          # [nq, d]
    if logits.shape[1] == 0 and le is None:
        return np.zeros_like(q)
    mx = logits.max(axis=1) if logits.shape[1] else np.full(len(q), -np.inf)
    if le is not None:
        mx = np.maximum(mx, le)
    w = np.exp(logits - mx[:, None])
    num = w @ v.astype(np.float64)
    den = w.sum(axis=1)
    if le is not None:
        we = np.exp(le - mx)
        num += we[:, None] * ve
        den += we
    return num / den[:, None]


def layer_attention(queries: np.ndarray, keys: np.ndarray, values: np.ndarray,
                    comp: Optional[CompressedLayer], correct: bool) -> np.ndarray:
    """queries [Hq, nq, d] (GQA over keys' Hk heads) -> [Hq, nq, d]; comp None = full."""
    hq, hk = queries.shape[0], keys.shape[0]
    g = hq // hk
    out = np.empty(queries.shape, np.float64)
    for qh in range(hq):
        h = qh // g
        if comp is None:
            out[qh] = attention(queries[qh], keys[h], values[h], None, False)
        else:
            idx = comp.kept[h]
            out[qh] = attention(queries[qh], keys[h][idx], values[h][idx], comp.moments[h],
                                correct)
    return out

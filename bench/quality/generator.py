"""Synthetic KV caches with the properties reported for real models (bench/quality).

Every property is one documented field of GeneratorParams; `generate_layer` builds one layer's
keys and values [num_kv_heads, tokens, head_dim] (fp32, keys post-RoPE as serving engines store
them), the needles planted in them and the decode queries that later ask for them.

The model of one kv head, token at position p (pre-RoPE vector, then RoPE(p)):
  key(p)   = B (topic_mean(p // drift_every) + z_p) * key_scale + noise * key_noise + outliers
             z_p ~ N(0, I_subspace_dim), B an orthonormal [head_dim, subspace_dim] basis drawn per
             head, outliers: outlier_offset on `outlier_channels` low-frequency channels
  value(p) = B_v (w_p + topic_value(p // drift_every)) + noise * value_noise
  token 0 (attention sink): a large key along the queries' bias direction (see `sink_mass`)
  needles: off-subspace keys (random directions) at random positions with distinctive values;
           groups of `group_size` needles share ONE stored (post-RoPE) direction and differ in
           magnitude (`group_magnitudes`): a directional collision (cosine-based
           scorers cannot tell them apart, norm-based ones rank them by magnitude only); the
           first `groups_along_mean` groups lie along the keys' mean direction, where a cosine
           to the mean sees ordinary tokens and only the magnitude tells them apart.
Queries (all at position `tokens`, i.e. the next decode step):
  generic:   bias + B (current topic mean + N(0, I)) * query_scale, RoPE'd: ordinary decode steps
  retrieval: along a needle's stored key direction (or a group's shared direction) with a norm
             that makes its logit `retrieval_logit` above the typical one, plus a little noise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import numpy as np


@dataclasses.dataclass
class GeneratorParams:
    """Parameters of the synthetic cache; units in brackets, defaults in the field."""

    head_dim: int = 128                # [elements] 64, 128 or 256
    num_kv_heads: int = 2              # kv heads per layer
    q_per_kv: int = 2                  # query heads per kv head (GQA group)
    subspace_dim: int = 12             # [dims] keys lie near a subspace of this dimension,
                                       # spanned by the slower half of the rotary pairs
    key_scale: float = 1.0             # std of key coordinates inside the subspace
    key_noise: float = 0.15            # std of isotropic key noise (off-subspace spread)
    outlier_channels: int = 4          # low-frequency channel pairs with a large constant offset
    outlier_offset: float = 6.0        # [key units] the offset on those channels
    rope_theta: float = 500000.0       # RoPE base (Llama 3's); rotate-half (NeoX) layout
    sink_mass: float = 0.3             # median attention mass of the sink over generic queries
    drift_every: int = 2048            # [tokens] the topic mean moves every this many tokens
    drift_scale: float = 1.5           # std of each topic mean's coordinates (subspace units)
    value_dim: int = 16                # values lie near a subspace of this dimension
    value_noise: float = 0.2           # std of isotropic value noise
    num_needles: int = 6               # single needles per kv head
    num_groups: int = 2                # needle groups per kv head (shared direction)
    group_size: int = 3                # needles per group
    group_magnitudes: tuple = (0.6, 1.0, 1.6)  # relative key magnitudes inside a group
    groups_along_mean: int = 0         # groups whose shared direction is the keys' mean
                                       # direction (the rest: random directions)
    needle_norm: float = 1.0           # needle key norm relative to the typical key norm
    needle_value_norm: float = 3.0     # needle value norm relative to the typical value norm
    retrieval_logit: float = 9.0       # [logits] a retrieval query's logit on its needle above
                                       # the typical logit
    query_scale: float = 2.5           # std of generic query coordinates in the subspace
    generic_queries: int = 8           # generic queries per q head
    retrieval_noise: float = 0.1       # relative noise on retrieval queries
    basis_seed: Optional[int] = None   # None: each head's key and value bases come from the
                                       # layer's seed. Else from (basis_seed, head): caches made
                                       # with one basis_seed share the "model's" subspaces and
                                       # differ in content, like two requests to one model (a
                                       # projection calibrated on one applies to the other)

    def needles_per_head(self) -> int:
        return self.num_needles + self.num_groups * self.group_size


@dataclasses.dataclass
class Needle:
    head: int          # kv head
    position: int      # token index
    group: int         # -1 for a single needle, else the group id within the head


@dataclasses.dataclass
class Layer:
    keys: np.ndarray       # [Hk, N, d] fp32
    values: np.ndarray     # [Hk, N, d] fp32
    needles: List[Needle]
    # Queries [Hq, nq, d] fp32 at position N; kinds[i] is "generic" or "retrieval" for query i
    # (the same for every q head), targets[h][i]: needle positions a retrieval query aims at.
    queries: np.ndarray
    kinds: List[str]
    targets: List[List[List[int]]]


def rope_tables(positions: np.ndarray, d: int, theta: float):
    half = d // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) / half)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    return np.cos(ang), np.sin(ang)


def apply_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE of x [n, d] at `positions` [n]."""
    d = x.shape[-1]
    half = d // 2
    cos, sin = rope_tables(positions, d, theta)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _orthonormal(rng, d, r):
    q, _ = np.linalg.qr(rng.standard_normal((d, r)))
    return q[:, :r]


def generate_layer(p: GeneratorParams, tokens: int, seed: int) -> Layer:
    rng = np.random.default_rng(seed)
    d, hk = p.head_dim, p.num_kv_heads
    half = d // 2
    pos = np.arange(tokens)
    keys = np.empty((hk, tokens, d), np.float32)
    values = np.empty((hk, tokens, d), np.float32)
    needles: List[Needle] = []
    queries = []
    targets: List[List[List[int]]] = []
    kinds: List[str] = []
    # The lowest-frequency pairs (largest index in each half) barely rotate: outliers and the
    # query bias live there, as the massive channels of real models do.
    low = np.arange(half - p.outlier_channels, half)
    n_topics = tokens // p.drift_every + 1
    for h in range(hk):
        # The key subspace spans the slower half of the rotary pairs: what RoPE leaves of
        # content matching at long range (fast pairs decorrelate within a few tokens).
        # The outlier/bias pairs stay out of it, so the sink's logit is about the same for
        # every generic query.
        slow = np.concatenate([np.arange(half // 2, half - p.outlier_channels),
                               np.arange(half + half // 2, d - p.outlier_channels)])
        brng = rng if p.basis_seed is None else np.random.default_rng([p.basis_seed, h])
        basis = np.zeros((d, p.subspace_dim))
        basis[slow] = _orthonormal(brng, len(slow), p.subspace_dim)
        vbasis = _orthonormal(brng, d, p.value_dim)
        topic = rng.standard_normal((n_topics, p.subspace_dim)) * p.drift_scale
        vtopic = rng.standard_normal((n_topics, p.value_dim)) * p.drift_scale
        tid = pos // p.drift_every
        z = topic[tid] + rng.standard_normal((tokens, p.subspace_dim))
        pre = (z @ basis.T) * p.key_scale + rng.standard_normal((tokens, d)) * p.key_noise
        pre[:, low] += p.outlier_offset
        pre[:, low + half] += 0.5 * p.outlier_offset
        k = apply_rope(pre, pos, p.rope_theta)
        v = (rng.standard_normal((tokens, p.value_dim)) + vtopic[tid]) @ vbasis.T
        v += rng.standard_normal((tokens, d)) * p.value_noise
        typical_k = float(np.median(np.linalg.norm(k, axis=1)))
        typical_v = float(np.median(np.linalg.norm(v, axis=1)))

        # Needle positions: distinct, away from the sink and the very end.
        n_need = p.needles_per_head()
        slots = rng.choice(np.arange(16, tokens - 16), size=n_need, replace=False)
        cursor = 0
        head_needles = []
        for i in range(p.num_needles):
            t = int(slots[cursor]); cursor += 1
            u = rng.standard_normal(d); u /= np.linalg.norm(u)
            k[t] = u * typical_k * p.needle_norm
            w = rng.standard_normal(d); w /= np.linalg.norm(w)
            v[t] = w * typical_v * p.needle_value_norm
            head_needles.append(Needle(h, t, -1))
        mean_dir = k[1:].mean(axis=0)
        mean_dir /= np.linalg.norm(mean_dir)
        for g in range(p.num_groups):
            u = rng.standard_normal(d); u /= np.linalg.norm(u)
            if g < p.groups_along_mean:
                u = mean_dir  # the collision: the direction every key leans towards
            for j in range(p.group_size):
                t = int(slots[cursor]); cursor += 1
                mag = p.group_magnitudes[j % len(p.group_magnitudes)]
                k[t] = u * typical_k * p.needle_norm * mag
                w = rng.standard_normal(d); w /= np.linalg.norm(w)
                v[t] = w * typical_v * p.needle_value_norm
                head_needles.append(Needle(h, t, g))
        needles.extend(head_needles)

        # Queries of this kv head's q heads, at position `tokens`.
        tscale = 1.0 / math.sqrt(d)
        qpos = np.array([tokens])
        bias_pre = np.zeros(d)
        bias_pre[low] = 1.0
        bias_pre /= np.linalg.norm(bias_pre)
        # Sink: token 0 along the bias direction (RoPE at position 0 is the identity).
        gen_pre = (topic[-1] + rng.standard_normal((p.generic_queries * p.q_per_kv,
                                                    p.subspace_dim))) @ basis.T * p.query_scale
        gen = apply_rope(gen_pre, np.full(len(gen_pre), tokens), p.rope_theta)
        bias = apply_rope(bias_pre[None, :], qpos, p.rope_theta)[0]
        gen += bias * 2.0
        typical_logit = float((tscale * gen @ k[1:].T).mean())
        # Sink: token 0 along the bias direction (RoPE at position 0 is the identity), scaled so
        # the median generic query puts `sink_mass` of its attention on it.
        lg = tscale * gen @ k[1:].T
        mx = lg.max(axis=1)
        lse = mx + np.log(np.exp(lg - mx[:, None]).sum(axis=1))
        need = np.log(p.sink_mass / (1.0 - p.sink_mass)) + lse
        along = tscale * gen @ bias_pre
        k[0] = bias_pre * float(np.median(need / along))
        # Retrieval queries: one per single needle, one per group (along the group direction).
        ret, tg = [], []
        aims = [[nd.position] for nd in head_needles if nd.group < 0]
        aims += [[x.position for x in head_needles if x.group == g] for g in range(p.num_groups)]
        for members in aims:
            kk = k[members[-1]]  # a group's largest-magnitude member sets the query norm
            norm = (typical_logit + p.retrieval_logit) / (tscale * np.linalg.norm(kk))
            ret.append(kk / np.linalg.norm(kk) * norm)
            tg.append(members)
        ret = np.array(ret)
        per_q = []
        for j in range(p.q_per_kv):
            noise = rng.standard_normal(ret.shape) * p.retrieval_noise * \
                np.linalg.norm(ret, axis=1, keepdims=True) / math.sqrt(d)
            g = gen[j * p.generic_queries:(j + 1) * p.generic_queries]
            per_q.append(np.concatenate([g, ret + noise]))
        queries.extend(per_q)
        targets.append([[] for _ in range(p.generic_queries)] + tg)
        if not kinds:
            kinds = ["generic"] * p.generic_queries + ["retrieval"] * len(ret)
        keys[h] = k
        values[h] = v
    return Layer(keys, values, needles, np.asarray(queries, np.float32), kinds, targets)

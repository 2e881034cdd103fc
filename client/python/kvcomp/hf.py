"""kvcomp on Hugging Face transformers decoder models.

    import kvcomp, kvcomp.hf
    policy = kvcomp.Policy(scorer="keydiff", ratio=0.75)

    # one call: the context is prefilled and compressed, the question and the answer are not
    ids = kvcomp.hf.generate(model, context_ids, question_ids, policy, max_new_tokens=32)
    nll = kvcomp.hf.loss(model, context_ids, continuation_ids, policy)

    # a batch: lists of prompts of different lengths (left-padded inside)
    ids = kvcomp.hf.generate(model, [ctx_a, ctx_b], [q_a, q_b], policy, max_new_tokens=32)

    # model.generate and pipelines: every prompt is compressed after its prefill
    with kvcomp.hf.press(model, policy):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

What happens: the prompt (context) is prefilled by the model as usual, with the model's own
attention implementation; its cache (the keys and values each layer hands its cache: post-norm,
post-RoPE) goes through `kvcomp.compress` under the policy (or a real round trip through kvcompd
with `client=`); the kept keys and values, decoded (`kvcomp.decompress`), replace the prompt's
cache. Tokens after it (question, generated tokens) are cached uncompressed and attend causally to
each other and to the compressed prompt, their RoPE positions continuing from the prompt's
original length. With `correct=True` every kv head's evicted set enters each softmax as the
MomentKV virtual token (docs/moments.md): logit t q.mu_k + ln n, value mu_v + t C q. AdaKV caches
(heads keeping different counts) are padded per layer and masked.

Layers by kind (the config's layer_types, as transformers reads them):
- full attention: compressed under the policy;
- sliding window (Mistral, Gemma 3's local layers, gpt-oss's alternate layers): only the window
  is kept (the prompt's last `sliding_window` tokens), stored with ratio 0 and the policy's key
  codec; decode attends inside the window as the model's mask says;
- linear attention (Qwen3-Next's gated delta net): its convolution and recurrent state is kept as
  the model left it after the prefill, bit for bit, beside the compressed attention layers (with
  `client=` it makes a lossless round trip through kvcompd too);
- MLA (DeepSeek-V3): transformers caches the latent (the kv_a output after its norm, and the
  RoPE'd shared key); kvcomp stores that latent, one head per layer, the latent as the keys and
  the RoPE part as the values, scores and evicts on it and expands it per head through the layer's
  own kv_b_proj for decode. The MomentKV correction does not apply to a latent (off for MLA).
  A latent wider than 256 channels (DeepSeek-V3's own 512 + 64) is stored as 64-channel pieces,
  pairs of them pseudo-heads, evicted by position only (streaming) or kept whole (ratio 0).
Attention sinks (gpt-oss) enter every softmax as the model's own. Head dims other than 64, 128 and
256, and keys and values of different sizes, are zero-padded to the kernels' next head dim
(kvcomp.layouts); the padding is stored.

The attention runs through transformers' AttentionInterface under the name "kvcomp" (registered,
with transformers' eager mask, when this module is imported): prefill attention is the model's
own implementation (SDPA, or eager where the model has no SDPA); attention over a compressed
prompt is computed here in float32 (torch), on the model's device. The compressed prompt's first
continuation token comes from the prefill itself (full attention, as a serving engine's prefill
produces it); every later token reads the compressed cache.

Supported: model_type in SUPPORTED_MODEL_TYPES, key and value head dims up to 256 (MLA latents
of any width), any batch size (prompts left-padded; loss, greedy_matches and
continuation_nll take one sequence). Anything else raises ValueError naming what is unsupported.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import uuid
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvcomp
from kvcomp.layouts import kernel_head_dim, pad_head_dim

__all__ = ["generate", "loss", "press", "KvcompCache", "Prefill", "prefill", "calibrate",
           "cache_from_prefill", "greedy", "greedy_matches", "continuation_nll",
           "prefix_attention", "check_model", "layer_kinds", "head_dims",
           "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma3_text",
                         "gpt_oss", "deepseek_v3", "qwen3_next")
ATTN_NAME = "kvcomp"
FULL, WINDOW, LINEAR = "full", "window", "linear"
_KINDS = {"full_attention": FULL, "sliding_attention": WINDOW, "linear_attention": LINEAR}


# --- checks ---

def _config(model_or_config):
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def _is_mla(cfg) -> bool:
    return getattr(cfg, "kv_lora_rank", None) is not None


PIECE = 64  # channels per piece of an MLA latent wider than the kernels' largest head dim


def _wide_latent(cfg) -> bool:
    """An MLA latent wider than 256: stored in 64-wide pieces, pairs of them as the keys and
    values of pseudo-heads, which only position-based eviction keeps together."""
    return _is_mla(cfg) and max(head_dims(cfg)) > 256


def _to_pieces(k, v):
    """One latent head k [T, dk], v [T, dv] as pseudo-heads' keys and values [P, T, PIECE]."""
    x = torch.cat([k, v], -1)
    pairs = -(-x.shape[-1] // (2 * PIECE))
    x = pad_head_dim(x, 2 * pairs * PIECE).reshape(x.shape[0], pairs, 2, PIECE)
    return x[:, :, 0].transpose(0, 1), x[:, :, 1].transpose(0, 1)


def _from_pieces(keys, values, dk, dv):
    """The inverse of _to_pieces over a pseudo-head's decoded rows: (k [n, dk], v [n, dv])."""
    x = np.stack([np.stack([k, v], 1) for k, v in zip(keys, values)], 1)
    x = x.reshape(x.shape[0], -1)
    return x[:, :dk], x[:, dk:dk + dv]


def layer_kinds(model_or_config) -> List[str]:
    """Each layer's kind: "full", "window" (sliding window) or "linear" (linear attention)."""
    cfg = _config(model_or_config)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types, _ = get_layer_types_and_kwargs(cfg)
    bad = sorted({t for t in types if t not in _KINDS})
    if bad:
        raise ValueError(f"kvcomp.hf: layer types {bad} are not supported (full, sliding-window "
                         f"and linear attention layers are)")
    return [_KINDS[t] for t in types]


def head_dims(model_or_config) -> Tuple[int, int]:
    """(key, value) head dims of what the model's attention layers hand their cache: per-head
    keys and values, or for MLA the latent and its RoPE part."""
    cfg = _config(model_or_config)
    if _is_mla(cfg):
        return int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(d), int(d)


def check_model(model_or_config) -> None:
    """Raises ValueError when kvcomp.hf cannot run this model, naming what is unsupported."""
    cfg = _config(model_or_config)
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"kvcomp.hf: model_type {mt!r} is not supported: it needs RoPE attention over a "
            f"per-layer KV cache (grouped-query or MLA; sliding-window and linear-attention "
            f"layers beside it); supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    kinds = layer_kinds(cfg)
    if all(k == LINEAR for k in kinds):
        raise ValueError("kvcomp.hf: the model has no attention layer to compress")
    if WINDOW in kinds and not getattr(cfg, "sliding_window", None):
        raise ValueError("kvcomp.hf: sliding-window layers without a sliding_window size")
    dk, dv = head_dims(cfg)
    for what, d in () if _is_mla(cfg) else (("head_dim", dk), ("value head_dim", dv)):
        try:
            kernel_head_dim(d)
        except ValueError:
            raise ValueError(f"kvcomp.hf: {what} {d} is not supported (at most 256 channels "
                             f"per head)") from None
    hq = cfg.num_attention_heads
    hk = getattr(cfg, "num_key_value_heads", None) or hq
    if not _is_mla(cfg) and hq % hk:
        raise ValueError(f"kvcomp.hf: {hq} query heads are not a multiple of {hk} kv heads")


def _ids_1d(ids, what: str) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise ValueError(f"kvcomp.hf: {what} has batch size {t.shape[0]}: this call takes "
                             f"one sequence (batch 1)")
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"kvcomp.hf: {what} must be 1-D token ids (or [1, n]), got shape "
                         f"{tuple(t.shape)}")
    return t


def _id_list(ids, what: str) -> List[torch.Tensor]:
    """Token id sequences: a list of 1-D sequences, a [batch, n] tensor or one 1-D sequence."""
    if isinstance(ids, (list, tuple)) and ids and not isinstance(ids[0], (int, np.integer)):
        out = [torch.as_tensor(x, dtype=torch.long) for x in ids]
        for i, t in enumerate(out):
            if t.dim() != 1:
                raise ValueError(f"kvcomp.hf: {what}[{i}] must be 1-D token ids, got shape "
                                 f"{tuple(t.shape)}")
        return out
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() == 1:
        return [t]
    if t.dim() == 2:
        return list(t)
    raise ValueError(f"kvcomp.hf: {what} must be 1-D token ids, [batch, n] or a list of "
                     f"sequences, got shape {tuple(t.shape)}")


def _left_pad(seqs: List[torch.Tensor], pad_id: int = 0):
    """[batch, n] ids and their bool mask, each sequence right-aligned (left padding)."""
    n = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.bool)
    for b, s in enumerate(seqs):
        if s.numel():
            ids[b, n - s.numel():] = s
            mask[b, n - s.numel():] = True
    return ids, mask


# --- the compressed prompt of one layer ---

class _Prefix:
    """One layer's compressed prompt on the model's device, float32, batched.

    keys [B, Hk, N, dk], values [B, Hk, N, dv] (padded to the layer's largest head), pos [B, Hk,
    N] (each token's position in the cache's padded coordinates, for the model's mask), bias [B,
    Hk, N] (0 kept, -inf padding); with moments: mu_k [B, Hk, dk], mu_v [B, Hk, dv], log_n
    [B, Hk] (-inf where nothing was evicted), cov [B, Hk, dv, dk] = S/n - mu_v mu_k^T. length:
    the prompt's length in those coordinates. latent: keys and values are an MLA latent (the
    compressed KV and the RoPE'd key), expanded per head by the layer's expand_kv.
    """

    def __init__(self, keys, values, bias, mu_k=None, mu_v=None, log_n=None, cov=None, *,
                 pos=None, length=0, latent=False):
        if keys.dim() == 3:  # one sequence, [Hk, N, d]
            keys, values, bias = keys[None], values[None], bias[None]
            if mu_k is not None:
                mu_k, mu_v, log_n, cov = mu_k[None], mu_v[None], log_n[None], cov[None]
        self.keys, self.values, self.bias = keys, values, bias
        self.mu_k, self.mu_v, self.log_n, self.cov = mu_k, mu_v, log_n, cov
        self.pos, self.length, self.latent = pos, length, latent
        self._expanded = None

    def expanded(self, module):
        """Per-head keys and values of an MLA latent prefix (once per prefix)."""
        if self._expanded is None:
            dt = next(module.parameters()).dtype
            k, v = module.expand_kv(self.keys.to(dt), self.values.to(dt))
            h = k.shape[1]
            self._expanded = _Prefix(k.float(), v.float(), self.bias.expand(-1, h, -1),
                                     pos=None if self.pos is None else
                                     self.pos.expand(-1, h, -1), length=self.length)
        return self._expanded


def _stack_heads(rows, dk, dv, device):
    """rows[b][h] = (keys [n, >=dk], values [n, >=dv], positions [n]) -> padded tensors."""
    B, H = len(rows), len(rows[0])
    n = max(1, max(r[0].shape[0] for seq in rows for r in seq))
    K = np.zeros((B, H, n, dk), np.float32)
    V = np.zeros((B, H, n, dv), np.float32)
    P = np.zeros((B, H, n), np.int64)
    bias = np.full((B, H, n), -np.inf, np.float32)
    for b in range(B):
        for h in range(H):
            k, v, p = rows[b][h]
            m = k.shape[0]
            K[b, h, :m], V[b, h, :m] = k[:, :dk], v[:, :dv]
            P[b, h, :m], bias[b, h, :m] = p, 0.0
    return tuple(torch.from_numpy(a).to(device) for a in (K, V, bias, P))


def _per_head(arr, l, h):
    return np.asarray(arr[l][h], np.float32)


def _moments(ccs, l, H, dk, dv, device):
    """Batched MomentKV summaries of layer l of each sequence's cache."""
    B = len(ccs)
    mk, mv = np.zeros((B, H, dk)), np.zeros((B, H, dv))
    log_n = np.full((B, H), -np.inf)
    cov = np.zeros((B, H, dv, dk))
    for b, cc in enumerate(ccs):
        for h in range(H):
            cnt, ks, vs, S = cc.moments(l, h)
            if cnt == 0:
                continue
            k_ = np.asarray(ks, np.float64)[:dk] / cnt
            v_ = np.asarray(vs, np.float64)[:dv] / cnt
            mk[b, h], mv[b, h], log_n[b, h] = k_, v_, np.log(cnt)
            cov[b, h] = np.asarray(S, np.float64)[:dv, :dk] / cnt - np.outer(v_, k_)
    return tuple(torch.from_numpy(a.astype(np.float32)).to(device) for a in (mk, mv, log_n, cov))


def _prefixes(cc, projection, device, backend) -> List[_Prefix]:
    """Decodes one sequence's CompressedCache (every layer full attention, positions as kept)
    into per-layer _Prefix objects (moments when it has them)."""
    L, H, d = cc.num_layers, cc.num_kv_heads, cc.head_dim
    k, v = kvcomp.decompress(cc, projection, backend=backend)
    out = []
    for l in range(L):
        rows = [[(_per_head(k, l, h), _per_head(v, l, h),
                  np.asarray(cc.kept_positions(l, h), np.int64)) for h in range(H)]]
        K, V, B_, P = _stack_heads(rows, d, d, device)
        p = _Prefix(K, V, B_, pos=P, length=cc.original_tokens)
        if cc.has_moments:
            p.mu_k, p.mu_v, p.log_n, p.cov = _moments([cc], l, H, d, d, device)
        out.append(p)
    return out


def prefix_attention(query, prefix: _Prefix, new_keys, new_values, scaling: float,
                     correct: bool, *, mask=None, sinks=None):
    """Attention of query [B, Hq, m, dk] over a compressed prefix, its virtual tokens (when
    `correct` and it has moments) and new tokens [B, Hk, s, d] (s >= m; query i is new token
    s - m + i). mask: the model's 4-D mask [B, 1, m, prefix.length + s] (float, 0 = attend, or
    bool, True = attend) in the cache's padded coordinates; the prefix reads it at its kept
    positions. Without one, new tokens are causal and the whole prefix is visible. sinks: one
    logit per query head entering every softmax with no value (gpt-oss). Returns [B, m, Hq, dv]
    in the query's dtype."""
    B, hq, m, dk = query.shape
    hk = prefix.keys.shape[1]
    g = hq // hk
    dv = prefix.values.shape[-1]
    q = query.float().reshape(B, hk, g, m, dk)
    mm = None
    if mask is not None:
        mm = mask[:, 0] if mask.dim() == 4 else mask
        if mm.dtype == torch.bool:
            mm = torch.zeros(mm.shape, device=q.device).masked_fill(~mm, float("-inf"))
        else:
            mm = mm.float()
            mm = mm.masked_fill(mm < -1e30, float("-inf"))
        mm = mm.expand(B, m, mm.shape[-1])
    n = prefix.keys.shape[2]
    lp = torch.einsum("bhgmd,bhnd->bhgmn", q, prefix.keys) * scaling \
        + prefix.bias[:, :, None, None, :]
    if mm is not None and n:
        idx = prefix.pos.clamp(0, mm.shape[-1] - 1)
        seen = torch.gather(mm[:, None].expand(B, hk, m, mm.shape[-1]), 3,
                            idx[:, :, None, :].expand(B, hk, m, n))
        lp = lp + seen[:, :, None]
    parts = [lp]
    virt = correct and prefix.mu_k is not None
    if virt:
        lv = torch.einsum("bhgmd,bhd->bhgm", q, prefix.mu_k) * scaling \
            + prefix.log_n[:, :, None, None]
        parts.append(lv[..., None])
    s = 0
    if new_keys is not None and new_keys.shape[2] > 0:
        kn = torch.nan_to_num(new_keys.float())  # padding tokens of a batch are masked
        s = kn.shape[2]
        ln = torch.einsum("bhgmd,bhsd->bhgms", q, kn) * scaling
        if mm is not None:
            ln = ln + mm[:, None, None, :, prefix.length:prefix.length + s]
        else:
            qi = torch.arange(m, device=q.device)[:, None] + (s - m)
            kj = torch.arange(s, device=q.device)[None, :]
            ln = ln.masked_fill(kj > qi, float("-inf"))
        parts.append(ln)
    if sinks is not None:
        sk = sinks.float().reshape(1, hk, g, 1, 1).expand(B, hk, g, m, 1)
        parts.append(sk)
    logits = torch.cat(parts, dim=-1)
    p = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgmn,bhnd->bhgmd", p[..., :n], prefix.values)
    o = n
    if virt:
        pv = p[..., o]
        o += 1
        cq = torch.einsum("bhij,bhgmj->bhgmi", prefix.cov, q)
        out = out + pv[..., None] * (prefix.mu_v[:, :, None, None, :] + scaling * cq)
    if s:
        vn = torch.nan_to_num(new_values.float())
        out = out + torch.einsum("bhgms,bhsd->bhgmd", p[..., o:o + s], vn)
    return out.reshape(B, hq, m, dv).transpose(1, 2).to(query.dtype)


# --- the cache ---

class KvcompCache(DynamicCache):
    """A transformers Cache whose prompt is compressed by kvcomp after its prefill.

    The first forward pass (the prompt) is cached as is; at the start of the next forward (or
    when compress() is called) the prompt cache goes through kvcomp under `policy`, one
    CompressedCache per sequence of the batch (its padding dropped), and is replaced by the kept
    tokens (and moments). Later tokens are cached uncompressed. Needs the model's attention
    implementation to be "kvcomp" (press() and generate() set it).

    After compression: `caches` (per sequence, a dict with the kvcomp.CompressedCache of the
    full-attention layers under "full" and of the sliding-window layers' windows under
    "window", each None when the model has no such layer), `compressed` (batch 1: caches[0]
    ["full"]; a batch: the list of them), `original_length` (the prompt's length, padding
    included), `stored_bytes` (all sequences, both parts), `bytes_per_token` (stored bytes per
    real prompt token).
    """

    def __init__(self, model_or_config, policy=None, *, correct: bool = True,
                 backend: str = "cpu", projection=None, client=None,
                 model_id: Optional[str] = None, cache_dtype: Optional[torch.dtype] = None):
        check_model(model_or_config)
        super().__init__()
        self._cfg = _config(model_or_config)
        self.kinds = layer_kinds(self._cfg)
        self.window = getattr(self._cfg, "sliding_window", None)
        self.mla = _is_mla(self._cfg)
        self._attn_layers = [l for l, k in enumerate(self.kinds) if k != LINEAR]
        if LINEAR in self.kinds:  # the linear layers' state lives in layers of its own kind
            self.layers = [LinearAttentionLayer() if k == LINEAR else DynamicLayer()
                           for k in self.kinds]
            self.layer_class_to_replicate = None
        self.policy = policy if policy is not None else kvcomp.Policy()
        self.correct = correct
        self.backend = backend
        self.projection = projection
        self.client = client
        self.model_id = model_id or getattr(self._cfg, "_name_or_path", "") or "hf-model"
        self.cache_dtype = cache_dtype
        if client is not None and self.policy.scorer == "snapkv":
            raise ValueError(
                "kvcomp.hf: scorer snapkv needs the observation window's queries, which the "
                "kvcompd path does not carry; run snapkv in-process (client=None)")
        self.pieces = _wide_latent(self._cfg)
        if self.pieces and not (
                (self.policy.scorer == "streaming" or
                 (self.policy.ratio == 0 and self.policy.budget is None)) and
                self.policy.head_budget == "uniform"):
            raise ValueError(
                f"kvcomp.hf: an MLA latent of {sum(head_dims(self._cfg))} channels (above the "
                f"kernels' 256) is stored in {PIECE}-channel pieces; only position-based "
                f"eviction (scorer streaming, uniform heads) or ratio 0 keeps a token's pieces "
                f"together, not scorer {self.policy.scorer!r} at ratio {self.policy.ratio}")
        if self.mla and self.policy.scorer == "snapkv":
            raise ValueError("kvcomp.hf: scorer snapkv scores keys against per-head queries; "
                             "an MLA cache holds the latent, which those queries do not meet")
        self._pending: Dict[int, tuple] = {}
        self._queries: Dict[int, torch.Tensor] = {}
        self._returned: Dict[int, torch.Tensor] = {}
        self._real: Optional[torch.Tensor] = None  # [B, T] bool: prompt tokens, not padding
        self._num_q_heads: Optional[int] = None
        self.prefixes: Optional[Dict[int, _Prefix]] = None
        self.caches: List[Dict[str, Any]] = []
        self.compressed = None
        self.original_length = 0
        self.put_result = None
        self.stored_bytes = 0
        self.linear_state: Optional[Dict[int, Any]] = None
        # per cache coordinate after compression: the token's RoPE position and whether it is
        # a token (padding inside a batch's questions is not); for sliding windows
        self._coord_pos: Optional[torch.Tensor] = None
        self._coord_real: Optional[torch.Tensor] = None
        self._linear_seen: set = set()
        _ACTIVE_REFS.append(weakref.ref(self))

    # transformers' Cache API
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.prefixes is None and layer_idx in self._pending:
            self.compress()  # the next forward after the prompt's
        if self.prefixes is None:
            self._pending[layer_idx] = (key_states, value_states)
            self._returned[layer_idx] = key_states
            _LAST_UPDATE[layer_idx] = weakref.ref(self)
            return key_states, value_states
        k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._returned[layer_idx] = k
        _LAST_UPDATE[layer_idx] = weakref.ref(self)
        return k, v

    def has_previous_state(self, layer_idx=None, *args, **kwargs):
        # A linear-attention layer asks first thing in its forward: a layer asking a second
        # time starts the forward after the prompt's, so the prompt is compressed (and the
        # layers' state kept) before that forward changes the state.
        if self.prefixes is None and layer_idx is not None and \
                layer_idx < len(self.kinds) and self.kinds[layer_idx] == LINEAR:
            if layer_idx in self._linear_seen and self._pending and \
                    all(l in self._pending for l in self._attn_layers):
                self.compress()
            self._linear_seen.add(layer_idx)
        return super().has_previous_state(layer_idx, *args, **kwargs)

    def note_tokens(self, real: torch.Tensor, positions: torch.Tensor) -> None:
        """Records the next tokens' RoPE positions and which are tokens ([B, s] each), before
        the forward that appends them (greedy does; without it new tokens are taken as real
        and consecutive)."""
        if self._coord_pos is None:
            self._init_coords()
        self._coord_pos = torch.cat([self._coord_pos, positions.cpu().long()], dim=1)
        self._coord_real = torch.cat([self._coord_real, real.cpu().bool()], dim=1)

    def _init_coords(self):
        real = self.prompt_mask
        self._coord_pos = (real.long().cumsum(-1) - 1).clamp(min=0)
        self._coord_real = real.clone()

    def _window_mask(self, m: int, window: int, device) -> torch.Tensor:
        """The sliding-window mask of the last m coordinates [B, 1, m, L] (0 / -inf), by RoPE
        positions: padding inside the sequence does not use up the window."""
        if self._coord_pos is None:
            self._init_coords()
        L = self.get_seq_length()
        have = self._coord_pos.shape[1]
        if have < L:  # tokens appended without note_tokens: real, consecutive
            last = self._coord_pos[:, -1:] if have else torch.full((self.batch_size, 1), -1)
            step = torch.arange(1, L - have + 1)[None]
            self._coord_pos = torch.cat([self._coord_pos, last + step], dim=1)
            self._coord_real = torch.cat(
                [self._coord_real, torch.ones((self.batch_size, L - have), dtype=torch.bool)], 1)
        pos, real = self._coord_pos[:, :L].to(device), self._coord_real[:, :L].to(device)
        qi = torch.arange(L - m, L, device=device)
        kj = torch.arange(L, device=device)
        qp = pos[:, L - m:]
        ok = real[:, None, :] & (kj[None, None, :] <= qi[None, :, None]) & \
            (qp[:, :, None] - pos[:, None, :] < window)
        return torch.zeros(ok.shape, device=device).masked_fill(~ok, float("-inf"))[:, None]

    def _new_length(self) -> int:
        l = self._attn_layers[0]
        if l < len(self.layers) and self.layers[l].is_initialized:
            return self.layers[l].get_seq_length()
        return 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.prefixes is None:
            for k, _ in self._pending.values():
                return k.shape[2]
            return 0
        return self.original_length + self._new_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.get_seq_length(layer_idx) + query_length, 0

    @property
    def batch_size(self) -> int:
        if self._real is not None:
            return self._real.shape[0]
        for k, _ in self._pending.values():
            return k.shape[0]
        return 1

    @property
    def prompt_mask(self) -> torch.Tensor:
        """[B, original_length] bool: which prompt positions are tokens (not padding)."""
        if self._real is None:
            return torch.ones((self.batch_size, self.get_seq_length()), dtype=torch.bool)
        return self._real

    def _observe(self, layer_idx, query, attention_mask):
        """During the prefill: which prompt positions are padding (the mask's diagonal), the
        number of query heads and SnapKV's window queries."""
        if self._real is None and attention_mask is not None and \
                attention_mask.shape[-1] == attention_mask.shape[-2] == query.shape[2]:
            diag = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)
            self._real = (diag if diag.dtype == torch.bool else diag > -1e30).cpu()
        self._num_q_heads = query.shape[1]
        if self.policy.scorer == "snapkv" and self.kinds[layer_idx] == FULL:
            w = min(self.policy.snapkv_window, query.shape[2])
            self._queries[layer_idx] = query[:, :, -w:].detach()

    # kvcomp
    def _store(self, ks, vs, qs, policy, projection, hq):
        """One sequence's part ([L, Hk, T, D]) compressed in-process or through kvcompd:
        (CompressedCache, stored bytes, projection to decode with, decode backend)."""
        device = ks.device
        if self.cache_dtype is not None:
            ks, vs = ks.to(self.cache_dtype), vs.to(self.cache_dtype)
            qs = qs.to(self.cache_dtype) if qs is not None else None
        ks, vs = ks.contiguous(), vs.contiguous()
        qs = qs.contiguous() if qs is not None else None
        if self.client is not None:
            key = f"kvcomp-hf-{uuid.uuid4().hex}"
            res = self.client.put(self.model_id, key, ks.cpu(), vs.cpu(), policy=policy,
                                  num_q_heads=hq)
            self.put_result = res
            try:
                encoded = policy.key_codec != "raw" or policy.value_codec != "none"
                cc = self.client.get(self.model_id, key, decoded=encoded)
            finally:
                self.client.delete(self.model_id, key)
            return cc, res["stored_bytes"], None, "cpu"
        args = dict(num_q_heads=hq, projection=projection, queries=qs)
        if self.backend == "cuda":
            if device.type != "cuda":
                ks, vs = ks.cuda(), vs.cuda()
                qs = qs.cuda() if qs is not None else None
            torch.cuda.synchronize(ks.device)
            cc = kvcomp.compress(ks, vs, policy, backend="cuda", **args)
        else:
            cc = kvcomp.compress(_host(ks), _host(vs), policy, backend=self.backend,
                                 dtype=_dtype_hint(ks), **{**args, "queries": _host(qs)})
        return cc, cc.nbytes, projection, self.backend

    def _rows_of_pieces(self, cc, k, v, layers, rows, pos_of, dk, dv):
        """A wide MLA latent's pseudo-heads put back together: one head per layer."""
        P = cc.num_kv_heads
        for li, l in enumerate(layers):
            kept = [np.asarray(cc.kept_positions(li, h), np.int64) for h in range(P)]
            if any(not np.array_equal(kept[0], x) for x in kept[1:]):
                raise RuntimeError("kvcomp.hf: the pieces of an MLA latent kept different "
                                   "tokens")
            lk, lv = _from_pieces([_per_head(k, li, h) for h in range(P)],
                                  [_per_head(v, li, h) for h in range(P)], dk, dv)
            rows[l].append([(lk, lv, pos_of[kept[0]])])

    def _store_linear(self):
        """The linear-attention layers' state after the prompt, kept as the model left it; with
        a client it makes a lossless round trip through kvcompd (ratio 0, raw codecs, in its own
        dtype) and decoding continues from what came back."""
        state = {l: copy.deepcopy(self.layers[l]) for l, k in enumerate(self.kinds)
                 if k == LINEAR}
        if self.client is not None:
            for layer in state.values():
                for attr in ("conv_states", "recurrent_states"):
                    d = getattr(layer, attr)
                    for i, t in list(d.items()):
                        if isinstance(t, torch.Tensor):
                            d[i] = self._round_trip_state(t)
            for l, layer in state.items():
                self.layers[l] = copy.deepcopy(layer)
        self.linear_state = state

    def _round_trip_state(self, t: torch.Tensor) -> torch.Tensor:
        """One state tensor through kvcompd as a one-layer, one-head cache kept whole: its
        elements in order, the first half as keys and the second as values, rows of 64."""
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"kvcomp.hf: a {t.dtype} linear-attention state cannot be stored")
        flat = t.detach().reshape(-1).cpu()
        n = flat.numel()
        rows = max(1, -(-n // (2 * PIECE)))
        buf = torch.zeros(2 * rows * PIECE, dtype=t.dtype)
        buf[:n] = flat
        kv = buf.reshape(2, 1, 1, rows, PIECE)
        key = f"kvcomp-hf-state-{uuid.uuid4().hex}"
        res = self.client.put(self.model_id, key, kv[0], kv[1],
                              policy=kvcomp.Policy(ratio=0.0, moments=False), num_q_heads=1)
        try:
            cc = self.client.get(self.model_id, key)
        finally:
            self.client.delete(self.model_id, key)
        self.stored_bytes += res["stored_bytes"]
        k, v = kvcomp.decompress(cc)
        back = torch.cat([torch.from_numpy(np.asarray(k)).reshape(-1),
                          torch.from_numpy(np.asarray(v)).reshape(-1)])[:n]
        return back.to(t.dtype).reshape(t.shape).to(t.device)

    def _window_policy(self):
        return kvcomp.Policy(ratio=0.0, moments=False, key_codec=self.policy.key_codec)

    def compress(self) -> "KvcompCache":
        """Compresses the prefilled prompt now (a no-op once done)."""
        if self.prefixes is not None:
            return self
        if not self._pending:
            raise RuntimeError("kvcomp.hf: nothing prefilled to compress")
        missing = [l for l in self._attn_layers if l not in self._pending]
        if missing:
            raise RuntimeError(f"kvcomp.hf: layers {missing} were not prefilled")
        if self.policy.scorer == "snapkv" and any(
                l not in self._queries for l, k in enumerate(self.kinds) if k == FULL):
            raise RuntimeError("kvcomp.hf: snapkv needs the prompt's queries; the model's "
                               "attention implementation must be 'kvcomp' during the prefill")
        k0, v0 = self._pending[self._attn_layers[0]]
        B, T, device = k0.shape[0], k0.shape[2], k0.device
        hk, dk, dv = k0.shape[1], k0.shape[-1], v0.shape[-1]
        D = PIECE if self.pieces else kernel_head_dim(dk, dv)
        hq = self._num_q_heads or getattr(self._cfg, "num_attention_heads", hk)
        if self.mla:
            hq = hk  # the latent is one head; its queries are not stored
        real = self.prompt_mask
        if tuple(real.shape) != (B, T):
            raise RuntimeError(f"kvcomp.hf: prompt mask {tuple(real.shape)} for a prompt of "
                               f"{(B, T)}")
        self.original_length = T
        full = [l for l in self._attn_layers if self.kinds[l] == FULL]
        win = [l for l in self._attn_layers if self.kinds[l] == WINDOW]
        self.caches, self.stored_bytes = [], 0
        rows = {l: [] for l in self._attn_layers}
        moments = {l: [] for l in full}
        for b in range(B):
            idx = torch.nonzero(real[b]).flatten().to(device)
            entry: Dict[str, Any] = {"full": None, "window": None}
            pos_of = idx.cpu().numpy()
            parts = []
            if full:
                parts.append(("full", full, 0, self.policy, self.projection))
            if win:
                start = max(0, idx.numel() - int(self.window))
                parts.append(("window", win, start, self._window_policy(), None))
            for name, layers, start, pol, proj in parts:
                sel = idx[start:]
                if self.pieces:
                    pk = [_to_pieces(self._pending[l][0][b, 0].index_select(0, sel),
                                     self._pending[l][1][b, 0].index_select(0, sel))
                          for l in layers]
                    ks, vs = torch.stack([p[0] for p in pk]), torch.stack([p[1] for p in pk])
                    hq = ks.shape[1]
                else:
                    ks = torch.stack([pad_head_dim(self._pending[l][0][b].index_select(1, sel),
                                                   D) for l in layers])
                    vs = torch.stack([pad_head_dim(self._pending[l][1][b].index_select(1, sel),
                                                   D) for l in layers])
                qs = None
                if name == "full" and pol.scorer == "snapkv":
                    w = min(pol.snapkv_window, sel.numel(), self._queries[full[0]].shape[2])
                    qs = torch.stack([pad_head_dim(self._queries[l][b, :, -w:], D)
                                      for l in layers])
                cc, nbytes, dproj, dback = self._store(ks, vs, qs, pol, proj, hq)
                entry[name] = cc
                self.stored_bytes += nbytes
                k, v = kvcomp.decompress(cc, dproj, backend=dback)
                if self.pieces:
                    self._rows_of_pieces(cc, k, v, layers, rows, pos_of[start:], dk, dv)
                    continue
                for li, l in enumerate(layers):
                    rows[l].append([(_per_head(k, li, h), _per_head(v, li, h),
                                     pos_of[start + np.asarray(cc.kept_positions(li, h),
                                                               np.int64)])
                                    for h in range(hk)])
                    if name == "full" and cc.has_moments:
                        moments[l].append((cc, li))
            self.caches.append(entry)
        self.prefixes = {}
        for l in self._attn_layers:
            K, V, bias, P = _stack_heads(rows[l], dk, dv, device)
            p = _Prefix(K, V, bias, pos=P, length=T, latent=self.mla)
            if moments.get(l) and len(moments[l]) == B and not self.mla:
                li = moments[l][0][1]
                p.mu_k, p.mu_v, p.log_n, p.cov = _moments([c for c, _ in moments[l]], li, hk,
                                                          dk, dv, device)
            self.prefixes[l] = p
        self.compressed = self.caches[0]["full"] if B == 1 else [e["full"] for e in self.caches]
        if LINEAR in self.kinds:
            self._store_linear()
        self._pending.clear()
        self._queries.clear()
        self._returned.clear()
        return self

    def fork(self, correct: Optional[bool] = None) -> "KvcompCache":
        """A new cache over the same compressed prompt (nothing appended after it), with the
        correction on or off: one compression serves several continuations."""
        if self.prefixes is None:
            raise RuntimeError("kvcomp.hf: fork() needs a compressed cache")
        c = KvcompCache(self._cfg, self.policy, correct=self.correct if correct is None
                        else correct, backend=self.backend, projection=self.projection,
                        model_id=self.model_id, cache_dtype=self.cache_dtype)
        c.prefixes, c.compressed, c.caches = self.prefixes, self.compressed, self.caches
        c.original_length, c._real = self.original_length, self._real
        c.stored_bytes, c.put_result = self.stored_bytes, self.put_result
        c._restore_linear(self.linear_state)
        return c

    def _restore_linear(self, state):
        """Puts copies of the linear-attention layers' post-prompt state back (bit for bit)."""
        if not state:
            return
        self.linear_state = state
        for l, layer in state.items():
            self.layers[l] = copy.deepcopy(layer)

    @property
    def bytes_per_token(self) -> float:
        return self.stored_bytes / max(1, int(self.prompt_mask.sum()))

    def bf16_bytes_per_token(self) -> int:
        """Bytes per token of the attention layers' cache in bf16, unpadded (what the model
        itself would hold; sliding-window layers counted in full)."""
        c = self._cfg
        dk, dv = head_dims(c)
        hk = 1 if self.mla else (getattr(c, "num_key_value_heads", None)
                                 or c.num_attention_heads)
        return len(self._attn_layers) * hk * (dk + dv) * 2


def _host(t):
    """A CPU tensor as kvcomp's host input (bf16 as its raw bits)."""
    if t is None:
        return None
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _dtype_hint(t):
    return "bf16" if t.dtype == torch.bfloat16 else None


# --- the attention function ---

_BASE_IMPL: Dict[int, Tuple[Any, str]] = {}  # id(config) -> (weakref to it, implementation)


def _base_attention(module):
    """The model's own attention implementation (the one it had before "kvcomp"), or its
    eager attention where that is not a registered one."""
    cfg = getattr(module, "config", None)
    ref, name = _BASE_IMPL.get(id(cfg), (None, None))
    if ref is None or ref() is not cfg:
        name = None
    if name and name != "eager" and name != ATTN_NAME and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    mod = sys.modules[type(module).__module__]
    if name is None and getattr(type(module), "_supports_sdpa", True) and \
            "sdpa" in ALL_ATTENTION_FUNCTIONS and not hasattr(module, "sinks"):
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    return mod.eager_attention_forward


def kvcomp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers attention function "kvcomp": the model's own attention while a KvcompCache
    is being prefilled (noting its padding and SnapKV's window queries), attention over the
    compressed prompt afterwards, the model's own when no KvcompCache is in use."""
    cache = _ACTIVE.get(id(key))
    if cache is None and hasattr(module, "expand_kv"):  # MLA: keys expanded from the latent
        r = _LAST_UPDATE.get(getattr(module, "layer_idx", None))
        cache = r() if r is not None else None
        t = None if cache is None else cache._returned.get(module.layer_idx)
        if t is None or t.shape[0] != key.shape[0] or t.shape[2] != key.shape[2]:
            cache = None
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if cache is None or cache.prefixes is None:
        if cache is not None:
            cache._observe(module.layer_idx, query, attention_mask)
        return _base_attention(module)(module, query, key, value, attention_mask,
                                       dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("kvcomp.hf: attention logit soft-capping is not supported")
    prefix = cache.prefixes[module.layer_idx]
    correct = cache.correct
    if prefix.latent:
        prefix, correct = prefix.expanded(module), False
    window = kwargs.get("sliding_window")
    if window and cache.kinds[module.layer_idx] == WINDOW:
        attention_mask = cache._window_mask(query.shape[2], int(window), query.device)
    out = prefix_attention(query, prefix, key, value, scaling, correct, mask=attention_mask,
                           sinks=kwargs.get("s_aux"))
    return out, None


_ACTIVE_REFS: "List[Any]" = []
_LAST_UPDATE: Dict[int, Any] = {}  # layer -> the KvcompCache that layer last updated


class _Active:
    """Finds the KvcompCache whose update() returned a key tensor: the attention function
    receives only the tensors, and a cache is found by the identity of what it returned (for
    MLA, the tensor the layer expanded from it is found through its latent's update)."""

    def get(self, kid):
        alive = []
        found = None
        for r in _ACTIVE_REFS:
            c = r()
            if c is None:
                continue
            alive.append(r)
            if found is None and any(id(t) == kid for t in c._returned.values()):
                found = c
        _ACTIVE_REFS[:] = alive
        return found


_ACTIVE = _Active()

AttentionInterface.register(ATTN_NAME, kvcomp_attention)
AttentionMaskInterface.register(ATTN_NAME, eager_mask)

# --- prefill, generate, loss ---

@contextlib.contextmanager
def _attention_impl(model, name=ATTN_NAME):
    old = model.config._attn_implementation
    if old != name:
        for c in {id(model.config): model.config, id(_config(model)): _config(model)}.values():
            _BASE_IMPL[id(c)] = (weakref.ref(c), c._attn_implementation or old)
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if old != name:
            model.set_attn_implementation(old)


class Prefill:
    """A prompt's prefill, kept so several policies can compress the same prompt: kv {layer:
    (keys [B, Hk, T, dk], values [B, Hk, T, dv])} of the attention layers, queries {layer:
    [B, Hq, w, dk]} (SnapKV's window, the last w prompt positions) of the full-attention
    layers, real [B, T] (prompt tokens, not padding), the last position's logits [B, vocab], and
    the linear-attention layers' state after the prompt."""

    def __init__(self, kv, queries, real, last_logits, num_q_heads, linear_state=None):
        self.kv, self.queries, self.real = kv, queries, real
        self.last_logits, self.num_q_heads, self.linear_state = last_logits, num_q_heads, \
            linear_state

    @property
    def length(self):
        return self.real.shape[1]

    @property
    def batch_size(self):
        return self.real.shape[0]


def _run(model, ids, mask, positions, cache):
    kw = {}
    if mask is not None:
        kw = dict(attention_mask=mask.long().to(model.device),
                  position_ids=positions.to(model.device))
    return model(ids.to(model.device), past_key_values=cache, use_cache=True, **kw)


@torch.no_grad()
def prefill(model, context_ids, *, snapkv_window: int = 64) -> Prefill:
    """Runs the model over the context once and keeps its cache (see Prefill). context_ids:
    one sequence, [batch, n] or a list of sequences of different lengths (left-padded)."""
    check_model(model)
    seqs = _id_list(context_ids, "context_ids")
    ids, real = _left_pad(seqs)
    padded = not bool(real.all())
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    keep = kvcomp.Policy(ratio=0.0) if _is_mla(_config(model)) else \
        kvcomp.Policy(scorer="snapkv", snapkv_window=snapkv_window)  # keeps the window queries
    cache = KvcompCache(model, keep)
    with _attention_impl(model):
        out = _run(model, ids, real if padded else None, pos, cache)
    cache._real = real
    linear = {l: copy.deepcopy(cache.layers[l]) for l, k in enumerate(cache.kinds)
              if k == LINEAR}
    return Prefill(dict(cache._pending), dict(cache._queries), real,
                   out.logits[:, -1].float(), cache._num_q_heads, linear or None)


def cache_from_prefill(model, pre: Prefill, policy, *, correct=True, backend="cpu",
                       projection=None, client=None, model_id=None,
                       cache_dtype=None) -> KvcompCache:
    """A compressed KvcompCache of a Prefill under `policy` (the prefill is not modified)."""
    c = KvcompCache(model, policy, correct=correct, backend=backend, projection=projection,
                    client=client, model_id=model_id, cache_dtype=cache_dtype)
    c._pending = dict(pre.kv)
    if policy.scorer == "snapkv":
        c._queries = {l: q[:, :, -min(policy.snapkv_window, q.shape[2]):]
                      for l, q in pre.queries.items()}
    c._real, c._num_q_heads = pre.real, pre.num_q_heads
    c._restore_linear(pre.linear_state)
    return c.compress()


def _first_logits(first_logits, batch):
    lg = first_logits.float()
    return lg.reshape(batch, -1) if lg.dim() == 1 else lg


@torch.no_grad()
def greedy(model, cache: KvcompCache, first_logits, question_ids, max_new_tokens: int):
    """Greedy continuation over a compressed cache: feeds question_ids (may be empty; then the
    first token comes from first_logits), then generated tokens. Batch 1: question_ids 1-D,
    returns a 1-D LongTensor; a batch: one question per sequence (a list; different lengths
    are padded), returns [batch, max_new_tokens]."""
    B = cache.batch_size
    qs = [_ids_1d(question_ids, "question_ids")] if B == 1 else \
        _id_list(question_ids, "question_ids")
    if len(qs) == 1 and B > 1:
        qs = qs * B
    if len(qs) != B:
        raise ValueError(f"kvcomp.hf: {len(qs)} questions for a batch of {B}")
    prompt = cache.prompt_mask
    batched = B > 1 or not bool(prompt.all())
    nxt = prompt.long().sum(-1)  # each sequence's next position
    mask = prompt.clone()
    logits = _first_logits(first_logits, B).to(model.device)
    out: List[torch.Tensor] = []
    with _attention_impl(model):
        if max(q.numel() for q in qs):
            ids, qm = _left_pad(qs)
            pos = nxt[:, None] + (qm.long().cumsum(-1) - 1).clamp(min=0)
            mask = torch.cat([mask, qm], dim=1)
            cache.note_tokens(qm, pos)
            lg = _run(model, ids, mask if batched else None, pos, cache).logits[:, -1].float()
            has_q = torch.tensor([q.numel() > 0 for q in qs], device=lg.device)
            logits = torch.where(has_q[:, None], lg, logits)
            nxt = nxt + qm.long().sum(-1)
        for i in range(max_new_tokens):
            t = torch.argmax(logits, dim=-1)
            out.append(t.cpu())
            if i + 1 == max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.bool)], dim=1)
            cache.note_tokens(torch.ones((B, 1), dtype=torch.bool), nxt[:, None])
            logits = _run(model, t[:, None], mask if batched else None, nxt[:, None],
                          cache).logits[:, -1].float()
            nxt = nxt + 1
    res = torch.stack(out, dim=1) if out else torch.zeros((B, 0), dtype=torch.long)
    return res[0] if B == 1 else res


@torch.no_grad()
def greedy_matches(model, cache: KvcompCache, first_logits, question_ids,
                   target_ids) -> bool:
    """Whether greedy decoding after question_ids produces target_ids, in one forward pass
    (question + target[:-1], teacher-forced): greedy reproduces the target exactly when every
    position's argmax is the next target token. Same answer as greedy() == target. Batch 1."""
    q = _ids_1d(question_ids, "question_ids").to(model.device)
    t = _ids_1d(target_ids, "target_ids").to(model.device)
    ids = torch.cat([q, t[:-1]])
    logits = [_first_logits(first_logits, 1)] if q.numel() == 0 else []
    if ids.numel():
        with _attention_impl(model):
            lg = model(ids[None], past_key_values=cache, use_cache=True).logits[0]
        logits.append(lg[max(0, q.numel() - 1):])
    pred = torch.cat(logits)[: t.numel()].argmax(-1)
    return bool(torch.equal(pred, t))


@torch.no_grad()
def continuation_nll(model, cache: KvcompCache, first_logits, continuation_ids) -> torch.Tensor:
    """Per-token NLL (nats) of continuation_ids after a compressed cache: token 0 from
    first_logits (the prefill's), the others from one forward pass over the continuation.
    Batch 1."""
    c = _ids_1d(continuation_ids, "continuation_ids").to(model.device)
    if c.numel() == 0:
        raise ValueError("kvcomp.hf: empty continuation")
    logits = [_first_logits(first_logits, 1)]
    if c.numel() > 1:
        with _attention_impl(model):
            logits.append(model(c[None, :-1], past_key_values=cache,
                                use_cache=True).logits[0].float())
    lg = torch.cat(logits)
    return torch.nn.functional.cross_entropy(lg, c, reduction="none")


def generate(model, context_ids, question_ids, policy=None, *, max_new_tokens: int,
             correct: bool = True, backend: str = "cpu", client=None, projection=None,
             model_id: Optional[str] = None, cache_dtype=None) -> torch.Tensor:
    """Greedy continuation ids of question_ids after the compressed context: a 1-D LongTensor
    for one sequence; [batch, max_new_tokens] for a batch (context_ids and question_ids lists
    of sequences of any lengths, or [batch, n]).

    The context is prefilled and compressed under `policy` (kvcomp.Policy; ratio 0 keeps
    everything); question and generated tokens are appended uncompressed, positions continuing
    from the context's length. correct: the MomentKV correction of what was evicted. backend:
    "cpu" or "cuda" for kvcomp's compression. client: a kvcomp.Client; the context's cache
    makes a round trip through kvcompd (put, get, delete) instead of compressing in-process.
    projection: the KVSplice projection for value codecs (kvcomp.hf.calibrate). cache_dtype:
    the dtype the cache is handed to kvcomp in (e.g. torch.bfloat16; default the model's).
    """
    pre = prefill(model, context_ids, snapkv_window=(policy or kvcomp.Policy()).snapkv_window)
    cache = cache_from_prefill(model, pre, policy or kvcomp.Policy(), correct=correct,
                               backend=backend, projection=projection, client=client,
                               model_id=model_id, cache_dtype=cache_dtype)
    return greedy(model, cache, pre.last_logits, question_ids, max_new_tokens)


def loss(model, context_ids, continuation_ids, policy=None, *, correct: bool = True,
         backend: str = "cpu", client=None, projection=None, model_id: Optional[str] = None,
         cache_dtype=None) -> float:
    """Mean next-token NLL (nats) over continuation_ids given the compressed context (one
    sequence)."""
    pol = policy or kvcomp.Policy()
    _ids_1d(context_ids, "context_ids")
    pre = prefill(model, context_ids, snapkv_window=pol.snapkv_window)
    cache = cache_from_prefill(model, pre, pol, correct=correct, backend=backend,
                               projection=projection, client=client, model_id=model_id,
                               cache_dtype=cache_dtype)
    return float(continuation_nll(model, cache, pre.last_logits, continuation_ids).mean())


@torch.no_grad()
def calibrate(model, texts: Sequence[Any], *, cache_dtype=None, **kwargs):
    """A KVSplice projection (kvcomp.calibrate) from the value caches of `texts` (token id
    sequences; use text other than what will be compressed): the full-attention layers' (the
    ones a policy compresses), padded as kvcomp stores them. kwargs go to kvcomp.calibrate
    (rank, error_budget, codec, metric, ...)."""
    kinds = layer_kinds(model)
    full = [l for l, k in enumerate(kinds) if k == FULL]
    if not full:
        raise ValueError("kvcomp.hf: the model has no full-attention layer to calibrate for")
    vals, keys = [], []
    for t in texts:
        pre = prefill(model, _ids_1d(t, "texts[i]"))
        D = kernel_head_dim(pre.kv[full[0]][0].shape[-1], pre.kv[full[0]][1].shape[-1])
        k = torch.stack([pad_head_dim(pre.kv[l][0][0], D) for l in full])
        v = torch.stack([pad_head_dim(pre.kv[l][1][0], D) for l in full])
        if cache_dtype is not None:
            v, k = v.to(cache_dtype), k.to(cache_dtype)
        vals.append(v.float().cpu().numpy())
        keys.append(k.float().cpu().numpy())
    if kwargs.get("metric") == "attention":
        kwargs.setdefault("keys", keys)
    return kvcomp.calibrate(vals, **kwargs)


# --- kvpress-style use with model.generate and pipelines ---

class press:
    """Compresses every prompt that `model.generate` (and pipelines over the model) prefill.

        with kvcomp.hf.press(model, kvcomp.Policy(scorer="keydiff", ratio=0.5)) as p:
            out = model.generate(input_ids, max_new_tokens=20)
            # or: pipeline("text-generation", model=model, tokenizer=tok)(prompt)
        p.last_cache.bytes_per_token     # what the compressed prompt costs

    Inside the block the model's attention implementation is "kvcomp" and model.generate gets
    a fresh KvcompCache per call unless past_key_values is given. The first generated token
    comes from the prefill (full attention); the following ones read the compressed prompt.
    Batches are left-padded (pass attention_mask, as with any batched generate).
    """

    def __init__(self, model, policy=None, *, correct: bool = True, backend: str = "cpu",
                 projection=None, client=None, model_id: Optional[str] = None,
                 cache_dtype=None):
        check_model(model)
        self.model = model
        self.kw = dict(correct=correct, backend=backend, projection=projection, client=client,
                       model_id=model_id, cache_dtype=cache_dtype)
        self.policy = policy if policy is not None else kvcomp.Policy()
        self.last_cache: Optional[KvcompCache] = None
        self._ctx = None

    def cache(self) -> KvcompCache:
        self.last_cache = KvcompCache(self.model, self.policy, **self.kw)
        return self.last_cache

    def __enter__(self) -> "press":
        self._ctx = _attention_impl(self.model)
        self._ctx.__enter__()
        original = self.model.generate

        def generate(*args, **kwargs):
            if kwargs.get("past_key_values") is None:
                kwargs["past_key_values"] = self.cache()
            return original(*args, **kwargs)

        self.model.generate = generate
        return self

    def __exit__(self, *exc):
        try:
            del self.model.generate
        except AttributeError:
            pass
        self._ctx.__exit__(*exc)
        return False

"""kvcomp on Hugging Face transformers decoder models with Llama-style attention (RoPE, GQA).

    import kvcomp, kvcomp.hf
    policy = kvcomp.Policy(scorer="keydiff", ratio=0.75)

    # one call: the context is prefilled and compressed, the question and the answer are not
    ids = kvcomp.hf.generate(model, context_ids, question_ids, policy, max_new_tokens=32)
    nll = kvcomp.hf.loss(model, context_ids, continuation_ids, policy)

    # model.generate and pipelines: every prompt is compressed after its prefill
    with kvcomp.hf.press(model, policy):
        out = model.generate(input_ids, max_new_tokens=32)

What happens: the prompt (context) is prefilled by the model as usual; its cache (post-RoPE keys
and values of every layer) goes through `kvcomp.compress` under the policy (or a real round trip
through kvcompd with `client=`); the kept keys and values, decoded (`kvcomp.decompress`), replace
the prompt's cache. Tokens after it (question, generated tokens) are cached uncompressed and
attend causally to each other and to the compressed prompt, their RoPE positions continuing from
the prompt's original length. With `correct=True` every kv head's evicted set enters each
softmax as the MomentKV virtual token (docs/moments.md): logit t q.mu_k + ln n, value
mu_v + t C q. AdaKV caches (heads keeping different counts) are padded per layer and masked.

The attention runs through transformers' AttentionInterface under the name "kvcomp" (registered
when this module is imported): prefill attention is transformers' SDPA; attention over a
compressed prompt is computed here in float32 (torch), on the model's device. The compressed
prompt's first continuation token comes from the prefill itself (full attention, as a serving
engine's prefill produces it); every later token reads the compressed cache.

Supported: model_type llama, mistral, qwen2 (no sliding-window layers), head_dim 64, 128 or 256,
one sequence at a time (batch 1). Anything else raises ValueError naming what is unsupported.
"""

from __future__ import annotations

import contextlib
import uuid
import weakref
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvcomp

__all__ = ["generate", "loss", "press", "KvcompCache", "Prefill", "prefill", "calibrate",
           "cache_from_prefill", "greedy", "greedy_matches", "continuation_nll",
           "prefix_attention", "check_model", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTN_NAME = "kvcomp"


# --- checks ---

def _config(model_or_config):
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def check_model(model_or_config) -> None:
    """Raises ValueError when kvcomp.hf cannot run this model, naming what is unsupported."""
    cfg = _config(model_or_config)
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"kvcomp.hf: model_type {mt!r} is not supported: it needs Llama-style attention "
            f"(RoPE and grouped-query attention over a per-layer KV cache); supported model "
            f"types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    layer_types = getattr(cfg, "layer_types", None) or []
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    sw = getattr(cfg, "sliding_window", None)
    if sliding or (sw is not None and getattr(cfg, "use_sliding_window", True)
                   and not layer_types):
        raise ValueError(
            f"kvcomp.hf: sliding-window attention layers are not supported (layers "
            f"{sliding or 'all'}, sliding_window={sw}): kvcomp compresses a full per-layer "
            f"cache; load the model with sliding_window=None (or use_sliding_window=False)")
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if hd not in (64, 128, 256):
        raise ValueError(f"kvcomp.hf: head_dim {hd} is not supported (64, 128 or 256)")
    hq, hk = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or \
        cfg.num_attention_heads
    if hq % hk:
        raise ValueError(f"kvcomp.hf: {hq} query heads are not a multiple of {hk} kv heads")


def _ids_1d(ids, what: str) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise ValueError(f"kvcomp.hf: {what} has batch size {t.shape[0]}: kvcomp.hf runs one "
                             f"sequence at a time (batch 1)")
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"kvcomp.hf: {what} must be 1-D token ids (or [1, n]), got shape "
                         f"{tuple(t.shape)}")
    return t


# --- the compressed prompt of one layer ---

class _Prefix:
    """One layer's compressed prompt on the model's device, float32.

    keys/values [Hk, N, d] (padded to the layer's largest head), bias [Hk, N] (0 kept, -inf
    padding); with moments: mu_k, mu_v [Hk, d], log_n [Hk] (-inf where nothing was evicted),
    cov [Hk, d, d] = S/n - mu_v mu_k^T.
    """

    def __init__(self, keys, values, bias, mu_k=None, mu_v=None, log_n=None, cov=None):
        self.keys, self.values, self.bias = keys, values, bias
        self.mu_k, self.mu_v, self.log_n, self.cov = mu_k, mu_v, log_n, cov


def _prefixes(cc, projection, device, backend) -> List[_Prefix]:
    """Decodes a CompressedCache into per-layer _Prefix objects (moments when it has them)."""
    L, H, d = cc.num_layers, cc.num_kv_heads, cc.head_dim
    k, v = kvcomp.decompress(cc, projection, backend=backend)
    out = []
    for l in range(L):
        kh = [np.asarray(k[l][h], np.float32) for h in range(H)]
        vh = [np.asarray(v[l][h], np.float32) for h in range(H)]
        n = max(x.shape[0] for x in kh)
        K = np.zeros((H, n, d), np.float32)
        V = np.zeros((H, n, d), np.float32)
        B = np.full((H, n), -np.inf, np.float32)
        for h in range(H):
            m = kh[h].shape[0]
            K[h, :m], V[h, :m], B[h, :m] = kh[h], vh[h], 0.0
        p = _Prefix(*(torch.from_numpy(a).to(device) for a in (K, V, B)))
        if cc.has_moments:
            mk, mv = np.zeros((H, d)), np.zeros((H, d))
            log_n = np.full(H, -np.inf)
            cov = np.zeros((H, d, d))
            for h in range(H):
                cnt, ks, vs, S = cc.moments(l, h)
                if cnt == 0:
                    continue
                mk[h] = np.asarray(ks, np.float64) / cnt
                mv[h] = np.asarray(vs, np.float64) / cnt
                log_n[h] = np.log(cnt)
                cov[h] = np.asarray(S, np.float64) / cnt - np.outer(mv[h], mk[h])
            p.mu_k, p.mu_v, p.log_n, p.cov = (torch.from_numpy(a.astype(np.float32)).to(device)
                                              for a in (mk, mv, log_n, cov))
        out.append(p)
    return out


def prefix_attention(query, prefix: _Prefix, new_keys, new_values, scaling: float,
                     correct: bool):
    """Attention of query [1, Hq, m, d] over a compressed prefix, its virtual tokens (when
    `correct` and it has moments) and new tokens [1, Hk, s, d] (s >= m; query i is new token
    s - m + i and sees new tokens up to itself). Returns [1, m, Hq, d] in the query's dtype."""
    _, hq, m, d = query.shape
    hk = prefix.keys.shape[0]
    g = hq // hk
    q = query[0].float().reshape(hk, g, m, d)
    parts = [torch.einsum("hgmd,hnd->hgmn", q, prefix.keys) * scaling
             + prefix.bias[:, None, None, :]]
    virt = correct and prefix.mu_k is not None
    if virt:
        lv = torch.einsum("hgmd,hd->hgm", q, prefix.mu_k) * scaling + prefix.log_n[:, None, None]
        parts.append(lv[..., None])
    s = 0
    if new_keys is not None and new_keys.shape[2] > 0:
        kn = new_keys[0].float()
        s = kn.shape[1]
        ln = torch.einsum("hgmd,hsd->hgms", q, kn) * scaling
        qi = torch.arange(m, device=q.device)[:, None] + (s - m)
        kj = torch.arange(s, device=q.device)[None, :]
        ln = ln.masked_fill(kj > qi, float("-inf"))
        parts.append(ln)
    logits = torch.cat(parts, dim=-1)
    p = torch.softmax(logits, dim=-1)
    n = prefix.keys.shape[1]
    out = torch.einsum("hgmn,hnd->hgmd", p[..., :n], prefix.values)
    o = n
    if virt:
        pv = p[..., o]
        o += 1
        cq = torch.einsum("hij,hgmj->hgmi", prefix.cov, q)
        out = out + pv[..., None] * (prefix.mu_v[:, None, None, :] + scaling * cq)
    if s:
        out = out + torch.einsum("hgms,hsd->hgmd", p[..., o:], new_values[0].float())
    return out.reshape(hq, m, d).transpose(0, 1)[None].to(query.dtype)


# --- the cache ---

class KvcompCache(DynamicCache):
    """A transformers Cache whose prompt is compressed by kvcomp after its prefill.

    The first forward pass (the prompt) is cached as is; at the start of the next forward (or
    when compress() is called) the whole prompt cache goes through kvcomp under `policy` and is
    replaced by the kept tokens (and moments). Later tokens are cached uncompressed. Needs the
    model's attention implementation to be "kvcomp" (press() and generate() set it).

    After compression: `compressed` (the kvcomp.CompressedCache), `original_length`,
    `stored_bytes`, `bytes_per_token` (stored bytes per prompt token).
    """

    def __init__(self, model_or_config, policy=None, *, correct: bool = True,
                 backend: str = "cpu", projection=None, client=None,
                 model_id: Optional[str] = None, cache_dtype: Optional[torch.dtype] = None):
        check_model(model_or_config)
        super().__init__()
        self._cfg = _config(model_or_config)
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
        self._pending: Dict[int, tuple] = {}
        self._queries: Dict[int, torch.Tensor] = {}
        self._returned: Dict[int, torch.Tensor] = {}
        self.prefixes: Optional[List[_Prefix]] = None
        self.compressed = None
        self.original_length = 0
        self.put_result = None
        self.stored_bytes = 0
        _ACTIVE_REFS.append(weakref.ref(self))

    # transformers' Cache API
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"kvcomp.hf: batch size {key_states.shape[0]}: kvcomp.hf compresses "
                             f"one sequence at a time (batch 1)")
        if self.prefixes is None and layer_idx == 0 and self._pending:
            self.compress()
        if self.prefixes is None:
            if layer_idx in self._pending:
                raise RuntimeError("kvcomp.hf: a layer was prefilled twice before compression")
            self._pending[layer_idx] = (key_states, value_states)
            self._returned[layer_idx] = key_states
            return key_states, value_states
        k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._returned[layer_idx] = k
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.prefixes is None:
            kv = self._pending.get(layer_idx)
            return 0 if kv is None else kv[0].shape[2]
        return self.original_length + super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.get_seq_length(layer_idx) + query_length, 0

    # kvcomp
    def _stacked(self):
        L = self._cfg.num_hidden_layers
        missing = [l for l in range(L) if l not in self._pending]
        if missing:
            raise RuntimeError(f"kvcomp.hf: layers {missing} were not prefilled")
        ks = torch.stack([self._pending[l][0][0] for l in range(L)])
        vs = torch.stack([self._pending[l][1][0] for l in range(L)])
        qs = None
        if self._queries:
            qs = torch.stack([self._queries[l] for l in range(L)])
        return ks, vs, qs

    def compress(self) -> "KvcompCache":
        """Compresses the prefilled prompt now (a no-op once done)."""
        if self.prefixes is not None:
            return self
        if not self._pending:
            raise RuntimeError("kvcomp.hf: nothing prefilled to compress")
        ks, vs, qs = self._stacked()
        device = ks.device
        hq = self._cfg.num_attention_heads
        self.original_length = ks.shape[2]
        if self.cache_dtype is not None:
            ks, vs = ks.to(self.cache_dtype), vs.to(self.cache_dtype)
            qs = qs.to(self.cache_dtype) if qs is not None else None
        ks, vs = ks.contiguous(), vs.contiguous()
        qs = qs.contiguous() if qs is not None else None
        if self.policy.scorer == "snapkv" and qs is None:
            raise RuntimeError("kvcomp.hf: snapkv needs the prompt's queries; the model's "
                               "attention implementation must be 'kvcomp' during the prefill")
        if self.client is not None:
            key = f"kvcomp-hf-{uuid.uuid4().hex}"
            hk, hv = ks.cpu(), vs.cpu()
            self.put_result = self.client.put(self.model_id, key, hk, hv, policy=self.policy,
                                              num_q_heads=hq)
            try:
                encoded = (self.policy.key_codec != "raw" or self.policy.value_codec != "none")
                self.compressed = self.client.get(self.model_id, key, decoded=encoded)
                self.stored_bytes = self.put_result["stored_bytes"]
            finally:
                self.client.delete(self.model_id, key)
            proj = None
        else:
            args = dict(num_q_heads=hq, projection=self.projection, queries=qs)
            if self.backend == "cuda":
                if device.type != "cuda":
                    ks, vs = ks.cuda(), vs.cuda()
                    qs = qs.cuda() if qs is not None else None
                torch.cuda.synchronize(ks.device)
                cc = kvcomp.compress(ks, vs, self.policy, backend="cuda", **args)
            else:
                cc = kvcomp.compress(*(_host(x) for x in (ks, vs)), self.policy,
                                     backend=self.backend, dtype=_dtype_hint(ks),
                                     **{**args, "queries": _host(qs)})
            self.compressed = cc
            self.stored_bytes = cc.nbytes
            proj = self.projection
        self.prefixes = _prefixes(self.compressed, proj, device,
                                  "cpu" if self.client is not None else self.backend)
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
        c.prefixes, c.compressed, c.original_length = self.prefixes, self.compressed, \
            self.original_length
        c.stored_bytes, c.put_result = self.stored_bytes, self.put_result
        return c

    @property
    def bytes_per_token(self) -> float:
        return self.stored_bytes / max(1, self.original_length)

    def bf16_bytes_per_token(self) -> int:
        c = self._cfg
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_hidden_layers * (c.num_key_value_heads or c.num_attention_heads) * hd * 2 * 2


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

def kvcomp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers attention function "kvcomp": SDPA while a KvcompCache is being prefilled
    (keeping SnapKV's window queries when the policy needs them), corrected attention over the
    compressed prompt afterwards, plain SDPA when no KvcompCache is in use."""
    cache = _ACTIVE.get(id(key))
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if cache is None or cache.prefixes is None:
        if cache is not None and cache.policy.scorer == "snapkv":
            w = min(cache.policy.snapkv_window, query.shape[2])
            cache._queries[module.layer_idx] = query[0, :, -w:].detach()
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    out = prefix_attention(query, cache.prefixes[module.layer_idx], key, value, scaling,
                           cache.correct)
    return out, None


_ACTIVE_REFS: "List[Any]" = []


class _Active:
    """Finds the KvcompCache whose update() returned a key tensor: the attention function
    receives only the tensors, and a cache is found by the identity of what it returned."""

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

# --- prefill, generate, loss ---

@contextlib.contextmanager
def _attention_impl(model, name=ATTN_NAME):
    old = model.config._attn_implementation
    if old != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if old != name:
            model.set_attn_implementation(old)


class Prefill:
    """A prompt's prefill, kept so several policies can compress the same prompt:
    keys/values [layers, kv_heads, tokens, head_dim], queries [layers, q_heads, w, head_dim]
    (SnapKV's window, the last w prompt tokens), the last position's logits."""

    def __init__(self, keys, values, queries, last_logits):
        self.keys, self.values, self.queries, self.last_logits = keys, values, queries, last_logits

    @property
    def length(self):
        return self.keys.shape[2]


@torch.no_grad()
def prefill(model, context_ids, *, snapkv_window: int = 64) -> Prefill:
    """Runs the model over the context once and keeps its cache (see Prefill)."""
    check_model(model)
    ids = _ids_1d(context_ids, "context_ids").to(model.device)
    cache = KvcompCache(model, kvcomp.Policy(scorer="snapkv", snapkv_window=snapkv_window))
    with _attention_impl(model):
        out = model(ids[None], past_key_values=cache, use_cache=True)
    ks, vs, qs = cache._stacked()
    return Prefill(ks, vs, qs, out.logits[0, -1].float())


def cache_from_prefill(model, pre: Prefill, policy, *, correct=True, backend="cpu",
                       projection=None, client=None, model_id=None,
                       cache_dtype=None) -> KvcompCache:
    """A compressed KvcompCache of a Prefill under `policy` (the prefill is not modified)."""
    c = KvcompCache(model, policy, correct=correct, backend=backend, projection=projection,
                    client=client, model_id=model_id, cache_dtype=cache_dtype)
    L = pre.keys.shape[0]
    for l in range(L):
        c._pending[l] = (pre.keys[l][None], pre.values[l][None])
        if policy.scorer == "snapkv":
            w = min(policy.snapkv_window, pre.queries.shape[2])
            c._queries[l] = pre.queries[l, :, -w:]
    return c.compress()


@torch.no_grad()
def greedy(model, cache: KvcompCache, first_logits, question_ids, max_new_tokens: int):
    """Greedy continuation over a compressed cache: feeds question_ids (may be empty; then the
    first token comes from first_logits), then generated tokens. Returns 1-D LongTensor."""
    q = _ids_1d(question_ids, "question_ids").to(model.device)
    logits = first_logits
    out: List[int] = []
    with _attention_impl(model):
        if q.numel():
            logits = model(q[None], past_key_values=cache, use_cache=True).logits[0, -1]
        for i in range(max_new_tokens):
            t = int(torch.argmax(logits))
            out.append(t)
            if i + 1 == max_new_tokens:
                break
            logits = model(torch.tensor([[t]], device=model.device), past_key_values=cache,
                           use_cache=True).logits[0, -1]
    return torch.tensor(out, dtype=torch.long)


@torch.no_grad()
def greedy_matches(model, cache: KvcompCache, first_logits, question_ids,
                   target_ids) -> bool:
    """Whether greedy decoding after question_ids produces target_ids, in one forward pass
    (question + target[:-1], teacher-forced): greedy reproduces the target exactly when every
    position's argmax is the next target token. Same answer as greedy() == target."""
    q = _ids_1d(question_ids, "question_ids").to(model.device)
    t = _ids_1d(target_ids, "target_ids").to(model.device)
    ids = torch.cat([q, t[:-1]])
    logits = [first_logits[None]] if q.numel() == 0 else []
    if ids.numel():
        with _attention_impl(model):
            lg = model(ids[None], past_key_values=cache, use_cache=True).logits[0]
        logits.append(lg[max(0, q.numel() - 1):])
    pred = torch.cat(logits)[: t.numel()].argmax(-1)
    return bool(torch.equal(pred, t))


@torch.no_grad()
def continuation_nll(model, cache: KvcompCache, first_logits, continuation_ids) -> torch.Tensor:
    """Per-token NLL (nats) of continuation_ids after a compressed cache: token 0 from
    first_logits (the prefill's), the others from one forward pass over the continuation."""
    c = _ids_1d(continuation_ids, "continuation_ids").to(model.device)
    if c.numel() == 0:
        raise ValueError("kvcomp.hf: empty continuation")
    logits = [first_logits.float()[None]]
    if c.numel() > 1:
        with _attention_impl(model):
            logits.append(model(c[None, :-1], past_key_values=cache,
                                use_cache=True).logits[0].float())
    lg = torch.cat(logits)
    return torch.nn.functional.cross_entropy(lg, c, reduction="none")


def generate(model, context_ids, question_ids, policy=None, *, max_new_tokens: int,
             correct: bool = True, backend: str = "cpu", client=None, projection=None,
             model_id: Optional[str] = None, cache_dtype=None) -> torch.Tensor:
    """Greedy continuation ids (1-D LongTensor) of question_ids after the compressed context.

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
    """Mean next-token NLL (nats) over continuation_ids given the compressed context."""
    pol = policy or kvcomp.Policy()
    pre = prefill(model, context_ids, snapkv_window=pol.snapkv_window)
    cache = cache_from_prefill(model, pre, pol, correct=correct, backend=backend,
                               projection=projection, client=client, model_id=model_id,
                               cache_dtype=cache_dtype)
    return float(continuation_nll(model, cache, pre.last_logits, continuation_ids).mean())


@torch.no_grad()
def calibrate(model, texts: Sequence[Any], *, cache_dtype=None, **kwargs):
    """A KVSplice projection (kvcomp.calibrate) from the value caches of `texts` (token id
    sequences; use text other than what will be compressed). kwargs go to kvcomp.calibrate
    (rank, error_budget, codec, metric, ...)."""
    vals, keys = [], []
    for t in texts:
        pre = prefill(model, t)
        v, k = pre.values, pre.keys
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
    Batch 1 only.
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

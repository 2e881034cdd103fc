"""kvcomp.hf on tiny random-weight transformers models of each architecture it supports, built
from configs here with each architecture's head dims (nothing downloaded): at ratio 0 with raw
codecs generation equals transformers' own, token for token, one sequence and a batch of
prompts of different lengths; with eviction it runs. On CUDA (model and kvcomp backend) where a
GPU is present, else on CPU."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvcomp  # noqa: E402
import kvcomp.hf as hf  # noqa: E402
from kvcompd_fixture import Kvcompd, built_kvcompd  # noqa: E402

CUDA = torch.cuda.is_available() and kvcomp.cuda_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "cuda" if CUDA else "cpu"
T = transformers
SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             pad_token_id=0, bos_token_id=1, eos_token_id=None)


def _llama():
    return T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=128))


def _mistral():  # every layer a 16-token sliding window
    return T.MistralForCausalLM(T.MistralConfig(**SMALL, num_attention_heads=4,
                                                num_key_value_heads=1, head_dim=128,
                                                sliding_window=16))


def _qwen2():
    return T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, num_attention_heads=4,
                                            num_key_value_heads=2))


def _qwen3():  # q/k norms before RoPE
    return T.Qwen3ForCausalLM(T.Qwen3Config(**SMALL, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=128))


def _olmo2():  # q/k norms over the whole projection; head_dim 128 = hidden / heads
    return T.Olmo2ForCausalLM(T.Olmo2Config(**{**SMALL, "hidden_size": 256},
                                            num_attention_heads=2, num_key_value_heads=2))


def _phi3():  # fused QKV, head_dim 96 = hidden / heads
    return T.Phi3ForCausalLM(T.Phi3Config(**{**SMALL, "hidden_size": 192},
                                          num_attention_heads=2, num_key_value_heads=2))


def _gemma3():  # head_dim 256, a local (16-token window) and a global layer
    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**SMALL, num_attention_heads=2,
                                                  num_key_value_heads=1, head_dim=256,
                                                  sliding_window=16,
                                                  layer_types=["sliding_attention",
                                                               "full_attention"]))


def _gpt_oss():  # alternating 16-token windows and full layers, attention sinks, MoE
    return T.GptOssForCausalLM(T.GptOssConfig(**{**SMALL, "intermediate_size": 128},
                                              num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=64, sliding_window=16,
                                              num_local_experts=4, num_experts_per_tok=2))


def _deepseek_v3():  # MLA: nope 128 + rope 64 keys, 128 values per head; a 256-wide latent
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **SMALL, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1))


def _qwen3_next():  # hybrid: 3 gated-delta-net (linear attention) layers, 1 attention layer
    return T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        **{**SMALL, "num_hidden_layers": 4}, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4,
        num_experts_per_tok=2))


ARCHS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
         "olmo2": _olmo2, "phi3": _phi3, "gemma3": _gemma3, "gpt_oss": _gpt_oss,
         "deepseek_v3": _deepseek_v3, "qwen3_next": _qwen3_next}
_MODELS = {}


def model_of(name):
    if name not in _MODELS:
        torch.manual_seed(0)
        _MODELS[name] = ARCHS[name]().eval().to(DEVICE)
    return _MODELS[name]


def ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g)


RAW0 = kvcomp.Policy(ratio=0.0, moments=False)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # the models are tiny: one intra-op thread is fastest, and far faster on a shared machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(ARCHS))
def test_ratio_zero_is_transformers_generate(name):
    m = model_of(name)
    ctx, q = ids(40, 1), ids(5, 2)
    full = torch.cat([ctx, q])[None].to(DEVICE)
    want = m.generate(full, max_new_tokens=8, do_sample=False)[0, full.shape[1]:]
    got = hf.generate(m, ctx, q, RAW0, max_new_tokens=8, backend=BACKEND)
    assert got.tolist() == want.cpu().tolist()
    with hf.press(m, RAW0, backend=BACKEND) as p:
        out = m.generate(full, max_new_tokens=8, do_sample=False)
    assert out[0, full.shape[1]:].tolist() == want.tolist()
    assert p.last_cache.original_length == full.shape[1]
    assert m.config._attn_implementation != "kvcomp"


@pytest.mark.parametrize("name", list(ARCHS))
def test_ratio_zero_logits_are_transformers(name):
    # random tiny models repeat tokens; the logits over a continuation say more: after a
    # ratio-0 compressed prompt they are the full forward's, position by position
    m = model_of(name)
    w = ids(56, 4)
    with torch.no_grad():
        full = m(w[None].to(DEVICE)).logits[0].float()
    pre = hf.prefill(m, w[:40])
    cache = hf.cache_from_prefill(m, pre, RAW0, backend=BACKEND)
    with torch.no_grad(), hf._attention_impl(m):
        got = m(w[None, 40:].to(DEVICE), past_key_values=cache, use_cache=True).logits[0]
    scale = full.abs().max().item()
    assert (got.float() - full[40:]).abs().max().item() <= 1e-4 * max(1.0, scale)
    assert (pre.last_logits[0] - full[39]).abs().max().item() <= 1e-4 * max(1.0, scale)


@pytest.mark.parametrize("name", list(ARCHS))
def test_batch_of_different_lengths_is_transformers_generate(name):
    m = model_of(name)
    ctxs, q = [ids(n, 10 + n) for n in (40, 23, 31)], ids(4, 3)
    padded, mask = hf._left_pad([torch.cat([c, q]) for c in ctxs])
    want = m.generate(padded.to(DEVICE), attention_mask=mask.long().to(DEVICE),
                      max_new_tokens=6, do_sample=False)[:, padded.shape[1]:]
    got = hf.generate(m, ctxs, [q] * 3, RAW0, max_new_tokens=6, backend=BACKEND)
    assert got.shape == (3, 6)
    assert got.tolist() == want.cpu().tolist()
    with hf.press(m, RAW0, backend=BACKEND):  # model.generate's own left-padded batch
        out = m.generate(padded.to(DEVICE), attention_mask=mask.long().to(DEVICE),
                         max_new_tokens=6, do_sample=False)[:, padded.shape[1]:]
    assert out.tolist() == want.tolist()
    # questions of different lengths: padding between each context and its question
    qs = [ids(n, 20 + n) for n in (2, 5, 0)]
    got = hf.generate(m, ctxs, qs, RAW0, max_new_tokens=4, backend=BACKEND)
    for b in range(3):
        one = torch.cat([ctxs[b], qs[b]])[None].to(DEVICE)
        alone = m.generate(one, max_new_tokens=4, do_sample=False)[0, one.shape[1]:]
        assert got[b].tolist() == alone.cpu().tolist(), b


EVICT = [kvcomp.Policy(scorer="keydiff", ratio=0.5, moments=True),
         kvcomp.Policy(scorer="knorm", ratio=0.75, head_budget="adakv", key_codec="int8")]


@pytest.mark.parametrize("name", list(ARCHS))
def test_eviction_runs(name):
    m = model_of(name)
    ctxs, q = [ids(48, 5), ids(30, 6)], ids(4, 7)
    for pol in EVICT:
        for correct in (True, False):
            out = hf.generate(m, ctxs, [q, q], pol, max_new_tokens=4, correct=correct,
                              backend=BACKEND)
            assert out.shape == (2, 4) and 0 <= int(out.min()) and int(out.max()) < 256
        pre = hf.prefill(m, ctxs[0])
        cache = hf.cache_from_prefill(m, pre, pol, backend=BACKEND)
        kinds = hf.layer_kinds(m)
        full = cache.caches[0]["full"]
        if "full" in kinds:
            kept = pol.kept_per_head(48)
            assert sum(full.kept) == kept * len(full.kept)
        parts = [c for c in cache.caches[0].values() if c is not None]
        assert cache.stored_bytes == sum(c.nbytes for c in parts)
        if "full" not in kinds:
            assert full is None
        if "window" in kinds:  # a window layer keeps its window, every token of it
            win = cache.caches[0]["window"]
            assert win.original_tokens == m.config.sliding_window
            assert win.kept == [m.config.sliding_window] * len(win.kept)
        nll = hf.loss(m, ctxs[0], ids(6, 8), pol, backend=BACKEND)
        assert np.isfinite(nll)


def test_head_dims_are_padded_to_the_kernels():
    # Phi-3's 96 is stored as 128 channels; DeepSeek-V3's latent (256) and its RoPE part (64)
    # as 256; decoding drops the padding again.
    for name, dk, dv, stored in (("phi3", 96, 96, 128), ("deepseek_v3", 256, 64, 256),
                                 ("gemma3", 256, 256, 256)):
        m = model_of(name)
        assert hf.head_dims(m) == (dk, dv)
        cache = hf.cache_from_prefill(m, hf.prefill(m, ids(20, 9)), RAW0, backend=BACKEND)
        part = cache.caches[0]["full"]
        assert part.head_dim == stored
        layer = next(l for l, k in enumerate(hf.layer_kinds(m)) if k == "full")
        p = cache.prefixes[layer]
        assert p.keys.shape[-1] == dk and p.values.shape[-1] == dv
    assert hf.layer_kinds(model_of("deepseek_v3")) == ["full", "full"]
    assert model_of("deepseek_v3").model.layers[0].self_attn.kv_b_proj is not None


def test_mla_latent_of_deepseek_v3s_width():
    # DeepSeek-V3's own latent: 512 + 64 channels, wider than the kernels' 256: stored as nine
    # 64-channel pieces (five pseudo-heads), which streaming eviction keeps together
    torch.manual_seed(0)
    m = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **SMALL, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1)).eval().to(DEVICE)
    assert hf.head_dims(m) == (512, 64)
    ctx, q = ids(40, 31), ids(5, 32)
    full = torch.cat([ctx, q])[None].to(DEVICE)
    want = m.generate(full, max_new_tokens=8, do_sample=False)[0, full.shape[1]:]
    assert hf.generate(m, ctx, q, RAW0, max_new_tokens=8,
                       backend=BACKEND).tolist() == want.cpu().tolist()
    ctxs = [ids(n, 40 + n) for n in (40, 27)]
    padded, mask = hf._left_pad([torch.cat([c, q]) for c in ctxs])
    want = m.generate(padded.to(DEVICE), attention_mask=mask.long().to(DEVICE),
                      max_new_tokens=5, do_sample=False)[:, padded.shape[1]:]
    got = hf.generate(m, ctxs, [q, q], RAW0, max_new_tokens=5, backend=BACKEND)
    assert got.tolist() == want.cpu().tolist()
    pol = kvcomp.Policy(scorer="streaming", ratio=0.5, key_codec="int8")
    pre = hf.prefill(m, ctx)
    cache = hf.cache_from_prefill(m, pre, pol, backend=BACKEND)
    part = cache.caches[0]["full"]
    assert (part.num_kv_heads, part.head_dim) == (5, 64)
    assert part.kept == [pol.kept_per_head(40)] * 10
    p = cache.prefixes[0]
    assert p.keys.shape == (1, 1, pol.kept_per_head(40), 512) and p.values.shape[-1] == 64
    assert hf.greedy(m, cache, pre.last_logits, q, 4).shape == (4,)


def test_linear_attention_state_is_kept_exactly():
    m = model_of("qwen3_next")
    assert hf.layer_kinds(m) == ["linear", "linear", "linear", "full"]
    pre = hf.prefill(m, ids(30, 11))
    a = hf.cache_from_prefill(m, pre, kvcomp.Policy(scorer="keydiff", ratio=0.5),
                              backend=BACKEND)
    b = a.fork()
    for l in (0, 1, 2):
        for got, want in ((a.layers[l], pre.linear_state[l]), (b.layers[l], a.linear_state[l])):
            assert torch.equal(got.conv_states[0], want.conv_states[0])
            assert torch.equal(got.recurrent_states[0], want.recurrent_states[0])
            assert got.conv_states[0] is not want.conv_states[0]  # copies: decode mutates
    first = hf.greedy(m, a, pre.last_logits, ids(3, 12), 4)
    again = hf.greedy(m, b, pre.last_logits, ids(3, 12), 4)
    assert first.tolist() == again.tolist()  # the fork starts from the untouched state
    # under press, the state is kept before the first decode step changes it
    with hf.press(m, kvcomp.Policy(scorer="keydiff", ratio=0.5), backend=BACKEND) as p:
        m.generate(ids(30, 11)[None].to(DEVICE), max_new_tokens=3, do_sample=False)
    for l in (0, 1, 2):
        assert torch.equal(p.last_cache.linear_state[l].recurrent_states[0],
                           pre.linear_state[l].recurrent_states[0])


@pytest.mark.skipif(built_kvcompd() is None, reason="kvcompd not built")
def test_hybrid_through_kvcompd_restores_the_linear_state_exactly():
    m = model_of("qwen3_next")
    ctx, q = ids(40, 1), ids(5, 2)
    full = torch.cat([ctx, q])[None].to(DEVICE)
    want = m.generate(full, max_new_tokens=6, do_sample=False)[0, full.shape[1]:]
    try:
        with Kvcompd(built_kvcompd()) as d:
            client = kvcomp.Client(f"{d.data_endpoint},127.0.0.1:{d.control_port}",
                                   timeout=60.0)
            got = hf.generate(m, ctx, q, RAW0, max_new_tokens=6, client=client,
                              model_id="test/hybrid")
            assert got.tolist() == want.cpu().tolist()
            pre = hf.prefill(m, ctx)
            cache = hf.cache_from_prefill(m, pre, kvcomp.Policy(scorer="knorm", ratio=0.5),
                                          client=client, model_id="test/hybrid")
            for l in (0, 1, 2):  # what came back from kvcompd is the prefill's state
                for attr in ("conv_states", "recurrent_states"):
                    got_t = getattr(cache.layers[l], attr)[0]
                    assert torch.equal(got_t, getattr(pre.linear_state[l], attr)[0])
            assert cache.stored_bytes > cache.compressed.nbytes  # the state is stored too
            assert d.metrics()["kvcomp_caches_stored"] == 0.0  # and deleted after the trip
    except NotImplementedError:  # a core-only build has no client
        pytest.skip("this kvcomp build has no client")


def test_sinks_enter_the_softmax():
    m = model_of("gpt_oss")
    pre = hf.prefill(m, ids(24, 13))
    cache = hf.cache_from_prefill(m, pre, RAW0, backend=BACKEND)
    p = cache.prefixes[1]
    q = torch.randn(1, 4, 1, 64, device=DEVICE)
    sinks = m.model.layers[1].self_attn.sinks.detach()
    with_s = hf.prefix_attention(q, p, None, None, 0.125, False, sinks=sinks)
    no_s = hf.prefix_attention(q, p, None, None, 0.125, False)
    # a sink takes exp(s) of the denominator and adds no value: the output shrinks by the
    # share the kept tokens have left
    k = p.keys.repeat_interleave(2, dim=1)
    lg = torch.einsum("bhmd,bhnd->bhmn", q.float(), k) * 0.125
    z = torch.logsumexp(lg, -1)
    share = torch.sigmoid(z - sinks.float()[None, :, None])
    torch.testing.assert_close(with_s, no_s * share.transpose(1, 2)[..., None], rtol=1e-4,
                               atol=1e-5)


def test_unsupported_models_fail_clearly():
    big = T.LlamaConfig(**SMALL, num_attention_heads=2, num_key_value_heads=1, head_dim=320)
    with pytest.raises(ValueError, match="head_dim 320"):
        hf.check_model(big)
    mla = T.DeepseekV3Config(**SMALL, kv_lora_rank=512, qk_rope_head_dim=64)
    hf.check_model(mla)  # a latent wider than 256 is stored in pieces...
    with pytest.raises(ValueError, match="position-based eviction"):  # ...kept together
        hf.KvcompCache(mla, kvcomp.Policy(scorer="keydiff", ratio=0.5))
    chunked = copy.deepcopy(T.LlamaConfig(**SMALL, num_attention_heads=2))
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        hf.check_model(chunked)
    with pytest.raises(ValueError, match="snapkv"):
        hf.KvcompCache(model_of("deepseek_v3"), kvcomp.Policy(scorer="snapkv"))
    m = model_of("llama")
    with pytest.raises(ValueError, match="2 questions for a batch of 3"):
        hf.generate(m, [ids(5, 1), ids(6, 1), ids(7, 1)], [ids(2, 1), ids(2, 1)], RAW0,
                    max_new_tokens=2)
    with pytest.raises(ValueError, match="batch 1"):
        hf.loss(m, torch.stack([ids(8, 1), ids(8, 2)]), ids(4, 3), RAW0)

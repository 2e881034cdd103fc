"""kvcomp's MomentKV Python API: CompressedCache.moments and kvcomp.attention,
checked against the NumPy reference of bench/quality, plus a smoke run of the quality harness."""

import os
import subprocess
import sys

import numpy as np
import pytest

import kvcomp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench", "quality"))

import generator  # noqa: E402
import reference  # noqa: E402


def _layer(tokens=1500, heads=2, seed=0):
    p = generator.GeneratorParams(num_kv_heads=heads, head_dim=64, generic_queries=3)
    return generator.generate_layer(p, tokens, seed)


@pytest.mark.parametrize("scorer", ["knorm", "manifold", "streaming"])
def test_moments_match_reference(scorer):
    L = _layer()
    c = kvcomp.compress(L.keys, L.values,
                        kvcomp.Policy(scorer=scorer, ratio=0.6, recent_fraction=0.0,
                                      moments=True),
                        num_q_heads=4)
    ref = reference.compress_layer(L.keys, L.values, scorer, 0.6)
    assert c.has_moments
    for h in range(2):
        assert np.array_equal(c.kept_positions(0, h), ref.kept[h])
        n, ks, vs, s = c.moments(0, h)
        m = ref.moments[h]
        assert n == m.count == 1500 - c.kept[h]
        assert ks.shape == (64,) and s.shape == (64, 64) and s.dtype == np.float32
        np.testing.assert_allclose(ks, m.key_sum, rtol=1e-5, atol=1e-2)
        np.testing.assert_allclose(vs, m.value_sum, rtol=1e-5, atol=1e-2)
        np.testing.assert_allclose(s, m.vk_sum, rtol=1e-4, atol=1e-2)


def test_moments_are_those_of_the_evicted_tokens():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 300, 64)).astype(np.float32)
    v = rng.standard_normal((1, 300, 64)).astype(np.float32)
    c = kvcomp.compress(k, v, kvcomp.Policy(scorer="random", ratio=0.5, moments=True))
    kept = c.kept_positions(0, 0)
    ev = np.setdiff1d(np.arange(300), kept)
    n, ks, vs, s = c.moments(0, 0)
    assert n == len(ev)
    np.testing.assert_allclose(ks, k[0, ev].sum(0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(s, v[0, ev].T.astype(np.float64) @ k[0, ev], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("correct", [True, False])
def test_attention_matches_reference(correct):
    L = _layer(seed=2)
    c = kvcomp.compress(L.keys, L.values,
                        kvcomp.Policy(moments=True, scorer="keydiff", ratio=0.8,
                                      recent_fraction=0.0),
                        num_q_heads=4)
    ref = reference.compress_layer(L.keys, L.values, "keydiff", 0.8)
    out = kvcomp.attention(L.queries, c, 0, correct=correct)
    assert out.shape == L.queries.shape and out.dtype == np.float32
    want = reference.layer_attention(L.queries, L.keys, L.values, ref, correct)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_all_kept_is_exact_attention_and_correction_helps():
    L = _layer(seed=3)
    full = reference.layer_attention(L.queries, L.keys, L.values, None, False)
    c = kvcomp.compress(L.keys, L.values, kvcomp.Policy(ratio=0.0), num_q_heads=4)
    np.testing.assert_allclose(kvcomp.attention(L.queries, c, 0), full, rtol=1e-4, atol=1e-5)
    c = kvcomp.compress(L.keys, L.values, kvcomp.Policy(moments=True, scorer="manifold", ratio=0.7),
                        num_q_heads=4)
    err = {corr: np.linalg.norm(kvcomp.attention(L.queries, c, 0, correct=corr) - full)
           for corr in (True, False)}
    assert err[True] < err[False]


def test_bad_input():
    L = _layer(tokens=200)
    c = kvcomp.compress(L.keys, L.values, kvcomp.Policy(moments=True, ratio=0.5), num_q_heads=4)
    with pytest.raises(IndexError):
        c.moments(1, 0)
    with pytest.raises(IndexError):
        c.moments(0, 5)
    with pytest.raises(ValueError):  # 3 query heads for a 4-q-head layout
        kvcomp.attention(L.queries[:3], c, 0)
    with pytest.raises(ValueError):  # wrong head_dim
        kvcomp.attention(np.zeros((4, 1, 32), np.float32), c, 0)
    with pytest.raises(IndexError):
        kvcomp.attention(L.queries, c, 2)
    c = kvcomp.compress(L.keys, L.values, kvcomp.Policy(ratio=0.5, moments=False), num_q_heads=4)
    with pytest.raises(ValueError):
        c.moments(0, 0)
    # No summary: attention is plain attention over the kept tokens either way.
    np.testing.assert_allclose(kvcomp.attention(L.queries, c, 0, correct=True),
                               kvcomp.attention(L.queries, c, 0, correct=False))


@pytest.mark.skipif(not kvcomp.cuda_available(), reason="no CUDA device")
def test_cuda_attention_matches_cpu():
    L = _layer(seed=4)
    c = kvcomp.compress(L.keys, L.values, kvcomp.Policy(moments=True, ratio=0.5), num_q_heads=4)
    np.testing.assert_allclose(kvcomp.attention(L.queries, c, 0, backend="cuda"),
                               kvcomp.attention(L.queries, c, 0), rtol=1e-4, atol=1e-4)


def test_quality_harness_smoke():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "quality", "run_quality.py"),
                        "--smoke", "--scorers", "knorm,manifold", "--engine", "kvcomp"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python")))
    assert r.returncode == 0, r.stderr
    assert "engine: kvcomp" in r.stdout and "'needle_retention'" in r.stdout


@pytest.mark.parametrize("scorer", ["knorm", "keydiff", "streaming"])
def test_moment_aware_matches_reference_rule(scorer):
    L = _layer(tokens=2000, seed=5)
    c = kvcomp.compress(L.keys, L.values,
                        kvcomp.Policy(moments=True, scorer=scorer, ratio=0.7, moment_aware=True,
                                      recent_fraction=0.0), num_q_heads=4)
    ref = reference.compress_layer(L.keys, L.values, scorer, 0.7, moment_aware=True)
    for h in range(2):
        got, want = set(c.kept_positions(0, h).tolist()), set(ref.kept[h].tolist())
        assert len(got) == len(want)
        assert len(got & want) >= 0.99 * len(want)  # float32 vs float64 near-ties only
        n, ks, _, _ = c.moments(0, h)
        assert n == 2000 - len(got)


def _attention_over(q, keys, values, c, correct):
    """Float64 attention of q [Hq, nq, d] over kept keys/values [Hk][n, d] of layer 0 of c,
    with each kv head's virtual token when `correct`."""
    hq, nq, d = q.shape
    hk = len(keys)
    t = 1.0 / np.sqrt(d)
    out = np.zeros(q.shape)
    for g in range(hq):
        h = g // (hq // hk)
        n, ks, vs, s = c.moments(0, h)
        for i in range(nq):
            qq = q[g, i].astype(np.float64)
            logits = list(t * (np.asarray(keys[h], np.float64) @ qq))
            vals = list(np.asarray(values[h], np.float64))
            if correct and n > 0:
                mk, mv = ks / n, vs / n
                cov = s.astype(np.float64) / n - np.outer(mv, mk)
                logits.append(t * qq @ mk + np.log(n))
                vals.append(mv + t * cov @ qq)
            w = np.exp(np.array(logits) - max(logits))
            out[g, i] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("codec", ["orthogonal", "orthogonal_int8", "orthogonal_int4"])
def test_attention_over_kvsplice_cache(codec):
    L = _layer(seed=int(np.random.default_rng().integers(1 << 30)))
    proj = kvcomp.calibrate(L.values[None], rank=32, codec=codec)
    c = kvcomp.compress(L.keys, L.values,
                        kvcomp.Policy(moments=True, scorer="keydiff", ratio=0.5, value_codec=codec,
                                      rank=32),
                        num_q_heads=4, projection=proj)
    assert kvcomp.cache_codecs(c)["value_codec"] == codec
    k, v = kvcomp.decompress(c, proj)
    for correct in (True, False):
        want = _attention_over(L.queries, k[0], v[0], c, correct)
        for fused in (False, True):
            out = kvcomp.attention(L.queries, c, 0, correct=correct, projection=proj,
                                   expand_in_attention=fused)
            # The kernel expands the values in its own f32 summation order: on outputs of
            # order 1 that leaves up to about 2e-5 absolute on the small ones (worst over 300
            # seeds x 3 codecs: 1.8e-5 beyond rtol), which atol 1e-5 let through in 1 run of 40.
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=5e-5)
    with pytest.raises(ValueError, match="projection"):
        kvcomp.attention(L.queries, c, 0)
    other = kvcomp.calibrate(L.values[None] * 2.0 + 1.0, rank=32, codec=codec)
    with pytest.raises(KeyError):
        kvcomp.attention(L.queries, c, 0, projection=other)


@pytest.mark.skipif(not kvcomp.cuda_available(), reason="no CUDA device")
def test_cuda_attention_over_kvsplice_cache():
    # The two decode-first paths differ by design: the device expands the latents on tensor
    # cores with f16 operands (the expand matrix diag(gamma) P and the dequantized codes rounded
    # to f16, f32 sums: kernels/decode/src/dense_decode_cuda.cu), the CPU in f32. Each operand's
    # rounding is up to 2^-11 relative, so the outputs agree to 5e-3 of their largest magnitude,
    # the bound of the C++ GPU test (DecodeAttentionCudaTest.EncodedCacheMatchesCpu); not to
    # 1e-4 per element. The latent path (expand_in_attention) applies the expand matrix in f32
    # on both backends: the device matches its CPU twin to 5e-4 of the largest magnitude
    # (LatentAttentionMatchesCpu's bound), and the CPU's decode-first path to the f16 bound.
    L = _layer(seed=3)
    proj = kvcomp.calibrate(L.values[None], rank=32)
    c = kvcomp.compress(L.keys, L.values,
                        kvcomp.Policy(moments=True, ratio=0.5, value_codec="orthogonal_int8"),
                        num_q_heads=4, projection=proj)

    def worst(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-6))

    cpu_first = np.asarray(kvcomp.attention(L.queries, c, 0, projection=proj), np.float64)
    cpu_latent = np.asarray(kvcomp.attention(L.queries, c, 0, projection=proj,
                                             expand_in_attention=True), np.float64)
    gpu_first = kvcomp.attention(L.queries, c, 0, backend="cuda", projection=proj)
    gpu_latent = kvcomp.attention(L.queries, c, 0, backend="cuda", projection=proj,
                                  expand_in_attention=True)
    assert np.all(np.isfinite(gpu_first)) and np.all(np.isfinite(gpu_latent))
    w = (worst(gpu_first, cpu_first), worst(gpu_latent, cpu_latent), worst(gpu_latent, cpu_first))
    assert w[0] < 5e-3 and w[1] < 5e-4 and w[2] < 5e-3, w

"""Named policy presets, moments only where tokens are evicted, and the warning of a policy whose
stored cache is larger than its input (docs/research.md, "Presets")."""

import time
import warnings

import numpy as np
import pytest

import kvcomp


def _cache(tokens, layers=2, heads=2, d=128, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((layers, heads, tokens, d)).astype(np.float32)
    v = rng.standard_normal((layers, heads, tokens, d)).astype(np.float32)
    return k, v


def test_presets_name_their_policies():
    assert set(kvcomp.PRESETS) == {"lossless", "codec", "balanced", "default"}
    p = kvcomp.preset("lossless")
    assert (p.ratio, p.moments, p.key_codec, p.value_codec) == (0.0, False, "raw", "none")
    p = kvcomp.preset("codec")
    assert (p.ratio, p.moments, p.key_codec, p.value_codec) == (0.0, False, "pq", "pq")
    assert (p.key_bits, p.value_bits) == (3, 2)
    p = kvcomp.preset("balanced")
    assert (p.scorer, p.ratio, p.recent_fraction, p.moments) == ("manifold", 0.33, 0.85, False)
    assert (p.key_codec, p.value_codec) == ("hq4", "hq3")
    d, q = kvcomp.preset("default"), kvcomp.Policy()
    assert (d.scorer, d.ratio, d.moments, d.key_codec) == (q.scorer, q.ratio, q.moments,
                                                           q.key_codec)
    assert kvcomp.preset("balanced", ratio=0.75).ratio == 0.75
    with pytest.raises(ValueError, match="lossless"):
        kvcomp.preset("fastest")


def test_the_codec_preset_needs_its_calibration_and_balanced_none():
    k, v = _cache(256)
    full = 2 * k.nbytes  # f32 here: 2x the bf16 figures of docs/research.md
    # the codec preset (pq k3v2) without a calibration: an error naming the call, never
    # other codecs in its place
    with pytest.raises(RuntimeError, match="calibrate_pq"):
        kvcomp.compress(k, v, kvcomp.preset("codec"))
    cal = kvcomp.calibrate_pq(*_cache(512, seed=1))
    c = kvcomp.compress(k, v, kvcomp.preset("codec"), pq=cal)
    assert kvcomp.cache_codecs(c)["value_codec"] == "pq"
    assert 2 * 6.4 * 0.9 < full / c.nbytes < 2 * 6.4  # 6.4x of bf16, headers aside
    dk, dv = kvcomp.decompress(c, pq=cal)
    rel = np.linalg.norm(dv - v) / np.linalg.norm(v)
    assert 0.3 < rel < 0.6  # 2-bit values of white noise (no spectrum to exploit): lossy
    # the device codec's pin (hq4 / hq3) still needs nothing
    h = kvcomp.compress(k, v, kvcomp.preset("codec", key_codec="hq4", value_codec="hq3"))
    assert 2 * 4.27 * 0.95 < full / h.nbytes < 2 * 4.27
    b = kvcomp.compress(k, v, kvcomp.preset("balanced"))
    assert b.nbytes < h.nbytes * 0.75 and not b.has_moments  # two thirds of the tokens kept


def test_lossless_preset_round_trips_exactly():
    k, v = _cache(64)
    c = kvcomp.compress(k, v, kvcomp.preset("lossless"))
    assert not c.has_moments
    assert c.nbytes <= c.original_nbytes * 1.05
    for layer in range(2):
        for head in range(2):
            np.testing.assert_array_equal(c.keys(layer, head), k[layer, head])
            np.testing.assert_array_equal(c.values(layer, head), v[layer, head])


def test_ratio_zero_stores_no_moments_even_when_asked():
    # with nothing evicted the summaries would be all zero and, for a 16-token chunk, several
    # times the chunk itself
    k, v = _cache(16)
    p = kvcomp.Policy(ratio=0.0, moments=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        c = kvcomp.compress(k, v, p)
    assert not c.has_moments
    assert c.nbytes <= c.original_nbytes * 1.25  # header and positions only
    # the same chunk with eviction keeps its summaries (they stand in for the evicted tokens)
    c = kvcomp.compress(*_cache(256), kvcomp.Policy(ratio=0.5, moments=True))
    assert c.has_moments


def test_the_default_policy_stores_no_moments():
    # they do not pay for their bytes under the default's recent window (docs/research.md)
    assert not kvcomp.Policy().moments and not kvcomp.preset("default").moments
    k, v = _cache(256)
    c = kvcomp.compress(k, v, kvcomp.Policy(ratio=0.5))
    assert not c.has_moments
    assert c.nbytes < kvcomp.compress(k, v, kvcomp.Policy(ratio=0.5, moments=True)).nbytes


def test_a_policy_that_expands_the_cache_says_so():
    # eviction with moments on a short chunk: the d x d summaries outweigh the tokens kept
    k, v = _cache(16)
    with pytest.warns(RuntimeWarning, match="larger than the original"):
        c = kvcomp.compress(k, v, kvcomp.Policy(ratio=0.5, moments=True))
    assert c.has_moments and c.nbytes > c.original_nbytes


def test_every_preset_round_trips_through_kvcompd_decoded():
    # What an engine loads: the daemon decodes each preset's cache to raw codecs (a dense get,
    # a whole get and a chunk get), the same values as the client's own decode.
    from kvcompd_fixture import Kvcompd, built_kvcompd

    binary = built_kvcompd()
    if binary is None:
        pytest.skip("kvcompd not built")
    k, v = _cache(256, d=64)
    k, v = k.astype(np.float16), v.astype(np.float16)
    with Kvcompd(binary) as d:
        c = kvcomp.Client(f"{d.data_endpoint},127.0.0.1:{d.control_port}", timeout=30.0)
        # the codec preset (pq) needs the model's pq calibration: refused before one exists,
        # then calibrated from raw caches of the model put beforehand
        with pytest.raises(RuntimeError, match="Calibrate"):
            c.put("m", "early", k, v, policy=kvcomp.preset("codec"))
        for i in range(3):
            rk, rv = _cache(256, d=64, seed=10 + i)
            c.put("m", f"raw{i}", rk.astype(np.float16), rv.astype(np.float16),
                  policy=kvcomp.preset("lossless"))
        results = c.calibrate("m", value_codec="pq")
        assert all(r["caches_used"] == 3 for r in results), results
        # an operator sees the calibration kept (the gauge is refreshed at most once a second)
        deadline = time.monotonic() + 10
        while d.metrics().get("kvcomp_pq_calibrations") != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert d.metrics().get("kvcomp_pq_calibrations") == 1
        for name in kvcomp.PRESETS:
            c.put("m", name, k, v, policy=kvcomp.preset(name))
            stored = c.get("m", name)
            if name == "codec":
                # the client decodes with a calibration object of its own: the daemon's is
                # checked against the engine's decode in tests/service/service_pq_test.cc
                info = kvcomp.cache_codecs(stored)
                assert (info["key_codec"], info["value_codec"]) == ("pq", "pq")
                got = c.get("m", name, decoded=True)
                assert kvcomp.cache_codecs(got)["value_codec"] == "none"
                gk, gv = kvcomp.decompress(got)
                assert gk.shape == k.shape and np.isfinite(gv).all()
                v32 = v.astype(np.float32)
                rel = np.linalg.norm(gv.astype(np.float32) - v32) / np.linalg.norm(v32)
                assert rel < 0.6, rel
                continue
            want_k, want_v = kvcomp.decompress(stored)
            for got in (c.get("m", name, decoded=True),
                        c.get_chunks("m", [name], decoded=True)[0]):
                assert kvcomp.cache_codecs(got)["value_codec"] == "none", name
                gk, gv = kvcomp.decompress(got)
                # the daemon decodes to the input dtype (f16): the client's f32 decode rounded
                np.testing.assert_allclose(gk, want_k.astype(np.float16), rtol=1e-3, atol=1e-4,
                                           err_msg=name)
                np.testing.assert_allclose(gv, want_v.astype(np.float16), rtol=1e-3, atol=1e-4,
                                           err_msg=name)


def _attention(q, k, v):
    """Softmax attention of q [heads, n, d] over k, v [heads, kept, d], float64."""
    s = np.einsum("hnd,htd->hnt", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    s = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hnt,htd->hnd", s / s.sum(-1, keepdims=True), v.astype(np.float64))


@pytest.mark.parametrize("name", ["codec", "balanced"])
def test_decode_attention_reads_every_preset(name):
    # The decode path attends over the hq codecs' caches: the same as attention over the
    # cache's own decoded keys and values. A pq cache (the codec preset) is decoded first and
    # the raw cache placed (the decode path refuses to read pq codes without its calibration).
    k, v = _cache(256, d=64, seed=3)
    if name == "codec":
        cal = kvcomp.calibrate_pq(*_cache(512, d=64, seed=4))
        c = kvcomp.compress(k, v, kvcomp.preset(name), pq=cal)
        with pytest.raises(RuntimeError, match="decode it first"):
            kvcomp.attention(np.zeros((2, 1, 64), np.float32), c, 0)
        dk, dv = kvcomp.decompress(c, pq=cal)
        q = np.random.default_rng(4).standard_normal((2, 3, 64)).astype(np.float32)
        raw = kvcomp.compress(dk.astype(np.float32), dv.astype(np.float32),
                              kvcomp.preset("lossless"))
        for layer in range(2):
            np.testing.assert_allclose(kvcomp.attention(q, raw, layer),
                                       _attention(q, dk[layer], dv[layer]), atol=1e-4)
        return
    c = kvcomp.compress(k, v, kvcomp.preset(name))
    dk, dv = kvcomp.decompress(c)
    q = np.random.default_rng(4).standard_normal((2, 3, 64)).astype(np.float32)
    for layer in range(2):
        got = kvcomp.attention(q, c, layer)
        np.testing.assert_allclose(got, _attention(q, dk[layer], dv[layer]), atol=1e-4)

"""kvcomp's Python engine API: score, Policy, compress, CompressedCache."""

import numpy as np
import pytest

import kvcomp


def _kv(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal(shape) + 0.3).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    return k, v


def _bf16_bits(a):
    """float32 -> bf16 bits (round to nearest even) as uint16."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def _bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_policy_defaults_and_validation():
    p = kvcomp.Policy()
    assert p.scorer == "manifold" and p.ratio == 0.5 and p.budget is None
    assert p.head_budget == "uniform" and p.alpha_safeguard == pytest.approx(0.2)
    assert p.window == 4096 and p.n_sink == 4
    assert kvcomp.Policy(ratio=0.07).kept_per_head(1000) == 929
    assert kvcomp.Policy(budget=64).kept_per_head(1000) == 64
    for bad in (dict(ratio=1.0), dict(ratio=-0.1), dict(scorer="nope"), dict(budget=0),
                dict(head_budget="x"), dict(alpha_safeguard=1.5)):
        with pytest.raises(ValueError):
            kvcomp.Policy(**bad)


def test_policy_recent_fraction_scales_the_recent_window():
    p = kvcomp.Policy()  # the default: three quarters of the kept budget recent
    assert p.recent_fraction == 0.75 and p.effective_recent(1000) == 750
    p = kvcomp.Policy(recent_fraction=0.0)  # n_recent alone
    assert p.effective_recent(1000) == 0
    p = kvcomp.Policy(recent_fraction=0.5, n_recent=3)
    assert p.recent_fraction == 0.5
    assert p.effective_recent(1000) == 500 and p.effective_recent(5) == 3
    assert p != kvcomp.Policy(n_recent=3)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="recent_fraction"):
            kvcomp.Policy(recent_fraction=bad)
    k, v = _kv((1, 2, 1000, 64), seed=3)
    for ratio in (0.5, 0.75, 0.9):
        pol = kvcomp.Policy(ratio=ratio, recent_fraction=0.5, moments=False)
        kept = pol.kept_per_head(1000)
        window = pol.effective_recent(kept)
        assert window == kept // 2
        c = kvcomp.compress(k, v, pol)
        assert c.policy == pol
        for head in range(2):
            pos = c.kept_positions(0, head)
            assert len(pos) == kept
            assert set(range(1000 - window, 1000)) <= set(pos.tolist())


@pytest.mark.parametrize("scorer", ["knorm", "keydiff", "manifold", "windowed_manifold"])
def test_score_matches_numpy_formulas(scorer):
    k, _ = _kv((3, 4, 300, 64))
    k64 = k.astype(np.float64)
    s = kvcomp.score(k, scorer, window=128)
    assert s.shape == (3, 4, 300) and s.dtype == np.float32
    if scorer == "knorm":
        ref = -np.linalg.norm(k64, axis=-1)
    elif scorer == "manifold":
        ref = np.linalg.norm(k64 - k64.mean(axis=2, keepdims=True), axis=-1)
    elif scorer == "keydiff":
        kn = k64 / np.linalg.norm(k64, axis=-1, keepdims=True)
        a = kn.mean(axis=2, keepdims=True)
        ref = -(kn * a).sum(-1) / np.linalg.norm(a, axis=-1)
    else:
        ref = np.empty(k.shape[:-1])
        for b in range(0, 300, 128):
            w = k64[:, :, b:b + 128]
            ref[:, :, b:b + 128] = np.linalg.norm(w - w.mean(axis=2, keepdims=True), axis=-1)
    np.testing.assert_allclose(s, ref, rtol=1e-5, atol=1e-5)
    s3 = kvcomp.score(k[1], scorer, window=128)
    np.testing.assert_array_equal(s3, s[1])


def test_compress_roundtrip_and_memory():
    k, v = _kv((2, 4, 1000, 128))
    c = kvcomp.compress(k, v, kvcomp.Policy(scorer="knorm", ratio=0.75, moments=False, protect=False))
    assert c.num_layers == 2 and c.num_kv_heads == 4 and c.head_dim == 128
    assert c.original_nbytes == k.nbytes + v.nbytes
    assert c.nbytes < 0.27 * c.original_nbytes
    s = kvcomp.score(k, "knorm")
    for layer in range(2):
        for head in range(4):
            pos = c.kept_positions(layer, head)
            assert pos.dtype == np.uint32 and len(pos) == 250
            assert np.all(np.diff(pos.astype(np.int64)) > 0)
            ref = np.sort(np.argsort(-s[layer, head], kind="stable")[:250])
            np.testing.assert_array_equal(pos, ref)
            np.testing.assert_array_equal(c.keys(layer, head), k[layer, head, pos])
            np.testing.assert_array_equal(c.values(layer, head), v[layer, head, pos])
    b = c.to_bytes()
    assert isinstance(b, bytes) and len(b) == c.nbytes
    c2 = kvcomp.CompressedCache.from_bytes(b)
    assert c2 == c
    with pytest.raises(ValueError):
        kvcomp.CompressedCache.from_bytes(b[:-1])
    with pytest.raises(IndexError):
        c.keys(2, 0)


def test_adakv_is_ragged_and_keeps_the_layer_budget():
    k, v = _kv((1, 8, 512, 64), seed=3)
    k[0, 0] *= 5  # one head with much larger spread wins budget under manifold
    c = kvcomp.compress(k, v, kvcomp.Policy(head_budget="adakv", ratio=0.5, moments=True))
    kept = c.kept
    assert sum(kept) == 8 * 256 and len(set(kept)) > 1
    assert min(kept) >= int(256 * 0.2)
    assert c.has_moments


def test_dtypes_f16_and_bf16():
    k, v = _kv((4, 77, 64), dtype=np.float32)
    c16 = kvcomp.compress(k.astype(np.float16), v.astype(np.float16), kvcomp.Policy(budget=10))
    assert c16.dtype == "f16" and c16.keys(0, 0).dtype == np.float16
    kb, vb = _bf16_bits(k), _bf16_bits(v)
    cb = kvcomp.compress(kb, vb, kvcomp.Policy(budget=10), dtype="bf16")
    assert cb.dtype == "bf16"
    pos = cb.kept_positions(0, 3)
    got = np.asarray(cb.keys(0, 3))
    np.testing.assert_array_equal(got.view(np.uint16), kb[3, pos])
    s = kvcomp.score(kb, "manifold", dtype="bf16")
    k32 = _bf16_to_f32(kb).astype(np.float64)
    ref = np.linalg.norm(k32 - k32.mean(axis=1, keepdims=True), axis=-1)
    np.testing.assert_allclose(s, ref, rtol=1e-5)


def test_snapkv_and_streaming():
    k, v = _kv((2, 200, 64), seed=5)
    q, _ = _kv((4, 16, 64), seed=6)
    c = kvcomp.compress(k, v, kvcomp.Policy(scorer="snapkv", budget=50), queries=q)
    for h in range(2):
        pos = c.kept_positions(0, h)
        assert len(pos) == 50 and set(range(184, 200)) <= set(pos.tolist())
    with pytest.raises(ValueError):
        kvcomp.compress(k, v, kvcomp.Policy(scorer="snapkv", budget=50))
    c = kvcomp.compress(k, v, kvcomp.Policy(scorer="streaming", budget=10, n_sink=4))
    assert c.kept_positions(0, 1).tolist() == [0, 1, 2, 3, 194, 195, 196, 197, 198, 199]


def test_bad_input_raises_value_error():
    k, v = _kv((2, 50, 64))
    bad = k.copy()
    bad[1, 7, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        kvcomp.compress(bad, v)
    bad[1, 7, 3] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        kvcomp.score(bad, "knorm")
    with pytest.raises(ValueError, match="head_dim"):
        kvcomp.compress(k[:, :, :48].copy(), v[:, :, :48].copy())
    with pytest.raises(ValueError):
        kvcomp.compress(k, v[:, :49].copy())
    with pytest.raises(ValueError):
        kvcomp.compress(k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(ValueError, match="empty sequence"):
        kvcomp.compress(k[:, :0].copy(), v[:, :0].copy())
    with pytest.raises(ValueError, match="budget of zero"):
        kvcomp.compress(k[:, :1].copy(), v[:, :1].copy(), kvcomp.Policy(ratio=0.5))
    with pytest.raises(ValueError):
        kvcomp.compress(k[0], v[0])  # 2-D


def test_cuda_backend_when_unavailable():
    k, v = _kv((2, 50, 64))
    if kvcomp.cuda_available():
        # Same kept tokens and bytes; the moment sums agree to fp32 rounding (the GPU sums
        # v k^T on tensor cores, in another order).
        policy = kvcomp.Policy(moments=True)
        c = kvcomp.compress(k, v, policy, backend="cuda")
        ref = kvcomp.compress(k, v, policy, backend="cpu")
        for h in range(2):
            np.testing.assert_array_equal(c.kept_positions(0, h), ref.kept_positions(0, h))
            np.testing.assert_array_equal(np.asarray(c.keys(0, h)), np.asarray(ref.keys(0, h)))
            np.testing.assert_array_equal(np.asarray(c.values(0, h)),
                                          np.asarray(ref.values(0, h)))
            for got, want in zip(c.moments(0, h), ref.moments(0, h)):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    else:
        # No CUDA build or no device: FailedPrecondition, a RuntimeError saying so (not a
        # ConnectionError: nothing is unreachable, the machine has no GPU).
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: no CUDA device") as e:
            kvcomp.compress(k, v, backend="cuda")
        assert not isinstance(e.value, OSError)

"""kvcomp's KVSplice Python API: calibrate, Projection save/load, the policy's
codec fields, compress(..., projection=) and decompress."""

import numpy as np
import pytest

import kvcomp


def _low_rank(layers=2, heads=2, tokens=512, d=64, rank=16, noise=0.02, seed=0, basis_seed=1):
    """Values of rank `rank` plus noise, a fixed basis per head (basis_seed), fresh tokens."""
    brng = np.random.default_rng(basis_seed)
    rng = np.random.default_rng(seed)
    out = np.empty((layers, heads, tokens, d), np.float32)
    for l in range(layers):
        for h in range(heads):
            q, _ = np.linalg.qr(brng.standard_normal((d, d)))
            scales = 0.9 ** np.arange(rank)
            z = rng.standard_normal((tokens, rank)) * scales
            out[l, h] = z @ q[:, :rank].T + noise * rng.standard_normal((tokens, d))
    return out


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_calibrate_rank_and_save_load(tmp_path):
    v = _low_rank()
    p = kvcomp.calibrate(v, rank=32, model_id="llama-test")
    assert p.rank == 32 and p.head_dim == 64 and p.num_layers == 2 and p.num_kv_heads == 2
    assert p.model_id == "llama-test" and p.version != 0 and p.samples == 512
    b = p.basis
    assert b.shape == (2, 2, 32, 64)
    np.testing.assert_allclose(b[0, 0] @ b[0, 0].T, np.eye(32), atol=1e-4)
    ev = p.eigenvalues
    assert ev.shape == (2, 2, 64) and np.all(np.diff(ev[0, 0]) <= 1e-6)
    path = tmp_path / "proj.kvpj"
    p.save(str(path))
    q = kvcomp.Projection.load(str(path))
    assert q.version == p.version and np.array_equal(q.basis, p.basis)
    raw = path.read_bytes()
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(ValueError):
        kvcomp.Projection.from_bytes(bytes(bad))
    # Several caches accumulate; recalibration with more data is a new version.
    p2 = kvcomp.calibrate([v, _low_rank(seed=5)], rank=32, model_id="llama-test")
    assert p2.version != p.version and p2.samples == 1024


def test_error_budget_auto_tunes_per_layer():
    v = _low_rank(tokens=2048, rank=24)
    p = kvcomp.calibrate(v, error_budget=0.1, codec="orthogonal_int8")
    assert len(p.tuned_rank) == 2
    assert all(0 < r < 64 for r in p.tuned_rank)
    assert all(e <= 0.1 for e in p.tuned_error)
    assert p.rank == max(p.tuned_rank)
    with pytest.raises(ValueError):
        kvcomp.calibrate(v, rank=8, error_budget=0.1)
    with pytest.raises(ValueError):
        kvcomp.calibrate(v, error_budget=0.1, metric="perplexity")


def test_tuned_layers_keep_their_own_ranks():
    # Layer 0 has rank-8 values, layer 1 rank-40: the tuner gives them different ranks, and a
    # cache encoded with the tuned projection stores each layer at its own rank (format 1.1).
    v = np.concatenate([_low_rank(layers=1, tokens=1024, rank=8, seed=11),
                        _low_rank(layers=1, tokens=1024, rank=40, seed=12, basis_seed=4)])
    p = kvcomp.calibrate(v, error_budget=0.08, codec="orthogonal_int8")
    r0, r1 = p.tuned_rank
    assert r0 < r1
    c = kvcomp.compress(v, v, kvcomp.Policy(ratio=0.5, value_codec="orthogonal_int8"),
                        projection=p)
    info = kvcomp.cache_codecs(c)
    assert info["layer_rank"] == [r0, r1] and info["rank"] == r1
    kept = [c.kept_positions(l, h).shape[0] for l in range(2) for h in range(2)]
    groups = [-(-r // 32) for r in (r0, r0, r1, r1)]
    assert info["bytes"]["values"] == sum(n * r for n, r in zip(kept, (r0, r0, r1, r1)))
    assert info["bytes"]["value_scales"] == 2 * sum(n * g for n, g in zip(kept, groups))
    back = kvcomp.CompressedCache.from_bytes(c.to_bytes())
    assert kvcomp.cache_codecs(back)["layer_rank"] == [r0, r1]
    _, vv = kvcomp.decompress(back, p)
    for l in range(2):
        for h in range(2):
            pos = back.kept_positions(l, h)
            assert _rel(vv[l, h], v[l, h, pos]) <= 0.1
    # A policy rank overrides the tuner: one rank for every layer.
    fixed = kvcomp.compress(v, v, kvcomp.Policy(ratio=0.5, value_codec="orthogonal_int8",
                                                rank=r1), projection=p)
    assert kvcomp.cache_codecs(fixed)["layer_rank"] == [r1, r1]
    assert kvcomp.cache_codecs(fixed)["bytes"]["values"] > info["bytes"]["values"]


def test_off_subspace_values_are_kept_raw():
    v = _low_rank(tokens=400, rank=12)
    proj = kvcomp.calibrate(v, rank=32)
    rng = np.random.default_rng(3)
    planted = [37, 150, 333]
    for l in range(2):
        for h in range(2):
            for t in planted:
                u = rng.standard_normal(64)
                v[l, h, t] = 4.0 * u / np.linalg.norm(u)
    k = _low_rank(tokens=400, rank=40, seed=5)
    policy = kvcomp.Policy(ratio=0.0, value_codec="orthogonal_int8", rank=16)
    assert policy.value_outlier_factor == 4.0 and policy.value_raw_fraction == 0.02
    cache = kvcomp.compress(k, v, policy, projection=proj)
    info = kvcomp.cache_codecs(cache)
    assert info["raw_value_rows"] == 4 * len(planted)
    assert info["bytes"]["raw_values"] == 4 * len(planted) * (8 + 64 * 4)
    _, vv = kvcomp.decompress(kvcomp.CompressedCache.from_bytes(cache.to_bytes()), proj)
    for l in range(2):
        for h in range(2):
            np.testing.assert_array_equal(vv[l, h, planted], v[l, h, planted])
    off = kvcomp.compress(k, v, kvcomp.Policy(ratio=0.0, value_codec="orthogonal_int8", rank=16,
                                              value_raw_fraction=0.0), projection=proj)
    assert kvcomp.cache_codecs(off)["raw_value_rows"] == 0
    _, vo = kvcomp.decompress(off, proj)
    assert _rel(vo[0, 0, planted], v[0, 0, planted]) > 0.5
    with pytest.raises(ValueError):
        kvcomp.Policy(value_outlier_factor=0.5)
    with pytest.raises(ValueError):
        kvcomp.Policy(value_raw_fraction=1.5)


@pytest.mark.parametrize("value_codec", ["none", "orthogonal", "orthogonal_int8",
                                         "orthogonal_int4"])
@pytest.mark.parametrize("key_codec", ["raw", "fp16", "int8", "int4"])
def test_every_preset_round_trips(value_codec, key_codec):
    v = _low_rank(tokens=300, rank=16)
    k = _low_rank(tokens=300, rank=40, seed=3, basis_seed=9) * 3
    proj = kvcomp.calibrate(v, model_id="m")
    policy = kvcomp.Policy(ratio=0.25, value_codec=value_codec, key_codec=key_codec)
    assert policy.value_codec == value_codec and policy.key_codec == key_codec
    cache = kvcomp.compress(k, v, policy, projection=proj)
    info = kvcomp.cache_codecs(cache)
    assert info["value_codec"] == value_codec and info["key_codec"] == key_codec
    assert info["projection_version"] == (0 if value_codec == "none" else proj.version)
    assert info["bytes"]["total"] == cache.nbytes
    back = kvcomp.CompressedCache.from_bytes(cache.to_bytes())
    kk, vv = kvcomp.decompress(back, proj if value_codec != "none" else None)
    kept = cache.kept_positions(0, 0).shape[0]
    assert kk.shape == (2, 2, kept, 64) and vv.shape == kk.shape
    for l in range(2):
        for h in range(2):
            pos = cache.kept_positions(l, h)
            ev = _rel(vv[l, h], v[l, h, pos])
            ek = _rel(kk[l, h], k[l, h, pos])
            # Rank 32..48 of a rank-16 signal: the noise off the kept directions is the floor.
            assert ev <= {"none": 0, "orthogonal": 0.06, "orthogonal_int8": 0.06,
                          "orthogonal_int4": 0.12}[value_codec] + 1e-7
            assert ek <= {"raw": 0, "fp16": 1e-3, "int8": 0.02, "int4": 0.15}[key_codec] + 1e-7
    if value_codec in ("orthogonal_int8", "orthogonal_int4"):
        assert info["rank"] == {"orthogonal_int8": 32, "orthogonal_int4": 48}[value_codec]
        assert info["gamma_aware"] and info["group_size"] == 32
        assert info["bytes"]["value_scales"] > 0


def test_policy_rank_and_bytes_shrink_with_rank():
    v = _low_rank(tokens=256)
    proj = kvcomp.calibrate(v)
    sizes = []
    for rank in (8, 16, 32):
        c = kvcomp.compress(v, v, kvcomp.Policy(ratio=0.5, value_codec="orthogonal_int8",
                                               rank=rank), projection=proj)
        assert kvcomp.cache_codecs(c)["rank"] == rank
        sizes.append(kvcomp.cache_codecs(c)["bytes"]["values"])
    assert sizes[0] < sizes[1] < sizes[2]
    with pytest.raises(ValueError):
        kvcomp.Policy(value_codec="orthogonal_int4", rank=7)


def test_missing_or_wrong_projection_is_a_clear_error():
    v = _low_rank(tokens=128)
    proj = kvcomp.calibrate(v)
    policy = kvcomp.Policy(ratio=0.5, value_codec="orthogonal_int8")
    with pytest.raises(Exception, match="projection"):
        kvcomp.compress(v, v, policy)
    cache = kvcomp.compress(v, v, policy, projection=proj)
    with pytest.raises(KeyError, match="projection"):
        kvcomp.decompress(cache)
    other = kvcomp.calibrate(_low_rank(tokens=128, seed=4))
    with pytest.raises(KeyError, match="projection"):
        kvcomp.decompress(cache, other)
    with pytest.raises(ValueError):  # another model's shape
        kvcomp.compress(v[:1], v[:1], policy, projection=proj)


@pytest.mark.skipif(not kvcomp.cuda_available(), reason="no CUDA device")
def test_cuda_backend_agrees_with_cpu():
    v = _low_rank(tokens=300, d=128, rank=32)
    proj = kvcomp.calibrate(v)
    proj_gpu = kvcomp.calibrate(v, backend="cuda")
    np.testing.assert_allclose(proj_gpu.eigenvalues, proj.eigenvalues, rtol=1e-3, atol=1e-5)
    for codec in ("orthogonal", "orthogonal_int8", "orthogonal_int4"):
        policy = kvcomp.Policy(ratio=0.5, value_codec=codec, key_codec="int8")
        c_cpu = kvcomp.compress(v, v, policy, projection=proj)
        c_gpu = kvcomp.compress(v, v, policy, projection=proj, backend="cuda")
        _, v_cpu = kvcomp.decompress(c_cpu, proj)
        _, v_gpu = kvcomp.decompress(c_gpu, proj, backend="cuda")
        assert _rel(v_gpu, v_cpu) < 5e-3
    # int4 keys (scales per group of 128 kept tokens): the GPU decodes the CPU's cache to the same
    # numbers and encodes within the codec's error.
    k = _low_rank(tokens=600, d=128, rank=40, seed=3, basis_seed=9) * 3
    policy = kvcomp.Policy(ratio=0.25, key_codec="int4")
    c_cpu = kvcomp.compress(k, v[:, :, :1].repeat(600, axis=2), policy)
    kk_cpu, _ = kvcomp.decompress(c_cpu)
    kk_gpu, _ = kvcomp.decompress(c_cpu, backend="cuda")
    np.testing.assert_array_equal(kk_gpu, kk_cpu)
    c_gpu = kvcomp.compress(k, v[:, :, :1].repeat(600, axis=2), policy, backend="cuda")
    kk, _ = kvcomp.decompress(c_gpu, backend="cuda")
    for l in range(k.shape[0]):
        for h in range(k.shape[1]):
            assert _rel(kk[l, h], k[l, h, c_gpu.kept_positions(l, h)]) < 0.15


@pytest.mark.parametrize("codecs", [("raw", "none"), ("int8", "orthogonal_int8"),
                                    ("hq4", "hq3"), ("int4", "orthogonal_int4")])
def test_decompress_into_given_arrays_matches_decompress(codecs):
    key_codec, value_codec = codecs
    v = _low_rank(tokens=300, rank=16)
    k = _low_rank(tokens=300, rank=40, seed=3, basis_seed=9) * 3
    v[1, 0, 17] *= 40  # an off-subspace row: kept raw by KVSplice (an outlier row)
    proj = kvcomp.calibrate(v, model_id="m") if value_codec.startswith("orthogonal") else None
    policy = kvcomp.Policy(ratio=0.25, value_codec=value_codec, key_codec=key_codec)
    cache = kvcomp.compress(k, v, policy, projection=proj)
    kk, vv = kvcomp.decompress(cache, proj)
    n = sum(cache.kept) * 64
    for dtype in (np.float32, np.float16):
        ko, vo = np.full(n, np.nan, dtype), np.full(n, np.nan, dtype)
        got = kvcomp.decompress(cache, proj, out=(ko, vo))
        assert got[0] is ko and got[1] is vo
        np.testing.assert_array_equal(ko.reshape(kk.shape), kk.astype(dtype))
        np.testing.assert_array_equal(vo.reshape(vv.shape), vv.astype(dtype))
    with pytest.raises(ValueError, match="total_kept x head_dim"):
        kvcomp.decompress(cache, proj, out=(np.zeros(n - 1, np.float32), np.zeros(n, np.float32)))
    with pytest.raises(ValueError, match="same dtype"):
        kvcomp.decompress(cache, proj, out=(np.zeros(n, np.float32), np.zeros(n, np.float16)))

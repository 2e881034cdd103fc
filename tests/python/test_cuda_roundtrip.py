"""The Python round trip on the GPU: kvcomp.compress(..., backend="cuda"),
kvcomp.decompress(..., backend="cuda") and kvcomp.calibrate(..., backend="cuda") against the CPU
reference, on fresh random inputs of a realistic shape (4 layers, 8 kv heads, 3000 tokens,
head_dim 128; f32, f16 and bf16), every value codec x key codec.

What is compared, with the tolerances the kernels' own CUDA-vs-CPU tests use
(tests/kernels/codec_cuda_test.cc, scoring_test_util.h, moments_cuda_test.cc):
- kept positions: identical under the "random" scorer (an exact formula of the position on both
  backends); under the real scorers identical up to tokens whose scores tie within 1e-4 at the
  selection threshold, scores within 1e-4 relative;
- the encoded bytes, section by section (docs/format.md): header, kept counts, policy, positions,
  keys, key scales, per-layer ranks exactly; value latents within one quantization step (at most
  0.5% of them) or, for f16 latents, 2e-3 relative + 1e-4; value scales within one f16 unit in the
  last place; moment sums within 2e-4 of their largest magnitude;
- decompress of each cache on each backend against decompress of the CPU cache on the CPU: keys
  exactly; values exactly for codec "none", else per row within 3e-3 of the row's RMS + 1e-4
  and 2e-3 relative overall when the bytes are the same, and 5e-3 (int4: 1e-2) relative overall
  across the two encodings;
- the values' reconstruction error against the input is where the projection's spectrum puts it
  (rank truncation), the GPU's within 5% of the CPU's.
The Python API takes no output buffers (it returns new arrays), so nothing here can be poisoned
first; the kernels' C++ tests poison theirs. Every returned array is checked to be finite.

Skipped where kvcomp.cuda_available() is False (no CUDA build or no device), which is the case on
CI. KVCOMP_TEST_CANDIDATE_BACKEND=cpu runs every comparison with the CPU as the candidate too: a
check of this file's own logic on a machine without a GPU, not a GPU test.
KVCOMP_TEST_SEED fixes the otherwise fresh random seed (printed on failure).
"""

import os
import struct

import numpy as np
import pytest

import kvcomp

CANDIDATE = os.environ.get("KVCOMP_TEST_CANDIDATE_BACKEND", "cuda")


def _cuda_reason():
    try:
        why = kvcomp.backend_description("cuda")
    except Exception as e:  # noqa: BLE001 - the message is the reason
        why = str(e)
    if "driver version is insufficient" in why or "no CUDA-capable device" in why:
        return "this machine has no NVIDIA GPU or driver (" + why + ")"
    return why


needs_cuda = pytest.mark.skipif(
    CANDIDATE == "cuda" and not kvcomp.cuda_available(),
    reason="needs an NVIDIA GPU: " + _cuda_reason())

LAYERS, HEADS, TOKENS, D = 4, 8, 3000, 128
SIGNAL_RANK = 48
SEED = int(os.environ.get("KVCOMP_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
DTYPES = ["f32", "f16", "bf16"]
VALUE_CODECS = ["none", "orthogonal", "orthogonal_int8", "orthogonal_int4"]
KEY_CODECS = ["raw", "int8"]


# --- inputs ---

def _bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def _make_f32(seed):
    """Keys and values [L, H, T, D] float32, never zero. Values: rank-48 signal (decaying
    spectrum, a per-head basis, a mean) plus noise; keys: per-channel scales with outliers."""
    rng = np.random.default_rng(seed)
    v = np.empty((LAYERS, HEADS, TOKENS, D), np.float32)
    k = np.empty_like(v)
    scales = 0.97 ** np.arange(SIGNAL_RANK)
    for l in range(LAYERS):
        for h in range(HEADS):
            q, _ = np.linalg.qr(rng.standard_normal((D, SIGNAL_RANK)))  # orthonormal columns
            z = rng.standard_normal((TOKENS, SIGNAL_RANK)) * scales
            v[l, h] = z @ q.T + 0.3 * q[:, 0] + 0.02 * rng.standard_normal((TOKENS, D))
            ch = np.exp(rng.normal(0.0, 0.5, D))
            ch[rng.choice(D, 4, replace=False)] *= 8.0  # outlier channels, as real keys have
            k[l, h] = rng.standard_normal((TOKENS, D)) * ch + rng.normal(0.0, 0.5, D)
    for a in (k, v):
        a[a == 0] = 1e-3
    return k, v


_DATA = {}


def _data(dtype):
    """(keys, values) as handed to kvcomp, their exact values as float32, and the dtype hint."""
    if "f32" not in _DATA:
        k, v = _make_f32(SEED)
        _DATA["f32"] = (k, v, k, v, "")
    if dtype not in _DATA:
        k, v = _DATA["f32"][:2]
        if dtype == "f16":
            kk, vv = k.astype(np.float16), v.astype(np.float16)
            for a in (kk, vv):
                a[a == 0] = np.float16(1e-3)  # underflowed
            _DATA[dtype] = (kk, vv, kk.astype(np.float32), vv.astype(np.float32), "")
        else:
            kk, vv = _bf16_bits(k), _bf16_bits(v)
            _DATA[dtype] = (kk, vv, _from_bf16_bits(kk), _from_bf16_bits(vv), "bf16")
    for a in _DATA[dtype][2:4]:
        assert np.all(a != 0) and np.all(np.isfinite(a))
    return _DATA[dtype]


_PROJ = {}


def _projection(backend="cpu"):
    """Full-rank projection calibrated on the f32 values (one per backend)."""
    if backend not in _PROJ:
        _PROJ[backend] = kvcomp.calibrate(_data("f32")[1], model_id="roundtrip", backend=backend)
    return _PROJ[backend]


def _ctx(**kw):
    return "seed=%d %s" % (SEED, " ".join("%s=%s" % x for x in kw.items()))


# --- the format, read just far enough to compare sections (docs/format.md) ---

def _sections(blob):
    """(header fields, {section id: bytes}) of an encoded cache."""
    hdr = {
        "magic": struct.unpack_from("<I", blob, 0)[0],
        "flags": struct.unpack_from("<I", blob, 12)[0],
        "key_codec": blob[41],
        "value_codec": blob[42],
        "rank": struct.unpack_from("<I", blob, 44)[0],
        "group_size": struct.unpack_from("<I", blob, 48)[0],
    }
    n = struct.unpack_from("<I", blob, 52)[0]
    out = {}
    for i in range(n):
        sid, _flags, off, size = struct.unpack_from("<IIQQ", blob, 128 + 32 * i)
        out[sid] = blob[off:off + size]
    return hdr, out


HEADS_SEC, POLICY_SEC, POSITIONS_SEC, KEYS_SEC, KEY_SCALES_SEC = 1, 2, 3, 4, 5
VALUES_SEC, VALUE_SCALES_SEC = 6, 7
MOMENT_SECS = (9, 10, 11)  # f32 sums; 8 (counts) is exact


def _latents(sec, value_codec):
    if value_codec == "orthogonal":
        return np.frombuffer(sec, np.float16).astype(np.float32)
    if value_codec == "orthogonal_int8":
        return np.frombuffer(sec, np.int8).astype(np.int32)
    b = np.frombuffer(sec, np.uint8)
    q = np.stack([b & 15, b >> 4], axis=1).reshape(-1).astype(np.int32)  # low nibble first
    return np.where(q >= 8, q - 16, q)


def _compare_encoded(ref, got, value_codec, ctx):
    """The candidate's encoding of the same kept tokens against the reference's."""
    rb, gb = ref.to_bytes(), got.to_bytes()
    assert len(gb) == len(rb), ctx
    # Header bytes 0..123 but the table CRC (80..83), which covers the sections' CRCs.
    assert gb[:80] == rb[:80] and gb[84:124] == rb[84:124], ctx
    rh, rs = _sections(rb)
    _, gs = _sections(gb)
    assert sorted(gs) == sorted(rs), ctx
    for sid, rsec in rs.items():
        gsec = gs[sid]
        assert len(gsec) == len(rsec), (sid, ctx)
        if sid == VALUES_SEC and value_codec != "none":
            a, b = _latents(rsec, value_codec), _latents(gsec, value_codec)
            if value_codec == "orthogonal":
                bad = np.abs(b - a) > 2e-3 * np.abs(a) + 1e-4
                assert not bad.any(), ("f16 latents", int(bad.sum()), ctx)
            else:
                diff = np.abs(b - a)
                assert diff.max(initial=0) <= 1, ("latents differ by more than one step", ctx)
                assert int((diff != 0).sum()) <= a.size // 200 + 2, ("latents rounding", ctx)
        elif sid == VALUE_SCALES_SEC:
            a = np.frombuffer(rsec, np.uint16).astype(np.int32)
            b = np.frombuffer(gsec, np.uint16).astype(np.int32)
            assert np.abs(b - a).max(initial=0) <= 1, ("value scales", ctx)
        elif sid in MOMENT_SECS:
            a = np.frombuffer(rsec, np.float32).astype(np.float64)
            b = np.frombuffer(gsec, np.float32).astype(np.float64)
            assert np.all(np.isfinite(b)), ctx
            scale = max(1.0, float(np.abs(a).max(initial=0)))
            assert np.abs(b - a).max(initial=0) / scale < 2e-4, ("moments", sid, ctx)
        else:  # counts, policy, positions, keys, key scales, moment counts, layer ranks
            assert gsec == rsec, ("section %d differs" % sid, ctx)
    return rh


def _rel(a, b):
    return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))


def _expect_close_rows(got, ref, ctx, what):
    """Per row: |got - ref| <= 3e-3 rms(ref row) + 1e-4 (codec_cuda_test's decode tolerance)."""
    rms = np.sqrt(np.mean(ref.astype(np.float64) ** 2, axis=-1, keepdims=True))
    bad = np.abs(got.astype(np.float64) - ref) > 3e-3 * rms + 1e-4
    assert not bad.any(), (what, int(bad.sum()), ctx)
    assert _rel(got, ref) < 2e-3, (what, ctx)


# --- tests ---

@needs_cuda
def test_calibration_agrees_with_cpu():
    vals = _data("f32")[1]
    pc, pg = _projection("cpu"), _projection(CANDIDATE)
    assert pg.num_layers == LAYERS and pg.num_kv_heads == HEADS and pg.rank == D
    assert pg.samples == pc.samples
    ec, eg = pc.eigenvalues, pg.eigenvalues
    assert np.all(np.isfinite(eg))
    top = ec[..., :1]
    assert np.all(np.abs(eg - ec) <= 1e-4 * top + 1e-6), _ctx(worst=np.abs(eg - ec).max())
    # The signal's leading directions (clear eigenvalue gaps) are the same vectors.
    bc, bg = pc.basis, pg.basis
    dots = np.einsum("lhrd,lhrd->lhr", bc[:, :, :16].astype(np.float64), bg[:, :, :16])
    assert np.all(np.abs(dots - 1.0) < 1e-3), _ctx(worst=np.abs(dots - 1.0).max())
    # Gamma follows the eigenvalues; compare it where they are large (the noise directions'
    # eigenvalues are within the absolute tolerance above, not a relative one).
    np.testing.assert_allclose(pg.gamma[:, :, :16], pc.gamma[:, :, :16], rtol=1e-3, atol=1e-6)
    # The auto-tuner on the same data picks the same rank per layer (one step of 4 at most).
    tc = kvcomp.calibrate(vals, error_budget=0.05, codec="orthogonal_int8")
    tg = kvcomp.calibrate(vals, error_budget=0.05, codec="orthogonal_int8", backend=CANDIDATE)
    assert len(tg.tuned_rank) == LAYERS
    assert all(e <= 0.05 for e in tg.tuned_error), tg.tuned_error
    assert all(abs(int(a) - int(b)) <= 4 for a, b in zip(tg.tuned_rank, tc.tuned_rank)), (
        tg.tuned_rank, tc.tuned_rank)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scorer,head_budget", [("manifold", "uniform"), ("knorm", "uniform"),
                                                ("manifold", "adakv")])
def test_kept_positions_agree(dtype, scorer, head_budget):
    k, v, k32, v32, hint = _data(dtype)
    ctx = _ctx(dtype=dtype, scorer=scorer, head_budget=head_budget)
    policy = kvcomp.Policy(scorer=scorer, ratio=0.5, head_budget=head_budget, moments=True)
    ref = kvcomp.compress(k, v, policy, dtype=hint or None)
    got = kvcomp.compress(k, v, policy, backend=CANDIDATE, dtype=hint or None)
    assert sum(got.kept) == sum(ref.kept), ctx
    sc = kvcomp.score(k, scorer, dtype=hint or None)
    sg = kvcomp.score(k, scorer, backend=CANDIDATE, dtype=hint or None)
    assert np.all(np.abs(sg - sc) <= 1e-4 * np.maximum(1.0, np.abs(sc))), ctx
    same = True
    for l in range(LAYERS):
        for h in range(HEADS):
            a, b = ref.kept_positions(l, h), got.kept_positions(l, h)
            assert np.all(np.diff(b.astype(np.int64)) > 0) and b.max(initial=0) < TOKENS, ctx
            # The kept rows are the input's rows, bit for bit.
            kr = np.asarray(got.keys(l, h)).view(np.uint8)
            vr = np.asarray(got.values(l, h)).view(np.uint8)
            assert np.array_equal(kr, np.ascontiguousarray(k[l, h, b]).view(np.uint8)), ctx
            assert np.array_equal(vr, np.ascontiguousarray(v[l, h, b]).view(np.uint8)), ctx
            if not np.array_equal(a, b):
                # Allowed only between tokens whose reference scores tie at the threshold.
                same = False
                only = np.setxor1d(a, b)
                s = sc[l, h, only]
                assert s.max() - s.min() <= 2e-4 * max(1.0, abs(float(s.max()))), (l, h, ctx)
    if same:
        _compare_encoded(ref, got, "none", ctx)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value_codec", VALUE_CODECS)
@pytest.mark.parametrize("key_codec", KEY_CODECS)
def test_codec_round_trip_agrees(dtype, value_codec, key_codec):
    k, v, k32, v32, hint = _data(dtype)
    proj = _projection("cpu")
    ctx = _ctx(dtype=dtype, value_codec=value_codec, key_codec=key_codec)
    # "random": kept positions are an exact formula on both backends, so both encode the same
    # rows (the real scorers are compared in test_kept_positions_agree).
    policy = kvcomp.Policy(scorer="random", seed=11, ratio=0.5, value_codec=value_codec,
                           key_codec=key_codec, moments=True)
    ref = kvcomp.compress(k, v, policy, dtype=hint or None, projection=proj)
    got = kvcomp.compress(k, v, policy, backend=CANDIDATE, dtype=hint or None, projection=proj)
    for l in range(LAYERS):
        for h in range(HEADS):
            assert np.array_equal(got.kept_positions(l, h), ref.kept_positions(l, h)), ctx
    info = kvcomp.cache_codecs(got)
    assert info == kvcomp.cache_codecs(ref), ctx
    assert info["value_codec"] == value_codec and info["key_codec"] == key_codec, ctx
    _compare_encoded(ref, got, value_codec, ctx)

    p = proj if value_codec != "none" else None
    rk, rv = kvcomp.decompress(ref, p)  # the CPU reference
    kept = policy.kept_per_head(TOKENS)
    assert rk.shape == (LAYERS, HEADS, kept, D) and rv.shape == rk.shape, ctx
    pos = np.stack([np.stack([ref.kept_positions(l, h) for h in range(HEADS)])
                    for l in range(LAYERS)])
    kin = np.take_along_axis(k32, pos[..., None].astype(np.int64), axis=2)
    vin = np.take_along_axis(v32, pos[..., None].astype(np.int64), axis=2)
    outs = {"cpu cache on %s" % CANDIDATE: kvcomp.decompress(ref, p, backend=CANDIDATE),
            "%s cache on cpu" % CANDIDATE: kvcomp.decompress(got, p),
            "%s cache on %s" % (CANDIDATE, CANDIDATE): kvcomp.decompress(got, p,
                                                                       backend=CANDIDATE)}
    for what, (dk, dv) in outs.items():
        assert dk.shape == rk.shape and dv.shape == rv.shape, (what, ctx)
        assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv)), (what, ctx)
        assert np.array_equal(dk, rk), ("keys", what, ctx)
        if value_codec == "none":
            assert np.array_equal(dv, rv), ("values", what, ctx)
        elif what.startswith("cpu cache"):  # the same bytes decoded on the candidate
            _expect_close_rows(dv, rv, ctx, what)
        else:  # the candidate's encoding
            if what.endswith(CANDIDATE):
                _expect_close_rows(dv, kvcomp.decompress(got, p)[1], ctx, what + " vs cpu")
            tol = 1e-2 if value_codec == "orthogonal_int4" else 5e-3
            assert _rel(dv, rv) < tol, (what, _rel(dv, rv), ctx)

    # Reconstruction against the input: keys exact (raw) or int8-close; values where the
    # projection's spectrum puts the rank truncation, plus quantization.
    ek = _rel(rk, kin)
    assert (ek == 0.0) if key_codec == "raw" else (0.0 < ek < 0.02), (ek, ctx)
    ev_ref = _rel(rv, vin)
    ev_got = _rel(outs["%s cache on %s" % (CANDIDATE, CANDIDATE)][1], vin)
    if value_codec == "none":
        assert ev_ref == 0.0 and ev_got == 0.0, ctx
        return
    r = info["rank"]
    lam = proj.eigenvalues.astype(np.float64)  # [L, H, D], descending
    predicted = float(np.sqrt(lam[..., r:].sum() / lam.sum()))
    # Measured on the CPU: at the truncation's prediction for f16 latents and int8 (0.038 at
    # rank 64), int4 adds ~0.1 (0.100 at rank 96, predicted 0.026).
    quant = {"orthogonal": 0.002, "orthogonal_int8": 0.005, "orthogonal_int4": 0.1}[value_codec]
    assert 0.9 * predicted < ev_ref < 1.1 * predicted + quant, (ev_ref, predicted, r, ctx)
    assert ev_got <= 1.05 * ev_ref + 1e-4, (ev_got, ev_ref, ctx)


@needs_cuda
def test_device_tensors_in_place():
    """torch CUDA tensors go to the CUDA backend in place (DLPack), and agree with host input."""
    try:  # kvcomp loaded its CUDA libraries first; a torch built for others may not load
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, OSError (undefined symbols), ...
        pytest.skip("torch does not import here: %s" % e)
    if CANDIDATE != "cuda" or not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    proj = _projection("cpu")
    for dtype, tdt in (("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)):
        k32, v32 = _data(dtype)[2:4]
        kt = torch.from_numpy(k32).to("cuda", tdt).contiguous()
        vt = torch.from_numpy(v32).to("cuda", tdt).contiguous()
        torch.cuda.synchronize()  # kvcomp reads them on its own stream
        k, v, _, _, hint = _data(dtype)
        policy = kvcomp.Policy(scorer="random", seed=3, ratio=0.25,
                               value_codec="orthogonal_int8", key_codec="int8", moments=True)
        ref = kvcomp.compress(k, v, policy, backend="cuda", dtype=hint or None, projection=proj)
        got = kvcomp.compress(kt, vt, policy, backend="cuda", projection=proj)
        _compare_encoded(ref, got, "orthogonal_int8", _ctx(dtype=dtype, input="torch.cuda"))


@pytest.mark.skipif(hasattr(kvcomp._kvcomp, "_Client"), reason="this build has the client")
def test_core_only_build_says_it_has_no_client():
    """The GPU machine's build (KVCOMP_CORE_ONLY, no UCX) imports, and says why Client fails."""
    with pytest.raises(NotImplementedError, match="this build of kvcomp has no client"):
        kvcomp.Client(["127.0.0.1:1"])


@needs_cuda
@pytest.mark.parametrize("codecs", [("hq4", "hq3"), ("int8", "orthogonal_int8"), ("raw", "none")])
def test_decompress_into_device_tensors_matches_the_cpu(codecs):
    """decompress(out=) with CUDA tensors decodes on the device what decompress(backend="cuda")
    gives, bit for bit in float32; the Hadamard and raw codecs also the CPU's bits in every
    dtype (KVSplice's products may round differently: within its tolerance)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, OSError (undefined symbols), ...
        pytest.skip("torch does not import here: %s" % e)
    if CANDIDATE != "cuda" or not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    key_codec, value_codec = codecs
    k, v = _data("bf16")[:2]
    proj = _projection("cpu") if value_codec != "none" else None
    policy = kvcomp.Policy(scorer="random", seed=5, ratio=0.5, value_codec=value_codec,
                           key_codec=key_codec)
    cache = kvcomp.compress(k, v, policy, dtype="bf16", projection=proj)
    exact = value_codec == "none" or value_codec.startswith("hq")
    n = sum(cache.kept) * D
    refs = {"cuda": kvcomp.decompress(cache, proj, backend="cuda"),
            "cpu": kvcomp.decompress(cache, proj)}
    for tdt in (torch.float32, torch.bfloat16):
        ko = torch.full((n,), float("nan"), dtype=tdt, device="cuda")
        vo = torch.full((n,), float("nan"), dtype=tdt, device="cuda")
        kvcomp.decompress(cache, proj, backend="cuda", out=(ko, vo))
        for where, (rk, rv) in refs.items():
            want_k = torch.from_numpy(np.ascontiguousarray(rk)).reshape(-1).to(tdt)
            want_v = torch.from_numpy(np.ascontiguousarray(rv)).reshape(-1).to(tdt)
            ctx = _ctx(codecs=codecs, dtype=str(tdt), against=where)
            assert torch.equal(ko.cpu(), want_k), ctx
            if exact or (where == "cuda" and tdt == torch.float32):
                assert torch.equal(vo.cpu(), want_v), ctx
            else:
                err = (vo.cpu().float() - want_v.float()).norm() / want_v.float().norm()
                assert err < 1e-2, (float(err), ctx)
    with pytest.raises(ValueError, match="CUDA arrays"):
        kvcomp.decompress(cache, proj, backend="cuda",
                          out=(np.zeros(n, np.float32), np.zeros(n, np.float32)))

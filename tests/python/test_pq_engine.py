"""The calibrated basis codec (pq) as an engine codec through the Python API: kvcomp.calibrate_pq,
kvcomp.compress with pq k3v2 (the `codec` preset's codecs) and kvcomp.decompress; the engine's
record bytes and decoded values are the Python mirror's (bench/quality/codecs_ref.py
pq_engine_*) on the same basis, and the refusals are clear errors."""

import os
import struct
import sys

import numpy as np
import pytest

import kvcomp

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench", "quality"))


def _model(tokens, layers=2, heads=2, d=64, seed=0):
    """Keys and values with a steep, correlated spectrum (one random mixing per tensor)."""
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(99).standard_normal((2, d, d)).astype(np.float32) / np.sqrt(d)
    decay = (0.93 ** np.arange(d)).astype(np.float32)
    z = rng.standard_normal((2, layers, heads, tokens, d)).astype(np.float32) * decay
    k = z[0] @ mix[0] + 0.7 * (np.arange(d) % 3).astype(np.float32)
    v = z[1] @ mix[1]
    return k.astype(np.float32), v.astype(np.float32)


def _basis(blob):
    """A KVPQ basis (docs/format.md) as the mirror's dict."""
    assert blob[:4] == b"KVPQ" and blob[4] == 1
    L, H, d, bits = struct.unpack_from("<4I", blob, 8)
    at, heads = 32, L * H
    mean, scale, inv, basis, widths = [], [], [], [], []
    for _ in range(heads):
        for out, n in ((mean, d), (scale, d), (inv, d), (basis, d * d)):
            out.append(np.frombuffer(blob, "<f4", n, at))
            at += 4 * n
        widths.append(np.frombuffer(blob, np.uint8, d, at))
        at += d
    assert at == len(blob)
    return {"num_layers": L, "num_kv_heads": H, "bits_total": bits,
            "mean": np.array(mean), "scale": np.array(scale), "inv_scale": np.array(inv),
            "basis": np.array(basis).reshape(heads, d, d), "widths": np.array(widths)}


def _k3v2(**kw):
    return kvcomp.Policy(**{**dict(ratio=0.0, moments=False, key_codec="pq", value_codec="pq",
                                   key_bits=3, value_bits=2), **kw})


def _section(blob, want):
    """Bytes of section `want` of an encoded cache (docs/format.md: the table at byte 128)."""
    (n,) = struct.unpack_from("<I", blob, 52)
    for i in range(n):
        sid, _, off, size = struct.unpack_from("<IIQQ", blob, 128 + 32 * i)
        if sid == want:
            return blob[off:off + size]
    raise KeyError(want)


def test_pq_needs_a_calibration_at_its_bits():
    p = _k3v2()
    k, v = _model(64)
    with pytest.raises(RuntimeError, match="calibrate_pq"):
        kvcomp.compress(k, v, p)
    cal = kvcomp.calibrate_pq(*_model(256, seed=1))
    with pytest.raises(RuntimeError, match="key_bits 4"):
        kvcomp.compress(k, v, _k3v2(key_bits=4), pq=cal)
    with pytest.raises(ValueError, match="one calibration"):
        kvcomp.Policy(key_codec="pq", value_codec="orthogonal_int8")
    with pytest.raises(ValueError, match="key_bits"):
        kvcomp.Policy(key_codec="pq", key_bits=9)
    with pytest.raises(ValueError):
        kvcomp.calibrate_pq(k, v[:, :, :10])


def test_engine_bytes_and_decode_are_the_mirrors():
    codecs_ref = pytest.importorskip("codecs_ref")  # imports torch
    cal = kvcomp.calibrate_pq(*_model(384, seed=1), model_id="synthetic")
    assert (cal.key_bits, cal.value_bits, cal.num_layers, cal.num_kv_heads, cal.head_dim) == (
        3, 2, 2, 2, 64)
    kb, vb = _basis(cal.key_basis), _basis(cal.value_basis)
    assert codecs_ref.pq_basis_bytes(kb)[1] == cal.key_fingerprint
    assert codecs_ref.pq_basis_bytes(vb)[1] == cal.value_fingerprint
    k, v = _model(96, seed=2)
    for ratio in (0.0, 0.5):
        c = kvcomp.compress(k, v, _k3v2(ratio=ratio), pq=cal)
        info = kvcomp.cache_codecs(c)
        assert (info["key_codec"], info["value_codec"]) == ("pq", "pq")
        assert info["projection_version"] == cal.version
        assert (info["pq_key_bits"], info["pq_value_bits"]) == (192, 128)
        assert (info["pq_key_basis"], info["pq_value_basis"]) == (cal.key_fingerprint,
                                                                 cal.value_fingerprint)
        blob = c.to_bytes()
        back = kvcomp.CompressedCache.from_bytes(blob)
        keys, values = _section(blob, 4), _section(blob, 6)
        offsets = np.concatenate([[0], np.cumsum(c.kept)])
        dk, dv = kvcomp.decompress(back, pq=cal)
        for layer in range(2):
            for head in range(2):
                h = layer * 2 + head
                pos = np.asarray(c.kept_positions(layer, head))
                a, b = offsets[h], offsets[h + 1]
                # the engine's records (the cache's keys and values sections) are the mirror's
                rk = codecs_ref.pq_engine_encode(kb, h, k[layer, head][pos])
                rv = codecs_ref.pq_engine_encode(vb, h, v[layer, head][pos])
                assert keys[a * 24:b * 24] == rk.tobytes(), (ratio, h)
                assert values[a * 16:b * 16] == rv.tobytes(), (ratio, h)
                # the engine's decode is the mirror's, f32 bit for bit
                yk = codecs_ref.pq_engine_decode(kb, h, rk)
                yv = codecs_ref.pq_engine_decode(vb, h, rv)
                np.testing.assert_array_equal(dk[layer, head], yk)
                np.testing.assert_array_equal(dv[layer, head], yv)
        if ratio == 0:
            assert 0.05 < np.linalg.norm(dv - v) / np.linalg.norm(v) < 0.5  # 2 bits: lossy


def test_decoding_needs_the_calibration_the_cache_names():
    cal = kvcomp.calibrate_pq(*_model(256, seed=1))
    other = kvcomp.calibrate_pq(*_model(256, seed=5))
    k, v = _model(64, seed=2)
    c = kvcomp.compress(k, v, _k3v2(), pq=cal)
    with pytest.raises(KeyError):
        kvcomp.decompress(c)
    with pytest.raises(KeyError):
        kvcomp.decompress(c, pq=other)
    again = kvcomp.PqCalibration.from_bytes(cal.to_bytes())
    assert again.version == cal.version
    dk, _ = kvcomp.decompress(c, pq=again)
    assert dk.shape == (2, 2, 64, 64)
    blob = bytearray(cal.to_bytes())
    blob[len(blob) // 2] ^= 1
    with pytest.raises(ValueError):
        kvcomp.PqCalibration.from_bytes(bytes(blob))


def test_the_stored_bytes_are_6x_fewer_than_bf16():
    cal = kvcomp.calibrate_pq(*_model(256, seed=1))
    k, v = _model(512, d=64, seed=3)
    c = kvcomp.compress(k, v, _k3v2(), pq=cal)
    bf16 = k.size * 2 * 2
    # k3v2 is 6.4x of bf16 per row; headers and positions take a little at 512 tokens
    assert 5.0 < bf16 / c.nbytes < 6.4


def test_a_cuda_backend_encodes_and_decodes_pq_as_the_cpu():
    if not kvcomp.cuda_available():
        pytest.skip("no CUDA device")
    cal = kvcomp.calibrate_pq(*_model(256, seed=1))
    k, v = _model(64, seed=2)
    for ratio in (0.0, 0.5):  # the streaming scorer: both backends keep the same tokens
        gpu = kvcomp.compress(k, v, _k3v2(ratio=ratio, scorer="streaming"), backend="cuda",
                              pq=cal)
        cpu = kvcomp.compress(k, v, _k3v2(ratio=ratio, scorer="streaming"), pq=cal)
        assert list(gpu.kept) == list(cpu.kept), ratio
        for section in (4, 6):  # keys, values
            assert _section(gpu.to_bytes(), section) == _section(cpu.to_bytes(), section), ratio
        gk, gv = kvcomp.decompress(cpu, pq=cal, backend="cuda")
        ck, cv = kvcomp.decompress(cpu, pq=cal)
        assert np.array_equal(np.asarray(gk), np.asarray(ck)), ratio
        assert np.array_equal(np.asarray(gv), np.asarray(cv)), ratio

"""The Hadamard codec's torch mirror (bench/quality/codecs_ref.py, spec kvhq{b}) against the
engine (kvcomp.compress with key_codec/value_codec hq4, hq3): the same row records byte for byte
(read from the cache's format bytes), the same decoded values, on keys with channel outliers."""

import os
import struct
import sys

import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench", "quality"))

torch = pytest.importorskip("torch")
kvcomp = pytest.importorskip("kvcomp")
import codecs_ref  # noqa: E402


def _sections(blob):
    """{section id: bytes} of an encoded cache (docs/format.md: header, then 32-byte entries)."""
    (n,) = struct.unpack_from("<I", blob, 52)
    out = {}
    for i in range(n):
        sid, _flags, off, size = struct.unpack_from("<IIQQ", blob, 128 + 32 * i)
        out[sid] = blob[off:off + size]
    return out


def _cache(seed, layers=2, heads=2, n=96, d=128):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, n, d, generator=g)
    k[..., 7] += 12.0  # a key channel outlier, as real keys have
    v = torch.randn(layers, heads, n, d, generator=g) * 0.3
    # bf16-representable inputs, as a bf16 cache gives them
    return k.bfloat16().float(), v.bfloat16().float()


@pytest.mark.parametrize("kb,vb", [(4, 3), (3, 4), (4, 4)])
def test_mirror_records_and_decode_match_the_engine(kb, vb):
    k, v = _cache(kb * 10 + vb)
    policy = kvcomp.Policy(ratio=0.0, moments=False, key_codec=f"hq{kb}", value_codec=f"hq{vb}")
    cache = kvcomp.compress(k.numpy(), v.numpy(), policy)
    sec = _sections(cache.to_bytes())
    L, H, N, d = k.shape
    for sid, x, b in ((4, k, kb), (6, v, vb)):
        q, lo, step = codecs_ref.hq_engine_encode(x.reshape(-1, d), b)
        want = codecs_ref.hq_engine_records(q, lo, step, b)
        got = np.frombuffer(sec[sid], np.uint8).reshape(L * H * N, 4 + d * b // 8)
        assert np.array_equal(got, want), f"section {sid}: {np.argwhere(got != want)[:5]}"
    dk, dv = kvcomp.decompress(cache)
    for x, dx, b in ((k, dk, kb), (v, dv, vb)):
        q, lo, step = codecs_ref.hq_engine_encode(x.reshape(-1, d), b)
        mine = codecs_ref.hq_engine_decode(q, lo, step).reshape(x.shape)
        assert np.allclose(np.asarray(dx), mine.numpy(), rtol=0, atol=1e-5)
        # and the stored bytes codecs_ref counts are the engine's
        _, nbytes, _ = codecs_ref.encode(f"kvhq{b}", x, True)
        assert nbytes == x.numel() // d * (4 + d * b // 8)
    parts = kvcomp.cache_codecs(cache)
    assert parts["key_codec"] == f"hq{kb}" and parts["value_codec"] == f"hq{vb}"


def test_mirror_rounds_lo_down_and_step_up():
    x = torch.tensor([[0.1, -0.3, 0.7, 0.2, -0.9, 0.05, 0.33, -0.01]])
    q, lo, step = codecs_ref.hq_engine_encode(x, 3)
    d = 8
    y = codecs_ref.hq_fwht(x * codecs_ref.hq_signs(d)) * torch.tensor(d ** -0.5)
    assert float(lo) <= float(y.min())
    assert float(lo) + 7 * float(step) >= float(y.max())
    assert int(q.min()) >= 0 and int(q.max()) <= 7

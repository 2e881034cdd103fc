"""The calibrated basis codec's Python mirror (bench/quality/codecs_ref.py pq_engine_*) against
the engine's CPU reference (codecs/src/pq.cc): the fixed basis and rows of
tests/codecs/pq_test.cc, generated here by the same generator, give the same basis fingerprint,
the same record bytes and the same decoded f32 bits (the digests and hex the C++ test asserts);
and the mirror's codebook is the measured suite's (lloyd_max rounded to f32)."""

import os
import sys

import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench", "quality"))

pytest.importorskip("torch")  # codecs_ref imports it
import codecs_ref  # noqa: E402

M64 = (1 << 64) - 1


class Lcg:
    def __init__(self, s=0x853c49e6748fea9b):
        self.s = s

    def next(self):
        self.s = (self.s * 6364136223846793005 + 1442695040888963407) & M64
        return self.s >> 40

    def val(self):  # exact in f32: a 24-bit integer over 2^20
        return np.float32((self.next() - 8388608) / 1048576.0)


def fixture_basis():
    w = [[8, 7, 6, 5, 4, 3, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0],
         [5, 5, 5, 5, 4, 4, 3, 3, 2, 1, 0, 0, 0, 0, 0, 0]]
    g = Lcg()
    basis, mean, scale, widths = [], [], [], []
    for h in range(2):
        basis.append([[g.val() / np.float32(16) for _ in range(16)] for _ in range(16)])
        mean.append([g.val() / np.float32(64) for _ in range(16)])
        scale.append([np.float32((32 + (g.next() & 15)) / 32.0) * np.float32(2.0 ** -(c // 4))
                      for c in range(16)])
        widths.append(w[h])
    scale = np.array(scale, np.float32)
    return {"num_layers": 1, "num_kv_heads": 2, "bits_total": 37,
            "basis": np.array(basis, np.float32), "mean": np.array(mean, np.float32),
            "scale": scale, "inv_scale": (np.float32(1) / scale).astype(np.float32),
            "widths": np.array(widths, np.uint8)}


def fixture_rows(rows, d):
    g = Lcg(0x2545f4914f6cdd1d)
    return np.array([g.val() / np.float32(16) for _ in range(rows * d)],
                    np.float32).reshape(rows, d)


def fnv(b):
    h = 0xcbf29ce484222325
    for x in bytes(b):
        h = ((h ^ x) * 0x100000001b3) & M64
    return f"{h:016x}"


def test_mirror_gives_the_engines_fixed_records():
    b = fixture_basis()
    _, fp = codecs_ref.pq_basis_bytes(b)
    assert f"{fp:016x}" == "b3bcc5cbbb90ab87"
    x = fixture_rows(64, 16)
    recs = [codecs_ref.pq_engine_encode(b, h, x) for h in range(2)]
    assert all(r.shape == (64, 5) for r in recs)
    assert recs[0][:2].tobytes().hex() == "82c04fa61a76cdb8e512"
    assert recs[1][:2].tobytes().hex() == "ef3da9b7194caa875716"
    assert fnv(np.concatenate(recs).tobytes()) == "c5099cbb23545517"
    ys = [codecs_ref.pq_engine_decode(b, h, recs[h]) for h in range(2)]
    assert fnv(np.concatenate(ys).astype("<f4").tobytes()) == "9902d5a8afbd93b8"
    # the fixture exercises the codebooks: interior codes at every width of 2 bits or more
    for h in range(2):
        bits = np.unpackbits(recs[h], axis=1, bitorder="little").astype(np.int64)
        off = 0
        for w in b["widths"][h]:
            w = int(w)
            if w == 0:
                continue
            code = sum(bits[:, off + i] << i for i in range(w))
            off += w
            if w >= 2:
                assert ((code > 0) & (code < 2 ** w - 1)).any(), (h, w)
        assert not bits[:, off:].any()  # padding bits zero


def test_the_engines_codebook_is_the_measured_one():
    cents, bounds = codecs_ref.pq_codebooks()
    for w in range(1, 9):
        assert np.array_equal(cents[w], np.float32(codecs_ref.lloyd_max(w)))
        assert len(bounds[w]) == 2 ** w - 1 and np.all(np.diff(cents[w]) > 0)


def test_mirror_round_trip_on_a_fitted_basis():
    """The suite's calibration (codecs_ref.pca_calibrate) as an engine basis: the mirror's
    records decode to within the water-filling error, and record bytes are exactly bits x d / 8."""
    import torch
    g = torch.Generator().manual_seed(3)
    d, n = 32, 2000
    R = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    sd = 3.0 * 0.85 ** torch.arange(d, dtype=torch.float32)
    X = ((torch.randn(1, 1, n, d, generator=g) * sd) @ R.T + 0.5).float()
    codecs_ref.pca_calibrate([X], [X])
    st = codecs_ref._PCA["K"]
    w = codecs_ref.pca_widths(st["sd"], 2 * d)[0, 0].numpy().astype(np.uint8)
    s = st["sd"][0, 0].numpy().astype(np.float32)
    b = {"num_layers": 1, "num_kv_heads": 1, "bits_total": 2 * d,
         "basis": st["U"][0, 0].T.numpy()[None].astype(np.float32),
         "mean": st["mu"][0, 0].numpy()[None].astype(np.float32), "scale": s[None],
         "inv_scale": (np.float32(1) / s)[None], "widths": w[None]}
    x = X[0, 0].numpy()
    rec = codecs_ref.pq_engine_encode(b, 0, x)
    assert rec.shape == (n, 2 * d // 8)
    y = codecs_ref.pq_engine_decode(b, 0, rec)
    predicted = float((s.astype(np.float64) ** 2 *
                       [codecs_ref._lm_mse(int(v)) for v in w]).sum())
    err = float(((y - x) ** 2).sum(1).mean())
    assert err < 1.3 * predicted
    # the suite's float mirror decodes the same cache to nearly the same values
    yt, nbytes, _ = codecs_ref.encode("pca2", X, True)
    assert nbytes == n * 2 * d // 8
    assert np.abs(yt[0, 0].numpy() - y).max() < 1e-3 * np.abs(x).max()

"""fp8 (e4m3) KV input with its scales: kvcomp.compress takes float8_e4m3fn keys and values with
k_scale and v_scale; at ratio 0 with raw codecs the decoded cache quantized back with the same
scales is the input, byte for byte; with eviction it runs. On CUDA as well where a GPU is
present."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcomp  # noqa: E402
from kvcomp.layouts import dequantize_fp8  # noqa: E402
from kvcompd_fixture import Kvcompd, built_kvcompd  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and kvcomp.cuda_available() else [])
L, H, N, D = 2, 4, 96, 128


def fp8_cache(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(L, H, N, D, generator=g) * 3).to(torch.float8_e4m3fn)
    v = (torch.randn(L, H, N, D, generator=g) * 3).to(torch.float8_e4m3fn)
    return k.to(device), v.to(device), 0.0173, torch.tensor([0.5, 0.25, 1.5, 3.0])[:, None, None]


def test_e4m3_table_is_torchs():
    bits = torch.arange(256, dtype=torch.uint8)
    want = bits.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    got = dequantize_fp8(bits.numpy())
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])
    s = np.float32(0.0173)
    np.testing.assert_array_equal(dequantize_fp8(bits.numpy(), s)[ok],
                                  (bits.view(torch.float8_e4m3fn).float() * s).numpy()[ok])


@pytest.mark.parametrize("device", DEVICES)
def test_ratio_zero_round_trips_the_fp8_bytes(device):
    k, v, ks, vs = fp8_cache(device)
    vs = vs.to(device)
    cc = kvcomp.compress(k, v, kvcomp.Policy(ratio=0.0, moments=False),
                         backend="cuda" if device == "cuda" else "cpu", k_scale=ks, v_scale=vs,
                         num_q_heads=2 * H)
    assert cc.dtype == "f32" and cc.kept == [N] * (L * H)
    dk, dv = kvcomp.decompress(cc)
    back_k = (torch.from_numpy(dk) / ks).to(torch.float8_e4m3fn)
    back_v = (torch.from_numpy(dv) / vs.cpu()).to(torch.float8_e4m3fn)
    assert torch.equal(back_k.view(torch.uint8), k.cpu().view(torch.uint8))
    assert torch.equal(back_v.view(torch.uint8), v.cpu().view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_runs_on_fp8(device):
    k, v, ks, vs = fp8_cache(device, 1)
    backend = "cuda" if device == "cuda" else "cpu"
    for pol, raw in ((kvcomp.Policy(scorer="keydiff", ratio=0.5), True),
                     (kvcomp.Policy(scorer="knorm", ratio=0.75, key_codec="int8"), False)):
        cc = kvcomp.compress(k, v, pol, backend=backend, k_scale=ks, v_scale=vs.to(device),
                             num_q_heads=H)
        assert sum(cc.kept) == pol.kept_per_head(N) * L * H
        # the kept set and rows are what the dequantized float32 cache keeps. On CUDA the
        # moment sums are accumulated with float atomics, whose order differs between launches,
        # so the whole caches are compared only on the CPU.
        f = kvcomp.compress(dequantize_fp8(k, ks), dequantize_fp8(v, vs.to(device)), pol,
                            backend=backend, num_q_heads=H)
        for layer in range(L):
            for head in range(H):
                np.testing.assert_array_equal(cc.kept_positions(layer, head),
                                              f.kept_positions(layer, head))
                if raw:  # encoded keys are compared through the whole caches below
                    np.testing.assert_array_equal(cc.keys(layer, head), f.keys(layer, head))
                    np.testing.assert_array_equal(cc.values(layer, head), f.values(layer, head))
        if device == "cpu":
            assert cc == f


def test_fp8_without_scales_is_an_error():
    k, v, ks, vs = fp8_cache("cpu")
    with pytest.raises(ValueError, match="scales"):
        kvcomp.compress(k, v, kvcomp.Policy())
    with pytest.raises(ValueError, match="fp8"):
        kvcomp.compress(k.float(), v.float(), kvcomp.Policy(), k_scale=1.0, v_scale=1.0)


@pytest.mark.skipif(built_kvcompd() is None, reason="kvcompd not built")
def test_put_of_fp8_through_kvcompd():
    k, v, ks, vs = fp8_cache("cpu", 2)
    try:
        with Kvcompd(built_kvcompd()) as d:
            c = kvcomp.Client(f"{d.data_endpoint},127.0.0.1:{d.control_port}", timeout=60.0)
            res = c.put("test/fp8", "seq", k, v, policy=kvcomp.Policy(ratio=0.0, moments=False),
                        num_q_heads=H, k_scale=ks, v_scale=vs)
            assert res["original_bytes"] == 2 * L * H * N * D * 4  # sent as float32
            dk, dv = kvcomp.decompress(c.get("test/fp8", "seq"))
            assert torch.equal((torch.from_numpy(dk) / ks).to(torch.float8_e4m3fn)
                               .view(torch.uint8), k.view(torch.uint8))
            assert torch.equal((torch.from_numpy(dv) / vs).to(torch.float8_e4m3fn)
                               .view(torch.uint8), v.view(torch.uint8))
            with pytest.raises(ValueError, match="scales"):
                c.put("test/fp8", "other", k, v)
    except NotImplementedError:  # a core-only build has no client
        pytest.skip("this kvcomp build has no client")

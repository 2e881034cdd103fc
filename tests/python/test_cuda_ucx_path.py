"""The Python SDK's device path over CUDA-aware UCX (docs/protocol.md, "CUDA-aware UCX"): torch
CUDA tensors from this process on GPU 0 into a real kvcompd on the last GPU (the other one where
there are two) with the GPU channel turned off, so the payload goes over UCX straight out of and
into device memory, and back bit for bit under a lossless policy. Runs where the UCX that both
processes load has CUDA transports (KVCOMP_TEST_CUDA_UCX=1, set by bench/cuda_ucx/run.sh, which
carries UCX 1.22); skipped elsewhere."""

import os

import pytest

import kvcomp
from kvcompd_fixture import Kvcompd, built_kvcompd

torch = pytest.importorskip("torch")

KVCOMPD = built_kvcompd()
pytestmark = [
    pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(os.environ.get("KVCOMP_TEST_CUDA_UCX") != "1",
                       reason="needs a CUDA-aware UCX (KVCOMP_TEST_CUDA_UCX=1)"),
]

LAYERS, KV, N, D = 4, 8, 1000, 128


@pytest.fixture(scope="module")
def setup():
    device = torch.cuda.device_count() - 1
    flags = [f"--engine.cuda_device={device}", "--storage.durability=memory",
             "--data_plane.gpu_channel=false"]
    with Kvcompd(KVCOMPD, flags=flags) as d:
        c = kvcomp.Client(f"{d.data_endpoint},127.0.0.1:{d.control_port}", timeout=60.0)
        yield c, d, device


def _cache(seed):
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    k = torch.randn((LAYERS, KV, N, D), generator=g, device="cuda:0").to(torch.bfloat16)
    v = torch.randn((LAYERS, KV, N, D), generator=g, device="cuda:0").to(torch.bfloat16)
    return k, v


def test_torch_tensors_round_trip_over_cuda_ucx(setup):
    c, d, device = setup
    lossless = kvcomp.Policy(ratio=0.0, moments=False)
    expect_k, expect_v = _cache(7)
    torch.cuda.synchronize()
    # Written on the producer's stream behind a long queue of work and handed over at once.
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)
        k = expect_k * 1
        v = expect_v * 1
        r = c.put_device("m", "k", k, v, policy=lossless)
    assert r["path"] == "ucx-cuda", d.log()
    assert r["original_bytes"] == 2 * k.numel() * 2
    print(f"daemon on GPU {device}: put path {r['path']}")
    # The dense K/V back into fresh tensors, on the caller's stream: the lossless cache is read
    # as stored into device memory over UCX and its sections copied into the tensors.
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    g = c.get_into("m", "k", k2, v2)
    assert g["path"] == "ucx-cuda"
    assert torch.equal(k2, expect_k) and torch.equal(v2, expect_v)
    # The stored bytes straight into device memory over UCX.
    out = torch.zeros(int(r["stored_bytes"]) + 4096, dtype=torch.uint8, device="cuda:0")
    b = c.get_bytes_into("m", "k", out)
    assert b["path"] == "ucx-cuda"
    assert b["bytes"] == int(r["stored_bytes"])
    if hasattr(c, "get_bytes"):
        assert bytes(out[: b["bytes"]].cpu().numpy().tobytes()) == bytes(c.get_bytes("m", "k"))
    # A key that is not there: an error, never bytes (tenant isolation on this path is checked
    # against an authenticating kvcompd in tests/integration/cuda_ucx_daemon_test.cc).
    with pytest.raises(Exception):
        c.get_bytes_into("m", "missing", out)


if __name__ == "__main__":
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-v", "-s"]))

"""The Python SDK's device path from torch CUDA tensors into real kvcompd processes (GPU
machines; skipped without CUDA): put_device / get_into / get_bytes_into and the layer-by-layer
calls, bit for bit under a lossless policy, over CUDA IPC to a daemon on the caller's GPU and
over NCCL to a daemon on a second GPU when there is one. The stream-order regression: tensors
still being written on the producer's stream behind a long queue of work are handed over at once
and the results are right; a long kernel on an unrelated stream does not hold the call (no
device-wide synchronisation)."""

import os
import time

import pytest

import kvcomp
from kvcompd_fixture import Kvcompd, built_kvcompd

torch = pytest.importorskip("torch")

KVCOMPD = built_kvcompd()
pytestmark = [
    pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

LAYERS, KV, N, D = 4, 8, 1000, 128
LOSSLESS = None  # set in the fixtures (kvcomp.Policy needs the extension)


def _daemon_flags(device):
    return [f"--engine.cuda_device={device}", "--storage.durability=memory",
            "--data_plane.gpu_transfer_timeout_seconds=30"]


_RATE = []


def _cycles(seconds):
    """Clock cycles of torch.cuda._sleep for about `seconds` (the rate measured once)."""
    if not _RATE:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(100_000_000)
        end.record()
        end.synchronize()
        _RATE.append(100_000_000 / (start.elapsed_time(end) / 1e3))
    return int(seconds * _RATE[0])


@pytest.fixture(scope="module", params=["same-gpu", "other-gpu"])
def setup(request):
    global LOSSLESS
    LOSSLESS = kvcomp.Policy(ratio=0.0, moments=False)
    if request.param == "other-gpu" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    device = 0 if request.param == "same-gpu" else 1
    env = {"NCCL_NVLS_ENABLE": "0"}
    with Kvcompd(KVCOMPD, flags=_daemon_flags(device), env=env) as d:
        c = kvcomp.Client(f"{d.data_endpoint},127.0.0.1:{d.control_port}", timeout=60.0)
        yield c, d, ("ipc" if device == 0 else "nccl")


def _cache(seed):
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    k = torch.randn((LAYERS, KV, N, D), generator=g, device="cuda:0").to(torch.bfloat16)
    v = torch.randn((LAYERS, KV, N, D), generator=g, device="cuda:0").to(torch.bfloat16)
    return k, v


def test_round_trip_is_bit_identical(setup):
    c, d, path = setup
    k, v = _cache(1)
    r = c.put_device("m", "k", k, v, policy=LOSSLESS)
    assert r["path"] == path, d.log()
    assert r["original_bytes"] == 2 * k.numel() * 2
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    g = c.get_into("m", "k", k2, v2)
    assert g["path"] == path
    assert torch.equal(k2, k) and torch.equal(v2, v)
    stored = c.get_bytes("m", "k") if hasattr(c, "get_bytes") else None
    out = torch.zeros(int(r["stored_bytes"]) + 4096, dtype=torch.uint8, device="cuda:0")
    b = c.get_bytes_into("m", "k", out)
    assert b["path"] == path
    if stored is not None:
        assert bytes(out[: b["bytes"]].cpu().numpy().tobytes()) == bytes(stored)
    with pytest.raises(Exception):
        c.get_bytes_into("m", "k", torch.zeros(16, dtype=torch.uint8, device="cuda:0"))
    st = c.gpu_stats()
    assert st[f"{path}_puts"] >= 1 and st[f"{path}_gets"] >= 2
    assert st["fallback_puts"] == 0 and st["fallback_gets"] == 0


def test_tensors_still_being_written_on_the_producers_stream(setup):
    # The producer's stream has a long queue of work; the tensors are written behind it and
    # handed over at once, without any synchronisation by the caller.
    c, _, path = setup
    expect_k, expect_v = _cache(2)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(_cycles(0.5))
        k = expect_k * 1  # written on the producer's stream, after the sleep
        v = expect_v * 1
        r = c.put_device("m", "queued", k, v, policy=LOSSLESS)
    assert r["path"] == path
    # And a get into tensors the producer's stream still reads from: written after that work.
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(_cycles(0.3))
        c.get_into("m", "queued", k2, v2)
        same = torch.equal(k2, expect_k) and torch.equal(v2, expect_v)  # on the producer's stream
    assert same


def test_a_long_kernel_on_an_unrelated_stream_does_not_hold_the_call(setup):
    c, _, path = setup
    k, v = _cache(3)
    torch.cuda.synchronize()
    other = torch.cuda.Stream()
    busy_seconds = 3.0
    with torch.cuda.stream(other):
        torch.cuda._sleep(_cycles(busy_seconds))
    t0 = time.monotonic()
    r = c.put_device("m", "unrelated", k, v, policy=LOSSLESS)
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    c.get_into("m", "unrelated", k2, v2)
    elapsed = time.monotonic() - t0
    busy_left = not other.query()
    torch.cuda.synchronize()
    assert r["path"] == path
    assert torch.equal(k2, k) and torch.equal(v2, v)
    # The kernel was still running when both calls had returned: they did not wait for it.
    print(f"put+get with a {busy_seconds} s kernel on another stream: {elapsed:.3f} s "
          f"(kernel still running: {busy_left})")
    assert busy_left, f"the calls took {elapsed:.3f} s: they waited for an unrelated kernel"


def test_layer_by_layer(setup):
    c, d, path = setup
    k, v = _cache(4)
    torch.cuda.synchronize()
    with c.put_device_stream("m", "layers", layers=LAYERS, kv_heads=KV, head_dim=D, tokens=N,
                             dtype="bf16", policy=LOSSLESS) as s:
        assert s.path == path
        for layer in range(LAYERS):
            s.append_layer(layer, k[layer], v[layer])
        r = s.commit()
    assert r["path"] == path, d.log()
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    seen = []
    with c.get_layers("m", "layers", k2, v2) as g:
        for layer in g:  # torch's current stream waits for each layer on the device
            seen.append(torch.equal(k2[layer], k[layer]) and torch.equal(v2[layer], v[layer]))
    assert seen == [True] * LAYERS
    # Leaving the block without commit stores nothing.
    with c.put_device_stream("m", "abandoned", layers=LAYERS, kv_heads=KV, head_dim=D, tokens=N,
                             dtype="bf16", policy=LOSSLESS) as s:
        s.append_layer(0, k[0], v[0])
    with pytest.raises(Exception):
        c.get_into("m", "abandoned", k2, v2)
    with pytest.raises(Exception):
        with c.put_device_stream("m", "wrong", layers=LAYERS, kv_heads=KV, head_dim=D,
                                 tokens=N, dtype="bf16") as s:
            s.append_layer(1, k[1], v[1])  # out of order


if __name__ == "__main__":
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-v"]))

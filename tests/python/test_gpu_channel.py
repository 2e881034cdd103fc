"""The Python SDK's device path against a real kvcompd where no GPU is: the GPU channel's
negotiation says why it cannot be had, host arrays are refused by the device calls (and still
go through put()), and the counters are there. Transfers from CUDA tensors run on GPU machines
(tests/client/gpu_channel_gpu_test.cc covers the SDK underneath)."""


import numpy as np
import pytest

import kvcomp
from kvcompd_fixture import Kvcompd, built_kvcompd

KVCOMPD = built_kvcompd()
pytestmark = pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")

LAYERS, KV, D, N = 2, 2, 64, 32


class FakeCudaArray:
    """Reports CUDA memory through DLPack (as a torch CUDA tensor does) and records the stream
    the SDK asks the producer to order itself on."""

    def __init__(self):
        self.asked_stream = None

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        self.asked_stream = stream
        raise BufferError("no device memory here")


@pytest.fixture(scope="module")
def daemon():
    with Kvcompd(KVCOMPD, env={"KVCOMP_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"}) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return kvcomp.Client(f"{daemon.data_endpoint},127.0.0.1:{daemon.control_port}", timeout=30.0)


def _cuda_device_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_negotiation_says_why_there_is_no_gpu_channel(client, daemon):
    why = client.probe_gpu_channel(daemon.data_endpoint, 0)
    if _cuda_device_present():
        # A client on the daemon's own GPU gets the CUDA IPC channel, which needs no NCCL.
        assert why is None, why
        return
    assert why is not None
    assert "NCCL" in why or "CUDA" in why
    assert "no GPU channel" in daemon.log()


def test_device_calls_refuse_host_arrays(client):
    k = np.zeros((LAYERS, KV, N, D), np.float16)
    with pytest.raises(ValueError, match="CUDA array"):
        client.put_device("m", "k", k, k)
    with pytest.raises(ValueError, match="CUDA array"):
        client.get_into("m", "k", k, k)
    with pytest.raises(ValueError, match="CUDA array"):
        client.get_bytes_into("m", "k", np.zeros(1024, np.uint8))


def test_cuda_arrays_are_imported_ordered_on_the_calls_stream(client):
    # The SDK asks the producer for its data on the call's stream (DLPack's stream argument: 1
    # names the legacy default stream, an explicit stream is passed through).
    a = FakeCudaArray()
    with pytest.raises(BufferError):
        client.put_device("m", "k", a, a)
    assert a.asked_stream == 1
    b = FakeCudaArray()
    with pytest.raises(BufferError):
        client.put("m", "k", b, b, )  # put() hands CUDA arrays to put_device
    assert b.asked_stream == 1
    c = FakeCudaArray()
    with pytest.raises(BufferError):
        client.get_into("m", "k", c, c, stream=12345)
    assert c.asked_stream == 12345


def test_host_puts_are_unchanged_and_counters_start_at_zero(client):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((LAYERS, KV, N, D)).astype(np.float16)
    v = rng.standard_normal((LAYERS, KV, N, D)).astype(np.float16)
    r = client.put("m", "host", k, v, policy=kvcomp.Policy(ratio=0.0, moments=False))
    assert "path" not in r
    stats = client.gpu_stats()
    assert stats["nccl_puts"] == 0 and stats["fallback_puts"] == 0
    assert set(stats) >= {"nccl_gets", "fallback_gets", "channels_opened", "channel_failures",
                          "last_fallback_reason"}


class PinnedHostArray(np.ndarray):
    """Host memory that DLPack reports as pinned (kDLCUDAHost), as a torch tensor made with
    pin_memory=True does."""

    def __dlpack_device__(self):
        return (3, 0)


def test_pinned_host_memory_is_put_as_host_memory(client):
    rng = np.random.default_rng(1)
    k = rng.standard_normal((LAYERS, KV, N, D)).astype(np.float16).view(PinnedHostArray)
    v = rng.standard_normal((LAYERS, KV, N, D)).astype(np.float16).view(PinnedHostArray)
    assert k.__dlpack_device__() == (3, 0)
    r = client.put("m", "pinned", k, v, policy=kvcomp.Policy(ratio=0.0, moments=False))
    assert r["original_bytes"] == k.nbytes + v.nbytes
    assert "path" not in r  # the host path, not put_device


def test_layer_by_layer_calls_need_cuda(client):
    # Without a CUDA driver the put stream says so; with one it opens (and is closed unused).
    # Either way the layered get refuses host arrays.
    if kvcomp.cuda_available():
        with client.put_device_stream("m", "k", layers=LAYERS, kv_heads=KV, head_dim=D, tokens=N,
                                      dtype="f16") as s:
            assert s.path in ("ipc", "ucx")  # no NCCL library in this fixture
    else:
        with pytest.raises(Exception, match="CUDA"):
            client.put_device_stream("m", "k", layers=LAYERS, kv_heads=KV, head_dim=D, tokens=N,
                                     dtype="f16")
    k = np.zeros((LAYERS, KV, N, D), np.float16)
    with pytest.raises(ValueError, match="CUDA array"):
        client.get_layers("m", "k", k, k)
    a = FakeCudaArray()
    with pytest.raises(BufferError):
        client.get_layers("m", "k", a, a, stream=777)
    assert a.asked_stream == 777
    stats = client.gpu_stats()
    assert stats["ipc_puts"] == 0 and stats["ipc_gets"] == 0

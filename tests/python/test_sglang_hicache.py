"""kvcompd as SGLang's HiCache storage backend (kvcomp.integrations.sglang), against sglang's own
classes on CPU: the backend made by sglang's StorageBackendFactory ("dynamic", from the extra
config), a real MHATokenToKVPoolHost over a real MHATokenToKVPool on the CPU device, and pages
moved by HiCacheController's own generic page set/get paths; real kvcompd on loopback. Runs
where sglang is installed (scripts/test_sglang.sh)."""

import os
import signal
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvcompd_fixture import Kvcompd, built_kvcompd, sigstop  # noqa: E402


def _sglang():
    try:
        import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
        return True
    except Exception:
        return False


KVCOMPD = built_kvcompd()
pytestmark = [pytest.mark.skipif(not _sglang(), reason="sglang not installed "
                                 "(scripts/test_sglang.sh)"),
              pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")]

LAYERS, HEADS, D, PAGE = 3, 2, 64, 16


@pytest.fixture(scope="module")
def daemon():
    d = Kvcompd(KVCOMPD)
    d.__enter__()
    yield d
    if d.proc is not None and d.proc.poll() is None:
        os.kill(d.proc.pid, signal.SIGCONT)
    d.__exit__(None, None, None)


def host_pool(layout="layer_first", seed=0):
    """SGLang's host KV pool (MHA) over its device pool, both on the CPU, filled at random."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(size=64, page_size=PAGE, dtype=torch.float16, head_num=HEADS,
                           head_dim=D, layer_num=LAYERS, device="cpu",
                           enable_memory_saver=False, enable_alt_stream=False)
    host = MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=64, start_layer=0,
                                end_layer=LAYERS)
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.dtype))
    return host


def backend(d, host, tp_rank=0, tp_size=1, **opts):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvcomp.integrations.sglang import HiCacheKvcomp

    extra = {"backend_name": "kvcomp", "module_path": "kvcomp.integrations.sglang",
             "class_name": "HiCacheKvcomp",
             "endpoints": [f"{d.data_endpoint},127.0.0.1:{d.control_port}"], **opts}
    cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                               attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                               enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="test/sglang", extra_config=extra)
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(b, HiCacheKvcomp)
    b.register_mem_pool_host(host)  # as HiCacheController does
    return b


def controller(b, host):
    """The state HiCacheController's generic page paths read."""
    return SimpleNamespace(storage_backend=b, storage_host_pool=host, page_size=PAGE)


def page_set(b, host, hashes, first_token):
    from sglang.srt.managers.cache_controller import HiCacheController

    idx = torch.arange(first_token, first_token + len(hashes) * PAGE)
    return HiCacheController._generic_page_set(controller(b, host), hashes, idx)


def page_get(b, host, hashes, first_token):
    from sglang.srt.managers.cache_controller import HiCacheController

    op = SimpleNamespace(request_id="r", is_terminated=lambda: False)
    idx = torch.arange(first_token, first_token + len(hashes) * PAGE)
    return HiCacheController._generic_page_get(controller(b, host), op, hashes, idx)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_stored_and_prefetched_into_another_host_pool(daemon, layout):
    a = host_pool(layout, 1)
    ba = backend(daemon, a, codec="lossless", model=f"test/sglang-{layout}")
    hashes = [f"{layout}-page-{i}" for i in range(3)]
    assert page_set(ba, a, hashes, PAGE)  # pages at tokens 16..63
    assert ba.batch_exists(hashes) == 3 and ba.batch_exists(hashes + ["none"]) == 3
    b = host_pool(layout, 2)
    bb = backend(daemon, b, codec="lossless", model=f"test/sglang-{layout}")
    assert bb.batch_exists(hashes) == 3
    assert page_get(bb, b, hashes, 4 * PAGE) == 3  # into other slots of another pool
    for i in range(3):
        assert torch.equal(b.get_data_page((4 + i) * PAGE), a.get_data_page((1 + i) * PAGE))


def test_int8_codec_within_its_error(daemon):
    a = host_pool("layer_first", 3)
    ba = backend(daemon, a, codec="int8", model="test/sglang-int8")
    assert page_set(ba, a, ["q0", "q1"], 0)
    st = ba.get_stats()
    # int8 keys: 3/4 of the page, plus kept positions, scales, header and table, which weigh
    # on a 16-token page (0.85 here)
    assert st["stored_bytes"] < 0.9 * st["original_bytes"]
    b = host_pool("layer_first", 4)
    bb = backend(daemon, b, codec="int8", model="test/sglang-int8")
    assert page_get(bb, b, ["q0", "q1"], 2 * PAGE) == 2
    for i in range(2):
        x = a.get_data_page(i * PAGE, flat=False).float()
        y = b.get_data_page((2 + i) * PAGE, flat=False).float()
        assert torch.equal(x[1], y[1])  # values as they were
        err = (x[0] - y[0]).abs().max() / x[0].abs().max()
        assert 0 < err < 0.5 / 127 + 2e-3, err


def test_missing_or_corrupt_page_stops_the_prefetch(daemon):
    import kvcomp

    a = host_pool("layer_first", 5)
    ba = backend(daemon, a, codec="lossless", model="test/sglang-fail")
    hashes = ["f0", "f1", "f2"]
    assert page_set(ba, a, hashes, 0)
    c = kvcomp.Client(ba.endpoints)
    c.delete(ba.model, ba._key("f2"))
    assert ba.batch_exists(hashes) == 2
    b = host_pool("layer_first", 6)
    bb = backend(daemon, b, codec="lossless", model="test/sglang-fail")
    before = b.kv_buffer.clone()

    class Flip:  # page f1's bytes altered on the way: its CRC fails
        def __getattr__(self, n):
            return getattr(c, n)

        def get_chunk_bytes(self, model, keys, decoded=False):
            out = c.get_chunk_bytes(model, keys, decoded=decoded)
            x = bytearray(out[1])
            x[len(x) // 2] ^= 1
            out[1] = bytes(x)
            return out

    bb.client = Flip()
    assert page_get(bb, b, hashes[:2], 0) == 1
    assert torch.equal(b.get_data_page(0), a.get_data_page(0))
    assert torch.equal(b.get_data_page(PAGE), before[:, :, PAGE:2 * PAGE].flatten())


def test_tp_ranks_keep_their_own_pages(daemon):
    a = host_pool("layer_first", 7)
    r0 = backend(daemon, a, tp_rank=0, tp_size=2, codec="lossless", model="test/sglang-tp")
    r1 = backend(daemon, a, tp_rank=1, tp_size=2, codec="lossless", model="test/sglang-tp")
    assert page_set(r0, a, ["t0"], 0)
    assert r0.batch_exists(["t0"]) == 1 and r1.batch_exists(["t0"]) == 0


def test_stopped_daemon_is_a_miss_within_the_lookup_timeout(daemon):
    a = host_pool("layer_first", 8)
    ba = backend(daemon, a, codec="lossless", model="test/sglang-stop", lookup_timeout=0.5)
    assert page_set(ba, a, ["s0"], 0)
    sigstop(daemon.proc)
    try:
        t0 = time.monotonic()
        n = ba.batch_exists(["s0"])
        took = time.monotonic() - t0
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert n == 0 and took < 0.5 + 1.0, took
    assert ba.batch_exists(["s0"]) == 1


def test_bad_options_are_refused(daemon):
    a = host_pool()
    with pytest.raises(ValueError, match="unknown option"):
        backend(daemon, a, compression="yes")
    with pytest.raises(ValueError, match="codec"):
        backend(daemon, a, codec="zip")

"""kvcompd as a secondary tier of vLLM's native offloading (kvcomp.integrations.vllm_offload),
against vLLM's own classes: the offloading config built by vLLM from a VllmConfig that names the
tier (build_offloading_config), the TieringOffloadingSpec made by vLLM's OffloadingSpecFactory,
its TieringOffloadingManager with the CPU primary tier and the kvcomp tier built by vLLM's
SecondaryTierFactory from module_path. Chunks written into one engine's CPU tier cascade to
kvcompd and are promoted into another engine's CPU tier; lookups answer without blocking; a
stopped daemon and a chunk that cannot be loaded are misses. Runs where vllm is installed
(scripts/test_vllm.sh)."""

import os
import signal
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcompd_fixture import Kvcompd, built_kvcompd, sigstop  # noqa: E402


def _vllm():
    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
        return True
    except Exception:
        return False


KVCOMPD = built_kvcompd()
pytestmark = [pytest.mark.skipif(not _vllm(), reason="vllm not installed (scripts/test_vllm.sh)"),
              pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")]

LAYERS, HEADS, D, BS = 2, 2, 64, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny-llama-offload")
    LlamaConfig(hidden_size=HEADS * 2 * D, intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS * 2, num_key_value_heads=HEADS, head_dim=D,
                vocab_size=1000, max_position_embeddings=4096).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def daemon():
    d = Kvcompd(KVCOMPD)
    d.__enter__()
    yield d
    if d.proc is not None and d.proc.poll() is None:
        os.kill(d.proc.pid, signal.SIGCONT)
    d.__exit__(None, None, None)


def manager(model_dir, d, dtype="float16", **tier):
    """vLLM's TieringOffloadingManager of one engine, with the kvcomp tier behind its CPU tier,
    built from the engine's configuration alone."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    tier_cfg = {"type": "KvcompSecondaryTier", "module_path": "kvcomp.integrations.vllm_offload",
                "endpoints": [f"{d.data_endpoint},127.0.0.1:{d.control_port}"],
                "head_dim": D, **tier}
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                                 skip_tokenizer_init=True, dtype=dtype, seed=0),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"spec_name": "TieringOffloadingSpec",
                                       "cpu_bytes_to_use": 64 << 20,
                                       "secondary_tiers": [tier_cfg]}),
        device_config=DeviceConfig("cpu"))
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                         FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=D,
                                           dtype=getattr(torch, dtype)))])
    spec = OffloadingSpecFactory.create_spec(build_offloading_config(vc, kcc))
    mgr = spec.get_manager()
    from kvcomp.integrations.vllm_offload import KvcompSecondaryTier

    assert type(mgr).__name__ == "TieringOffloadingManager"
    assert isinstance(mgr.secondary_tiers[0], KvcompSecondaryTier)
    return mgr


def keys_of(seed, n):
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(f"block-{seed}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


def end_step(mgr):
    from vllm.v1.kv_offload.base import ScheduleEndContext

    mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def settle(mgr, cond, limit=30.0):
    """Engine steps until cond() holds."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "the tier never finished"
        end_step(mgr)
        time.sleep(0.005)


def cpu_tier(mgr):
    """The CPU tier's buffer [chunks, bytes] (shared, no copy)."""
    return np.asarray(mgr.primary_tier.get_kv_memoryview()).view(np.uint8)


def rows(mgr, ids):
    return [cpu_tier(mgr)[int(c)].copy() for c in ids]


def store(mgr, req, keys, pages):
    """The engine's GPU->CPU copy of `pages` into fresh CPU-tier slots, then the cascade to the
    kvcomp tier; waits until the tier stored them."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=req)
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(keys, ctx)
    ids = out.store_spec.chunk_ids
    buf = cpu_tier(mgr)
    for c, p in zip(ids, pages):
        buf[int(c), :p.size] = p
    tier = mgr.secondary_tiers[0]
    before = tier.counters["stored_chunks"] + tier.counters["store_failures"]
    mgr.complete_store(keys, ctx)
    settle(mgr, lambda: tier.counters["stored_chunks"] + tier.counters["store_failures"]
           == before + len(keys) and not tier.has_pending_work())
    mgr.on_request_finished(ctx)
    return ids


def pages_of(mgr, seed, n, dtype=torch.float16):
    """Random KV pages filling a chunk slot (fp16/bf16 values of unit scale)."""
    size = mgr.secondary_tiers[0].block_size_bytes
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size // 2, generator=g).to(dtype).view(torch.uint8).numpy()
            for _ in range(n)]


def promote(mgr, req, keys, limit=30.0):
    """A later request asks for the chunks: lookups until each is a hit in the CPU tier or a
    miss; returns the results and the CPU slots of the hits."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req_id=req)
    mgr.on_new_request(ctx)
    seen, t0 = [], time.monotonic()
    while True:
        res = [mgr.lookup(k, ctx) for k in keys]
        seen.append(res)
        if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
            break
        assert time.monotonic() - t0 < limit, seen[-1]
        end_step(mgr)
        time.sleep(0.005)
    hits = [k for k, r in zip(keys, res) if r is LookupResult.HIT]
    ids = mgr.prepare_load(hits, ctx).chunk_ids if hits else []
    return res, seen, ids, ctx


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_chunks_cascade_to_kvcompd_and_load_into_another_engines_cpu_tier(model_dir, daemon,
                                                                           dtype):
    from vllm.v1.kv_offload.base import LookupResult

    model = f"test/offload-lossless-{dtype}"
    a = manager(model_dir, daemon, dtype=dtype, model=model)
    keys = keys_of(1, 4)
    pages = pages_of(a, 1, 4, getattr(torch, dtype))
    store(a, "a", keys, pages)
    tier = a.secondary_tiers[0]
    assert tier.counters["stored_chunks"] == 4 and tier.counters["store_failures"] == 0

    b = manager(model_dir, daemon, dtype=dtype, model=model)  # another engine
    res, seen, ids, ctx = promote(b, "b", keys)
    assert res == [LookupResult.HIT] * 4
    assert seen[0] == [LookupResult.RETRY] * 4  # the first answer never waits for the pool
    for got, want in zip(rows(b, ids), pages):
        assert np.array_equal(got[:want.size], want)  # bit-exact
    b.complete_load(keys, ctx)
    for m in (a, b):
        m.shutdown()


def test_int8_codec_stores_less_within_its_error(model_dir, daemon):
    from vllm.v1.kv_offload.base import LookupResult

    a = manager(model_dir, daemon, model="test/offload-int8", codec="int8")
    keys = keys_of(2, 2)
    pages = pages_of(a, 2, 2)
    store(a, "a", keys, pages)
    tier = a.secondary_tiers[0]
    # int8 keys: 3/4 of the page, plus the header, table and scales (16 KiB pages here)
    assert tier.counters["stored_bytes"] < 0.85 * tier.counters["original_bytes"]
    b = manager(model_dir, daemon, model="test/offload-int8", codec="int8")
    res, _, ids, ctx = promote(b, "b", keys)
    assert res == [LookupResult.HIT] * 2
    for got, want in zip(rows(b, ids), pages):
        x = torch.from_numpy(want.copy()).view(torch.float16).float()
        y = torch.from_numpy(got[:want.size].copy()).view(torch.float16).float()
        half = x.numel() // 2
        assert torch.equal(x[half:], y[half:])  # the second half kept as it was
        err = (x[:half] - y[:half]).abs().max() / x[:half].abs().max()
        assert 0 < err < 0.5 / 127 + 2e-3, err  # int8: half a step of the channel's max
    b.complete_load(keys, ctx)
    for m in (a, b):
        m.shutdown()


def test_a_chunk_that_cannot_be_loaded_is_a_miss(model_dir, daemon):
    """Chunk 1 deleted after the lookup saw it: its promotion fails, vLLM frees the slot and
    the chunk is a miss from then on; chunk 0 still loads."""
    import kvcomp
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a = manager(model_dir, daemon, model="test/offload-missing")
    keys = keys_of(3, 2)
    pages = pages_of(a, 3, 2)
    store(a, "a", keys, pages)
    b = manager(model_dir, daemon, model="test/offload-missing")
    tier = b.secondary_tiers[0]
    ctx = ReqContext(req_id="b")
    b.on_new_request(ctx)
    assert [b.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 2
    settle(b, lambda: tier._lookups.lookup(keys[1], ctx) is not None)
    kvcomp.Client(tier.endpoints).delete(tier.model, tier.store_key(keys[1]))
    res, _, ids, _ = promote(b, "b", keys)
    assert res == [LookupResult.HIT, LookupResult.MISS]
    assert tier.counters["load_failures"] == 1
    assert np.array_equal(rows(b, ids)[0][:pages[0].size], pages[0])
    for m in (a, b):
        m.shutdown()


def test_lookup_with_the_daemon_stopped_is_a_miss_without_waiting(model_dir, daemon):
    from vllm.v1.kv_offload.base import LookupResult

    a = manager(model_dir, daemon, model="test/offload-stopped")
    keys = keys_of(4, 2)
    store(a, "a", keys, pages_of(a, 4, 2))
    b = manager(model_dir, daemon, model="test/offload-stopped", lookup_timeout=0.5)
    sigstop(daemon.proc)
    try:
        t0, slowest = time.monotonic(), 0.0
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id="b")
        b.on_new_request(ctx)
        while True:
            t = time.monotonic()
            res = [b.lookup(k, ctx) for k in keys]
            end_step(b)
            slowest = max(slowest, time.monotonic() - t)
            if LookupResult.RETRY not in res:
                break
            assert time.monotonic() - t0 < 10, res
            time.sleep(0.01)
        took = time.monotonic() - t0
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert res == [LookupResult.MISS] * 2
    assert slowest < 0.4 and took < 0.5 + 1.0, (slowest, took)
    for m in (a, b):
        m.shutdown()


def test_bad_tier_options_are_refused(model_dir, daemon):
    with pytest.raises(ValueError, match="codec"):
        manager(model_dir, daemon, codec="zip")
    with pytest.raises(ValueError, match="control address"):
        manager(model_dir, daemon, endpoints=["127.0.0.1:1"])

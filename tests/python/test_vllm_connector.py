"""The vLLM connector's logic (kvcomp.integrations.vllm) without vllm, against three real kvcompd
processes on loopback: keys and chunk plans, gather/scatter over paged blocks, a prompt's blocks
saved layer by layer and loaded into another engine's fresh blocks (bit-exact lossless, int8 keys
and KVSplice values within the codecs' error), a local prefix hit, finished requests' decode
chunks, missing and malformed chunks reported as load errors (recomputed, never wrong KV).
vLLM's own classes drive the same code in scripts/test_vllm.sh."""

import hashlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcomp  # noqa: E402
from kvcomp.integrations import vllm as kv  # noqa: E402
from kvcompd_fixture import Kvcompd, built_kvcompd  # noqa: E402

KVCOMPD = built_kvcompd()
needs_daemons = pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")

LAYERS, HEADS, D, BS, CB, NBLOCKS = 3, 2, 64, 16, 2, 40
CT = BS * CB  # chunk tokens


class Req:
    """What the connector reads of a vllm.v1.request.Request."""

    def __init__(self, req_id, seed, tokens):
        self.request_id = req_id
        self.num_prompt_tokens = tokens
        self.num_computed_tokens = 0
        h, self.block_hashes = hashlib.sha256(f"s{seed}".encode()).digest(), []
        for i in range(tokens // BS):  # chained, full blocks only (as vLLM's)
            h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
            self.block_hashes.append(h)


def paged(seed=0, dtype=torch.float16, low_rank=False):
    """One engine's per-layer KV [blocks, heads, block_tokens, keys + values]."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        x = torch.randn(NBLOCKS, HEADS, BS, 2 * D, generator=g)
        if low_rank:  # values in a 12-dimensional subspace per head, plus a little noise
            basis = torch.linalg.qr(torch.randn(D, D, generator=g))[0][:, :12]
            z = torch.randn(NBLOCKS, HEADS, BS, 12, generator=g)
            x[..., D:] = z @ basis.T + 0.01 * torch.randn(NBLOCKS, HEADS, BS, D, generator=g)
        out[f"model.layers.{layer}.self_attn.attn"] = x.to(dtype)
    return out


def settings(pool, codec="lossless", **kw):
    extra = dict(endpoints=[f"{d.data_endpoint},127.0.0.1:{d.control_port}" for d in pool],
                 codec=codec, chunk_blocks=CB, **kw)
    return kv.Settings.from_extra_config(extra, "test/vllm-" + codec)


def engine(s, caches, shard=kv.shard_name(0, 1)):
    store = kv.ChunkStore(s)
    sched = kv.SchedulerLogic(s, store, BS, [shard])
    work = kv.WorkerLogic(s, store, BS, shard)
    work.register(caches)
    return sched, work


def step(work, plan):
    """One forward: loads waited for and saves made layer by layer, then the step's end."""
    work.begin_step(plan)
    for name in work.layers:
        work.layer_load(name)
        work.save_layer(name, work.layers[name])
    work.end_step()
    work.uploader.flush()


def blocks_of(caches, ids):
    return {n: t[list(ids)].float() for n, t in caches.items()}


# --- pure logic -----------------------------------------------------------------------------

def test_settings_validation(monkeypatch):
    monkeypatch.delenv("KVCOMP_ENDPOINTS", raising=False)
    ep = ["127.0.0.1:1,127.0.0.1:2"]
    s = kv.Settings.from_extra_config({"endpoints": ep}, "m")
    assert (s.model, s.codec, s.chunk_blocks) == ("m", "kvsplice", 4)
    with pytest.raises(ValueError, match="unknown option"):
        kv.Settings.from_extra_config({"endpoints": ep, "chunk": 4}, "m")
    with pytest.raises(ValueError, match="no endpoints"):
        kv.Settings.from_extra_config({}, "m")
    with pytest.raises(ValueError, match="control address"):
        kv.Settings.from_extra_config({"endpoints": ["127.0.0.1:1"]}, "m")
    with pytest.raises(ValueError, match="codec"):
        kv.Settings.from_extra_config({"endpoints": ep, "codec": "zip"}, "m")
    with pytest.raises(ValueError, match="chunk_blocks"):
        kv.Settings.from_extra_config({"endpoints": ep, "chunk_blocks": 0}, "m")
    monkeypatch.setenv("KVCOMP_ENDPOINTS", "a:1,a:2 b:1,b:2")
    assert kv.Settings.from_extra_config({}, "m").endpoints == ("a:1,a:2", "b:1,b:2")


def test_keys_and_plans():
    r = Req("r", 1, 5 * BS + 3)
    hs = kv.chunk_hashes(r.block_hashes, CB)
    assert hs == [r.block_hashes[1], r.block_hashes[3]]  # chunk i: its last block's hash
    assert kv.chunk_hashes(r.block_hashes, CB, 1) == hs[:1]
    assert kv.chunk_hashes([7, 8], 1) == [b"7", b"8"]
    k0, k1 = kv.shard_key(hs[0], kv.shard_name(0, 2)), kv.shard_key(hs[0], kv.shard_name(1, 2))
    assert k0 != k1 and k0.startswith(b"vllm:" + hs[0])
    assert kv.all_shards(2, 2) == ["tp0-2.pp0-2", "tp1-2.pp0-2", "tp0-2.pp1-2", "tp1-2.pp1-2"]
    spec = kv.plan_load("r", hs, list(range(10, 16)), BS, 2 * CT, BS, CB)
    assert [(c.chunk, c.block_ids, c.skip_blocks) for c in spec.chunks] == \
        [(0, [10, 11], 1), (1, [12, 13], 0)]
    assert spec.block_ids() == [11, 12, 13]
    with pytest.raises(ValueError):
        kv.plan_load("r", hs, list(range(6)), 3, CT, BS, CB)  # not block-aligned
    with pytest.raises(ValueError):
        kv.plan_load("r", hs, list(range(6)), 0, 3 * CT, BS, CB)  # past the hashes


@pytest.mark.parametrize("kernel_split", [1, 2])
def test_gather_scatter_round_trip(kernel_split):
    g = torch.Generator().manual_seed(5)
    # vLLM may split a block into kernel blocks: [blocks * r, H, block_tokens / r, 2D]
    src = torch.randn(NBLOCKS * kernel_split, HEADS, BS // kernel_split, 2 * D,
                      generator=g).to(torch.bfloat16)
    ids = [7, 3, 12]
    k, v = kv.gather_blocks(src, ids, BS, D)
    assert k.shape == (HEADS, len(ids) * BS, D) and v.shape == k.shape
    per_block = src.unflatten(0, (-1, kernel_split))[3]  # block 3: its tokens, head 1
    tokens = per_block.permute(1, 0, 2, 3).reshape(HEADS, BS, 2 * D)
    assert torch.equal(k[1, BS:2 * BS], tokens[1, :, :D])
    assert torch.equal(v[1, BS:2 * BS], tokens[1, :, D:])
    dst = torch.zeros_like(src)
    kv.scatter_blocks(dst, [1, 2, 30], k.float(), v.float(), BS, D)
    k2, v2 = kv.gather_blocks(dst, [1, 2, 30], BS, D)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert dst.unflatten(0, (-1, kernel_split))[[0, 3]].abs().sum() == 0  # nothing else written
    with pytest.raises(ValueError):
        kv.scatter_blocks(dst, [1, 2], k, v, BS, D)  # 3 blocks of data into 2
    with pytest.raises(ValueError, match="MLA"):
        kv.WorkerLogic(kv.Settings(("a,b",), "m"), None, BS, "s").register(
            {"l": torch.zeros(4, 1, BS, 3 * D)}, head_size=D)


# --- against real daemons -------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    if KVCOMPD is None:
        pytest.skip("kvcompd not built")
    ds = [Kvcompd(KVCOMPD) for _ in range(3)]
    for d in ds:
        d.__enter__()
    yield ds
    for d in ds:
        d.__exit__(None, None, None)


def save_prompt(s, seed, tokens, caches, low_rank=False):
    """Engine A computes a prompt in one step: its whole chunks are saved layer by layer."""
    sched, work = engine(s, caches)
    r = Req(f"a{seed}", seed, tokens)
    assert sched.matched_tokens(r, 0) == 0
    sched.after_alloc(r, 0)
    ids = list(range(1, 1 + -(-tokens // BS)))
    plan = sched.build([(r.request_id, ids, 0, tokens)], [])
    assert [sp.chunk for sp in plan.saves] == list(range(tokens // CT)) and not plan.loads
    step(work, plan)
    assert work.uploader.stored == tokens // CT and work.uploader.failed == 0
    work.close()
    return r, ids


def load_prompt(s, r, caches, ids, local_blocks=0):
    """Engine B gets the same prompt: the pool's chunks are loaded into its blocks."""
    sched, work = engine(s, caches)
    r2 = Req(r.request_id + "-b", 0, r.num_prompt_tokens)
    r2.block_hashes = r.block_hashes
    n = sched.matched_tokens(r2, local_blocks * BS)
    sched.after_alloc(r2, n)
    plan = sched.build([(r2.request_id, ids, local_blocks * BS + n, 1)], [])
    step(work, plan)
    errors = work.take_load_errors()
    work.close()
    return n, plan, errors


@needs_daemons
def test_lossless_round_trip_is_bit_exact(pool):
    s = settings(pool, "lossless")
    a = paged(1)
    tokens = 3 * CT + 5
    c = kvcomp.Client(list(s.endpoints), timeout=30.0)

    def chunk_keys(seed):
        hs = kv.chunk_hashes(Req("", seed, tokens).block_hashes, CB)
        return [kv.shard_key(h, kv.shard_name(0, 1)) for h in hs]

    # The daemons' ports differ from run to run, and so does where a chunk lands: take the first
    # prompt whose chunks land on at least two daemons, so the load crosses the pool.
    seed = next(q for q in range(1000, 1200)
                if len({c.ranking(s.model, k)[0] for k in chunk_keys(q)}) >= 2)
    r, ids = save_prompt(s, seed, tokens, a)
    keys = chunk_keys(seed)
    assert c.lookup_prefix(s.model, keys) == 3
    assert len({c.ranking(s.model, k)[0] for k in keys}) >= 2
    b = paged(2)  # another engine, other contents, other block ids
    ids_b = [30 + i for i in range(len(ids))]
    n, plan, errors = load_prompt(s, r, b, ids_b)
    assert n == 3 * CT and not errors
    assert plan.loads[0].block_ids() == ids_b[:3 * CB]
    assert not plan.saves  # held chunks are not stored again
    for name in a:
        assert torch.equal(b[name][ids_b[:3 * CB]], a[name][ids[:3 * CB]])
    untouched = paged(2)
    for name in a:  # the partial last block and everything else stay as they were
        assert torch.equal(b[name][ids_b[3 * CB:]], untouched[name][ids_b[3 * CB:]])
        assert torch.equal(b[name][:30], untouched[name][:30])


@needs_daemons
def test_whole_prompt_is_never_loaded(pool):
    s = settings(pool, "lossless")
    r, ids = save_prompt(s, 3, 2 * CT, paged(3))  # exactly two chunks
    sched, work = engine(s, paged(4))
    r2 = Req("b3", 0, 2 * CT)
    r2.block_hashes = r.block_hashes
    assert sched.matched_tokens(r2, 0) == CT  # vLLM must compute the last token
    work.close()


@needs_daemons
def test_local_prefix_hit_writes_only_the_rest(pool):
    s = settings(pool, "lossless")
    a = paged(5)
    r, ids = save_prompt(s, 5, 2 * CT + 1, a)
    b = paged(6)
    before = {n: t.clone() for n, t in b.items()}
    ids_b = list(range(20, 25))
    n, plan, errors = load_prompt(s, r, b, ids_b, local_blocks=1)  # vLLM had block 0 itself
    assert n == 2 * CT - BS and not errors
    assert plan.loads[0].chunks[0].skip_blocks == 1
    for name in a:
        assert torch.equal(b[name][20], before[name][20])
        assert torch.equal(b[name][21:24], a[name][ids[1:4]])


@needs_daemons
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_keys_within_the_codec_error(pool, dtype):
    s = settings(pool, "int8")
    s = kv.Settings(**{**s.__dict__, "model": f"test/vllm-int8-{dtype}"})
    a = paged(7, dtype)
    r, ids = save_prompt(s, 7, 2 * CT + 3, a)
    b = paged(8, dtype)
    ids_b = list(range(10, 15))
    n, _, errors = load_prompt(s, r, b, ids_b)
    assert n == 2 * CT and not errors
    for name in a:
        x, y = a[name][ids[:4]].float(), b[name][ids_b[:4]].float()
        assert torch.equal(x[..., D:], y[..., D:])  # raw values
        # int8 keys: per-channel scales per chunk, half a step of max |k| / 127 (+ the dtype)
        err = (x[..., :D] - y[..., :D]).abs().max() / x[..., :D].abs().max()
        assert 0 < err < 0.5 / 127 + 8e-3, err


@needs_daemons
def test_kvsplice_values_after_the_daemons_calibrate(pool):
    s = settings(pool, "kvsplice", calibrate_after=3, error_budget=0.05)
    stores = []
    a = paged(9, low_rank=True)
    sched, work = engine(s, a)
    stores.append(work.store)
    tokens = (NBLOCKS // CB) * CT  # the whole paged cache: 20 chunks, one prompt per 5 chunks
    for p in range(4):
        r = Req(f"k{p}", 100 + p, 5 * CT + 1)
        ids = list(range(p * 5 * CB, (p + 1) * 5 * CB)) + [0]
        sched.matched_tokens(r, 0)
        plan = sched.build([(r.request_id, ids, 0, 5 * CT + 1)], [])
        step(work, plan)
    assert work.store._kvsplice_ready  # the daemons calibrated after 3 raw-value chunks
    assert tokens == 20 * CT
    c = kvcomp.Client(list(s.endpoints), timeout=30.0)
    last = kv.shard_key(kv.chunk_hashes(r.block_hashes, CB)[-1], kv.shard_name(0, 1))
    assert kvcomp.cache_codecs(c.get(s.model, last))["value_codec"] == "orthogonal_int8"
    work.close()
    b = paged(10)
    ids_b = list(range(5 * CB))
    n, _, errors = load_prompt(s, r, b, ids_b + [39])
    assert n == 5 * CT and not errors
    for name in a:
        x, y = a[name][ids[:5 * CB]].float(), b[name][ids_b].float()
        verr = torch.linalg.norm(x[..., D:] - y[..., D:]) / torch.linalg.norm(x[..., D:])
        kerr = (x[..., :D] - y[..., :D]).abs().max() / x[..., :D].abs().max()
        assert verr < 0.1, verr
        assert kerr < 0.5 / 127 + 8e-3, kerr


@needs_daemons
def test_missing_chunk_becomes_load_errors(pool):
    s = settings(pool, "lossless")
    a = paged(11)
    r, ids = save_prompt(s, 11, 3 * CT + 1, a)
    b = paged(12)
    before = {n: t.clone() for n, t in b.items()}
    sched, work = engine(s, b)
    r2 = Req("miss", 0, r.num_prompt_tokens)
    r2.block_hashes = r.block_hashes
    n = sched.matched_tokens(r2, 0)
    assert n == 3 * CT
    # Chunk 1 vanishes between the lookup and the load (evicted, deleted, a daemon gone).
    h1 = kv.chunk_hashes(r.block_hashes, CB)[1]
    kvcomp.Client(list(s.endpoints)).delete(s.model, kv.shard_key(h1, kv.shard_name(0, 1)))
    sched.after_alloc(r2, n)
    ids_b = list(range(20, 27))
    step(work, sched.build([(r2.request_id, ids_b, n, 1)], []))
    assert work.take_load_errors() == set(ids_b[CB:3 * CB])  # chunk 1 and all after it
    assert work.take_load_errors() == set()  # reported once
    for name in a:
        assert torch.equal(b[name][ids_b[:CB]], a[name][ids[:CB]])  # chunk 0 loaded
        assert torch.equal(b[name][ids_b[CB:]], before[name][ids_b[CB:]])  # nothing wrong
    work.close()


@needs_daemons
def test_malformed_chunk_becomes_load_errors(pool):
    s = settings(pool, "lossless")
    a = paged(13)
    r, ids = save_prompt(s, 13, 2 * CT + 1, a)
    # Chunk 0 replaced by a cache of another layout (one head fewer) under the same key.
    h0 = kv.chunk_hashes(r.block_hashes, CB)[0]
    bad = np.ones((LAYERS, HEADS - 1, CT, D), np.float16)
    kvcomp.Client(list(s.endpoints)).put(s.model, kv.shard_key(h0, kv.shard_name(0, 1)), bad,
                                         bad, policy=kvcomp.Policy(ratio=0.0, moments=False))
    b = paged(14)
    before = {n: t.clone() for n, t in b.items()}
    ids_b = list(range(5))
    n, plan, errors = load_prompt(s, r, b, ids_b)
    assert n == 2 * CT and errors == set(ids_b[:4])
    for name in b:
        assert torch.equal(b[name], before[name])
    # A pool that cannot be reached is a miss, not an error.
    dead = kv.Settings(**{**s.__dict__, "endpoints": ("127.0.0.1:1,127.0.0.1:2",),
                          "timeout": 2.0})
    sched = kv.SchedulerLogic(dead, kv.ChunkStore(dead), BS, [kv.shard_name(0, 1)])
    assert sched.matched_tokens(r, 0) == 0


@needs_daemons
def test_finished_request_saves_decode_chunks(pool):
    s = settings(pool, "lossless")
    a = paged(15)
    sched, work = engine(s, a)
    r = Req("dec", 15, CT + 3)  # prompt: one chunk and 3 tokens
    sched.matched_tokens(r, 0)
    ids = [5, 6]
    plan = sched.build([(r.request_id, ids, 0, CT + 3)], [])
    assert [sp.chunk for sp in plan.saves] == [0]
    step(work, plan)
    # Decoding adds blocks; the scheduler reports them as new block ids of a cached request.
    plan = sched.build([], [(r.request_id, [7, 8], False, CT + 3, 1)])
    assert not plan.saves  # decode chunks wait for the request's end
    step(work, plan)
    full = Req("dec", 15, 2 * CT + 4)  # prompt + output: two chunks of hashes
    r.block_hashes, r.num_computed_tokens = full.block_hashes, 2 * CT + 3
    assert sched.finished(r, [5, 6, 7, 8, 9]) is True  # blocks held until copied
    assert work.finished_sending({"dec"}) == set()
    plan = sched.build([], [])
    assert [sp.chunk for sp in plan.finish_saves["dec"]] == [1]
    step(work, plan)
    assert work.finished_sending(set()) == {"dec"}  # reported once, then the blocks go
    assert work.finished_sending({"dec"}) == set()
    keys = [kv.shard_key(h, kv.shard_name(0, 1)) for h in kv.chunk_hashes(r.block_hashes, CB)]
    assert work.store.client.lookup_prefix(s.model, keys) == 2
    got = work.store.get(keys, LAYERS, HEADS, CT, D)
    k = torch.from_numpy(got[1][0])
    assert torch.equal(k[0], kv.gather_blocks(a["model.layers.0.self_attn.attn"], [7, 8], BS,
                                              D)[0].float())
    # Nothing to save at the end: the blocks go at once.
    r3 = Req("none", 16, CT - 1)
    sched.matched_tokens(r3, 0)
    sched.build([(r3.request_id, [10], 0, CT - 1)], [])
    assert sched.finished(r3, [10]) is False
    work.close()


# --- vLLM's own classes (scripts/test_vllm.sh runs these in a virtual environment with vllm) --

def _vllm():
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
        return True
    except Exception:
        return False


needs_vllm = pytest.mark.skipif(not _vllm(), reason="vllm not installed (scripts/test_vllm.sh)")


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory, pool):
    """A VllmConfig for a tiny local Llama (config only, no weights) with the connector on,
    on a CPU device, and the scheduler's KV cache spec."""
    from transformers import LlamaConfig
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=HEADS * 2 * D, intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS * 2, num_key_value_heads=HEADS, head_dim=D,
                vocab_size=1000, max_position_embeddings=4096).save_pretrained(d)
    init_none_hash(sha256)

    def config(codec="lossless"):
        extra = dict(endpoints=[f"{p.data_endpoint},127.0.0.1:{p.control_port}" for p in pool],
                     codec=codec, chunk_blocks=CB, model=f"test/vllm-real-{codec}")
        vc = VllmConfig(
            model_config=ModelConfig(model=str(d), tokenizer=str(d), skip_tokenizer_init=True,
                                     dtype="float16", seed=0),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                             max_model_len=2048, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BS, gpu_memory_utilization=0.9,
                                     enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvcompConnector",
                kv_connector_module_path="kvcomp.integrations.vllm", kv_role="kv_both",
                kv_load_failure_policy="recompute", kv_connector_extra_config=extra),
            device_config=DeviceConfig("cpu"))
        vc.cache_config.num_gpu_blocks = NBLOCKS
        kcc = KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                             FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=D,
                                               dtype=torch.float16))])
        return vc, kcc
    return config


def _vllm_engine(config, caches):
    """vLLM's Scheduler (it builds the scheduler-side connector from the config) and a
    worker-side connector built by vLLM's factory over `caches`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc, kcc = config
    sched = Scheduler(vllm_config=vc, kv_cache_config=kcc, log_stats=True,
                      structured_output_manager=StructuredOutputManager(vc), block_size=BS)
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    worker.register_kv_caches(caches)
    return sched, worker


def _vllm_request(req_id, tokens, max_tokens=1):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 999)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=sp,
                   pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def _vllm_step(sched, worker, caches, before_load=None, token=7):
    """schedule -> the worker's connector calls around a forward -> update_from_output."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    so = sched.schedule()
    if before_load is not None:
        before_load(so)
    worker.bind_connector_metadata(so.kv_connector_metadata)
    worker.start_load_kv(None)
    for name, t in caches.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, t, None)
    worker.wait_for_save()
    worker.worker.uploader.flush()
    sending, _ = worker.get_finished(so.finished_req_ids)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    out = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids], logprobs=None, prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(finished_sending=sending,
                                              invalid_block_ids=errors))
    sched.update_from_output(so, out)
    return so, errors


@needs_daemons
@needs_vllm
def test_vllm_real_scheduler_save_and_load(vllm_env):
    from kvcomp.integrations.vllm import KvcompConnector

    cfg = vllm_env("lossless")
    a = paged(21)
    sched, worker = _vllm_engine(cfg, a)
    assert isinstance(sched.connector, KvcompConnector) and isinstance(worker, KvcompConnector)
    prompt = list(range(100, 100 + 2 * CT + 5))
    r = _vllm_request("a", prompt, max_tokens=2 * CT)  # decodes into a third chunk
    sched.add_request(r)
    so, _ = _vllm_step(sched, worker, a)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # nothing held yet
    plan = so.kv_connector_metadata.plan
    assert [s.chunk for s in plan.saves] == [0, 1]
    ids_a = so.scheduled_new_reqs[0].block_ids[0]
    steps = 1
    while r.request_id in sched.requests and steps < 3 * CT:
        so, _ = _vllm_step(sched, worker, a, token=7)
        steps += 1
    assert r.is_finished() or r.request_id not in sched.requests
    # The finished request's third chunk (decode tokens) is saved, then its blocks go.
    for _ in range(3):
        _vllm_step(sched, worker, a)
    assert r.request_id not in sched.requests
    hashes = kv.chunk_hashes(r.block_hashes, CB)
    keys = [kv.shard_key(h, kv.shard_name(0, 1)) for h in hashes]
    # KV exists for every token but the last sampled: 4 * CT + 4 tokens, four chunks, the last
    # two completed while decoding and stored when the request finished.
    assert len(r.all_token_ids) == 4 * CT + 5 and len(keys) == 4
    assert worker.worker.store.client.lookup_prefix(sched.connector.settings.model, keys) == 4

    # Another engine: vLLM's scheduler counts the held prefix as computed and the worker-side
    # connector writes it into fresh blocks.
    b = paged(22)
    sched2, worker2 = _vllm_engine(vllm_env("lossless"), b)
    r2 = _vllm_request("b", prompt, max_tokens=1)
    sched2.add_request(r2)
    so, errors = _vllm_step(sched2, worker2, b)
    assert not errors
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 2 * CT and so.num_scheduled_tokens["b"] == 5
    ids_b = new.block_ids[0]
    for name in a:
        assert torch.equal(b[name][ids_b[:2 * CB]], a[name][ids_a[:2 * CB]])
    worker.shutdown()
    worker2.shutdown()


@needs_daemons
@needs_vllm
def test_vllm_real_missing_chunk_is_recomputed(vllm_env):
    cfg = vllm_env("lossless")
    a = paged(23)
    sched, worker = _vllm_engine(cfg, a)
    prompt = list(range(500, 500 + 3 * CT + 1))
    r = _vllm_request("c", prompt)
    sched.add_request(r)
    _vllm_step(sched, worker, a)
    model = sched.connector.settings.model

    b = paged(24)
    before = {n: t.clone() for n, t in b.items()}
    sched2, worker2 = _vllm_engine(vllm_env("lossless"), b)
    r2 = _vllm_request("d", prompt, max_tokens=4)
    sched2.add_request(r2)
    h1 = kv.chunk_hashes(r2.block_hashes, CB)[1]

    def drop_chunk_1(so):  # after vLLM's scheduler counted 3 chunks, before the worker loads
        assert so.scheduled_new_reqs[0].num_computed_tokens == 3 * CT
        worker2.worker.store.client.delete(model, kv.shard_key(h1, kv.shard_name(0, 1)))

    so, errors = _vllm_step(sched2, worker2, b, before_load=drop_chunk_1)
    ids_b = so.scheduled_new_reqs[0].block_ids[0]
    assert errors == set(ids_b[CB:3 * CB])
    for name in a:
        assert torch.equal(b[name][ids_b[CB:3 * CB]], before[name][ids_b[CB:3 * CB]])
    # vLLM (kv_load_failure_policy "recompute") rolls the request back to its first bad block.
    assert r2.num_computed_tokens == CT
    so, errors = _vllm_step(sched2, worker2, b)
    assert so.num_scheduled_tokens["d"] == 2 * CT + 1 and not errors
    worker.shutdown()
    worker2.shutdown()

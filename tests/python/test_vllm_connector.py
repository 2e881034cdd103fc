"""The vLLM connector's logic (kvcomp.integrations.vllm) without vllm, against three real kvcompd
processes on loopback: keys and chunk plans, gather/scatter over paged blocks, a prompt's blocks
saved layer by layer and loaded into another engine's fresh blocks (bit-exact lossless, int8 keys
and KVSplice values within the codecs' error), a local prefix hit, finished requests' decode
chunks, missing and malformed chunks reported as load errors (recomputed, never wrong KV).
vLLM's own classes drive the same code in scripts/test_vllm.sh."""

import hashlib
import os
import signal
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcomp  # noqa: E402
from kvcomp.integrations import vllm as kv  # noqa: E402
from kvcompd_fixture import Kvcompd, built_kvcompd, sigstop  # noqa: E402

KVCOMPD = built_kvcompd()
needs_daemons = pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")

LAYERS, HEADS, D, BS, CB, NBLOCKS = 3, 2, 64, 16, 2, 40
CT = BS * CB  # chunk tokens
UNITS = kv.all_units(HEADS, 1)  # one stored unit per KV head (head_group 1)
U0 = UNITS[0]


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


def engine(s, caches, shard=kv.Shard(), total_heads=HEADS):
    store = kv.ChunkStore(s)
    sched = kv.SchedulerLogic(s, store, BS, kv.all_units(total_heads, s.head_group))
    work = kv.WorkerLogic(s, store, BS, shard)
    work.register(caches)
    return sched, work


def lookup(sched, r, computed=0):
    """matched_tokens, asked again while the background lookup is in flight (None)."""
    for _ in range(5000):
        n = sched.matched_tokens(r, computed)
        if n is not None:
            return n
        time.sleep(0.001)
    raise AssertionError("the lookup never answered")


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
    with pytest.raises(ValueError, match="head_group"):
        kv.Settings.from_extra_config({"endpoints": ep, "head_group": 0}, "m")
    with pytest.raises(ValueError, match="lookup_timeout"):
        kv.Settings.from_extra_config({"endpoints": ep, "lookup_timeout": 0}, "m")
    monkeypatch.setenv("KVCOMP_ENDPOINTS", "a:1,a:2 b:1,b:2")
    assert kv.Settings.from_extra_config({}, "m").endpoints == ("a:1,a:2", "b:1,b:2")


def test_keys_and_plans():
    r = Req("r", 1, 5 * BS + 3)
    hs = kv.chunk_hashes(r.block_hashes, CB)
    assert hs == [r.block_hashes[1], r.block_hashes[3]]  # chunk i: its last block's hash
    assert kv.chunk_hashes(r.block_hashes, CB, 1) == hs[:1]
    assert kv.chunk_hashes([7, 8], 1) == [b"7", b"8"]
    k0, k1 = kv.shard_key(hs[0], kv.unit_name(0, 1)), kv.shard_key(hs[0], kv.unit_name(1, 2))
    assert k0 != k1 and k0.startswith(b"vllm:" + hs[0])
    assert kv.all_units(4, 2, 2) == ["kvh0-2.pp0-2", "kvh2-4.pp0-2", "kvh0-2.pp1-2",
                                     "kvh2-4.pp1-2"]
    assert kv.unit_keys(hs, ["a", "b"]) == [kv.shard_key(h, u) for h in hs for u in "ab"]
    # Ranks' heads: split, or replicated (stored by the first rank holding them).
    assert [kv.rank_heads(r, 2, 8) for r in range(2)] == [(0, 4, True), (4, 8, True)]
    assert [kv.rank_heads(r, 4, 2) for r in range(4)] == \
        [(0, 1, True), (0, 1, False), (1, 2, True), (1, 2, False)]
    with pytest.raises(ValueError):
        kv.rank_heads(0, 3, 8)
    # A rank's units are named by the model's head numbers, whatever the TP size.
    assert kv.shard_units(kv.Shard(head0=4), 4, 2) == [("kvh4-6.pp0-1", 0, 2),
                                                       ("kvh6-8.pp0-1", 2, 4)]
    assert {u for u, _, _ in kv.shard_units(kv.Shard(0), 4, 2)} | \
        {u for u, _, _ in kv.shard_units(kv.Shard(4), 4, 2)} == set(kv.all_units(8, 2))
    with pytest.raises(ValueError, match="head_group"):
        kv.shard_units(kv.Shard(), 4, 3)
    spec = kv.plan_load("r", hs, list(range(10, 16)), BS, 2 * CT, BS, CB)
    assert [(c.chunk, c.block_ids, c.skip_blocks) for c in spec.chunks] == \
        [(0, [[10, 11]], 1), (1, [[12, 13]], 0)]
    assert spec.block_ids() == [11, 12, 13] and not spec.async_load
    # Hybrid models: block ids per KV cache group; a sliding-window group's blocks before the
    # window are vLLM's null block (0), never written.
    spec = kv.plan_load("r", hs, ([10, 11, 12, 13], [0, 0, 0, 23]), 0, 2 * CT, BS, CB, True)
    assert [c.block_ids for c in spec.chunks] == [[[10, 11], [0, 0]], [[12, 13], [0, 23]]]
    assert spec.block_ids() == [10, 11, 12, 13, 23] and spec.async_load
    assert kv.per_group([4, 5], 1) == [[4, 5]] and kv.per_group(([4], [5]), 2) == [[4], [5]]
    with pytest.raises(ValueError, match="groups"):
        kv.per_group(([4], [5]), 3)
    assert kv.group_units(["u", "v"], 1) == ["u", "v"]
    assert kv.group_units(["u", "v"], 2) == ["g0of2.u", "g0of2.v", "g1of2.u", "g1of2.v"]
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
        kv.WorkerLogic(kv.Settings(("a,b",), "m"), None, BS).register(
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
    assert lookup(sched, r) == 0
    sched.after_alloc(r, 0)
    ids = list(range(1, 1 + -(-tokens // BS)))
    plan = sched.build([(r.request_id, ids, 0, tokens)], [])
    assert [sp.chunk for sp in plan.saves] == list(range(tokens // CT)) and not plan.loads
    step(work, plan)
    assert work.uploader.stored == tokens // CT * len(work.units) and work.uploader.failed == 0
    work.close()
    return r, ids


def load_prompt(s, r, caches, ids, local_blocks=0):
    """Engine B gets the same prompt: the pool's chunks are loaded into its blocks."""
    sched, work = engine(s, caches)
    r2 = Req(r.request_id + "-b", 0, r.num_prompt_tokens)
    r2.block_hashes = r.block_hashes
    n = lookup(sched, r2, local_blocks * BS)
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
        return kv.unit_keys(hs, UNITS)

    # The daemons' ports differ from run to run, and so does where a chunk lands: take the first
    # prompt whose chunks land on at least two daemons, so the load crosses the pool.
    seed = next(q for q in range(1000, 1200)
                if len({c.ranking(s.model, k)[0] for k in chunk_keys(q)}) >= 2)
    r, ids = save_prompt(s, seed, tokens, a)
    keys = chunk_keys(seed)
    assert c.lookup_prefix(s.model, keys) == 3 * len(UNITS)
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
    assert lookup(sched, r2) == CT  # vLLM must compute the last token
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
        lookup(sched, r)
        plan = sched.build([(r.request_id, ids, 0, 5 * CT + 1)], [])
        step(work, plan)
    assert work.store._kvsplice_ready  # the daemons calibrated after 3 raw-value chunks
    assert tokens == 20 * CT
    c = kvcomp.Client(list(s.endpoints), timeout=30.0)
    last = kv.shard_key(kv.chunk_hashes(r.block_hashes, CB)[-1], U0)
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
    n = lookup(sched, r2)
    assert n == 3 * CT
    # Chunk 1 vanishes between the lookup and the load (evicted, deleted, a daemon gone).
    h1 = kv.chunk_hashes(r.block_hashes, CB)[1]
    kvcomp.Client(list(s.endpoints)).delete(s.model, kv.shard_key(h1, UNITS[1]))
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
    # Chunk 0's first head replaced by a cache of another layout (one layer fewer).
    h0 = kv.chunk_hashes(r.block_hashes, CB)[0]
    bad = np.ones((LAYERS - 1, 1, CT, D), np.float16)
    kvcomp.Client(list(s.endpoints)).put(s.model, kv.shard_key(h0, U0), bad,
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
    sched = kv.SchedulerLogic(dead, kv.ChunkStore(dead), BS, UNITS)
    assert lookup(sched, r) == 0


@needs_daemons
def test_finished_request_saves_decode_chunks(pool):
    s = settings(pool, "lossless")
    a = paged(15)
    sched, work = engine(s, a)
    r = Req("dec", 15, CT + 3)  # prompt: one chunk and 3 tokens
    lookup(sched, r)
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
    keys = kv.unit_keys(kv.chunk_hashes(r.block_hashes, CB), UNITS)
    assert work.store.client.lookup_prefix(s.model, keys) == 2 * len(UNITS)
    got = work.store.get(keys, LAYERS, 1, CT, D)
    k = torch.from_numpy(got[len(UNITS)][0])  # chunk 1, head 0
    assert torch.equal(k[0], kv.gather_blocks(a["model.layers.0.self_attn.attn"], [7, 8], BS,
                                              D)[0][:1].float())
    # Nothing to save at the end: the blocks go at once.
    r3 = Req("none", 16, CT - 1)
    lookup(sched, r3)
    sched.build([(r3.request_id, [10], 0, CT - 1)], [])
    assert sched.finished(r3, [10]) is False
    work.close()


# --- hybrid models: full-attention and sliding-window KV cache groups ------------------------

# Layers 0 and 2 full attention, 1 and 3 sliding window: vLLM's hybrid KV cache manager makes
# one group of each kind and, per position in the groups, one tensor shared by a layer of each
# group (layers 0 and 1, layers 2 and 3), every group using its own blocks of it.
HYBRID = ([f"model.layers.{i}.self_attn.attn" for i in (0, 2)],
          [f"model.layers.{i}.self_attn.attn" for i in (1, 3)])
HUNITS = kv.group_units(UNITS, 2)


def paged_hybrid(seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for full, window in zip(*HYBRID):
        out[full] = out[window] = torch.randn(NBLOCKS, HEADS, BS, 2 * D, generator=g).half()
    return out


def hybrid_engine(s, caches):
    store = kv.ChunkStore(s)
    sched = kv.SchedulerLogic(s, store, BS, HUNITS, groups=2, async_load=True)
    work = kv.WorkerLogic(s, store, BS)
    work.register(caches, groups=HYBRID)
    return sched, work


def hybrid_save(s, seed, tokens, caches):
    """Engine A computes a prompt in one step: every whole chunk saved, both groups."""
    sched, work = hybrid_engine(s, caches)
    r = Req(f"h{seed}", seed, tokens)
    assert lookup(sched, r) == 0
    sched.after_alloc(r, 0)
    n = -(-tokens // BS)
    ids = (list(range(1, 1 + n)), list(range(1 + n, 1 + 2 * n)))
    plan = sched.build([(r.request_id, ids, 0, tokens)], [])
    assert [sp.chunk for sp in plan.saves] == list(range(tokens // CT))
    assert plan.saves[1].block_ids == [ids[0][CB:2 * CB], ids[1][CB:2 * CB]]
    step(work, plan)
    assert work.uploader.stored == tokens // CT * len(HUNITS) and work.uploader.failed == 0
    work.close()
    sched.close()
    return r, ids


@needs_daemons
def test_hybrid_groups_load_asynchronously_into_the_window(pool):
    """A model of full-attention and sliding-window layers: each chunk is stored as units of
    each group; engine B's load (asynchronous: the request waits for it) writes the full group's
    blocks and the sliding-window blocks vLLM allocated inside the window, never its null
    block."""
    s = settings(pool, "lossless")
    s = kv.Settings(**{**s.__dict__, "model": "test/vllm-hybrid"})
    a = paged_hybrid(61)
    tokens = 3 * CT + 5
    r, ids = hybrid_save(s, 61, tokens, a)
    keys = kv.unit_keys(kv.chunk_hashes(r.block_hashes, CB), HUNITS)
    c = kvcomp.Client(list(s.endpoints), timeout=30.0)
    assert c.lookup_prefix(s.model, keys) == 3 * len(HUNITS)

    b = paged_hybrid(62)
    before = {n: t.clone() for n, t in b.items()}
    sched, work = hybrid_engine(s, b)
    r2 = Req("h-load", 0, tokens)
    r2.block_hashes = r.block_hashes
    n = lookup(sched, r2)
    assert n == 3 * CT
    # What vLLM allocates for 3 chunks with a 2-block window: every full-attention block; the
    # sliding-window group's blocks before the window are the null block.
    full_b, window_b = list(range(20, 26)), [0, 0, 0, 0, 30, 31]
    sched.after_alloc(r2, n, (full_b, window_b))
    plan = sched.build([], [])  # the request waits for its load: nothing scheduled
    assert len(plan.loads) == 1 and plan.loads[0].async_load
    assert plan.loads[0].block_ids() == full_b + [30, 31]
    step(work, plan)
    assert work.finished_recving() == ({"h-load"}, set())
    assert not work.take_load_errors()
    for name in HYBRID[0]:
        assert torch.equal(b[name][full_b], a[name][ids[0][:3 * CB]])
    for name in HYBRID[1]:
        assert torch.equal(b[name][[30, 31]], a[name][ids[1][2 * CB:3 * CB]])
    for name in b:  # the null block and every other block untouched
        rest = [i for i in range(NBLOCKS) if i not in full_b + [30, 31]]
        assert torch.equal(b[name][rest], before[name][rest])
    # A later step: the request is scheduled with its loaded tokens; nothing is loaded again.
    plan = sched.build([(r2.request_id, (full_b + [26], window_b + [32]), n, 5)], [])
    assert not plan.loads and not plan.saves
    work.close()
    sched.close()


@needs_daemons
def test_hybrid_failed_load_fails_the_request_and_is_not_retried(pool):
    """One sliding-window unit of chunk 1 missing: the whole asynchronous load fails (vLLM
    recomputes the request: block-level errors are not accepted for several KV cache groups),
    nothing is written, and the request's next lookup is a miss."""
    s = settings(pool, "lossless")
    s = kv.Settings(**{**s.__dict__, "model": "test/vllm-hybrid-fail"})
    a = paged_hybrid(63)
    r, _ = hybrid_save(s, 63, 3 * CT + 1, a)
    b = paged_hybrid(64)
    before = {n: t.clone() for n, t in b.items()}
    sched, work = hybrid_engine(s, b)
    r2 = Req("h-fail", 0, r.num_prompt_tokens)
    r2.block_hashes = r.block_hashes
    assert lookup(sched, r2) == 3 * CT
    h1 = kv.chunk_hashes(r.block_hashes, CB)[1]
    work.store.client.delete(s.model, kv.shard_key(h1, HUNITS[len(UNITS)]))
    sched.after_alloc(r2, 3 * CT, (list(range(20, 26)), [0, 0, 0, 0, 30, 31]))
    step(work, sched.build([], []))
    assert work.finished_recving() == ({"h-fail"}, {"h-fail"})
    assert not work.take_load_errors()  # the request fails, not blocks
    for name in b:
        assert torch.equal(b[name], before[name])
    sched.load_failed("h-fail")  # vLLM's connector output reaches the scheduler half
    assert lookup(sched, r2) == 0
    # Recomputed: its chunks are stored again (chunk 1's missing unit with them).
    plan = sched.build([(r2.request_id, (list(range(20, 27)), list(range(30, 37))), 0,
                         r2.num_prompt_tokens)], [])
    assert [sp.chunk for sp in plan.saves] == [0, 1, 2]
    step(work, plan)
    keys = kv.unit_keys(kv.chunk_hashes(r.block_hashes, CB), HUNITS)
    assert work.store.client.lookup_prefix(s.model, keys) == 3 * len(HUNITS)
    work.close()
    sched.close()


def test_hybrid_chunks_outside_the_window_are_not_saved():
    """At a request's end a sliding-window group has freed the blocks before its window: the
    decode chunks those fall in are not stored (a later miss), the ones inside it are."""
    s = kv.Settings(("127.0.0.1:1,127.0.0.1:2",), "m", chunk_blocks=CB)
    sched = kv.SchedulerLogic(s, None, BS, HUNITS, groups=2, async_load=True, load=False)
    r = Req("h-dec", 65, CT)
    sched.after_alloc(r, 0)
    plan = sched.build([(r.request_id, ([1, 2], [11, 12]), 0, CT)], [])
    assert [sp.chunk for sp in plan.saves] == [0]
    full = Req("h-dec", 65, 4 * CT + 1)
    r.block_hashes, r.num_computed_tokens = full.block_hashes, 4 * CT
    # Chunks 1 and 2 left the window (null blocks); chunk 3 is inside it.
    assert sched.finished(r, ([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 0, 0, 0, 17, 18, 19]))
    assert [sp.chunk for sp in sched.build([], []).finish_saves["h-dec"]] == [3]


# --- a stalled or failing pool: lookups answer in time, loads become recomputes -------------

@pytest.fixture
def lone():
    """One private kvcompd (every chunk on it), for tests that stop or kill it."""
    if KVCOMPD is None:
        pytest.skip("kvcompd not built")
    d = Kvcompd(KVCOMPD)
    d.__enter__()
    yield d
    if d.proc is not None and d.proc.poll() is None:
        os.kill(d.proc.pid, signal.SIGCONT)
    d.__exit__(None, None, None)


@needs_daemons
@pytest.mark.parametrize("async_lookup", [True, False])
def test_lookup_with_the_daemon_stopped_is_a_miss_within_its_deadline(lone, async_lookup):
    s = settings([lone], "lossless", lookup_timeout=0.5, async_lookup=async_lookup)
    r, _ = save_prompt(s, 31, 2 * CT + 1, paged(31))
    sched, work = engine(s, paged(32))
    r2 = Req("stalled", 0, r.num_prompt_tokens)
    r2.block_hashes = r.block_hashes
    sigstop(lone.proc)
    try:
        t0 = time.monotonic()
        answers, slowest = [], 0.0
        while True:
            t = time.monotonic()
            n = sched.matched_tokens(r2, 0)
            slowest = max(slowest, time.monotonic() - t)
            answers.append(n)
            if n is not None:
                break
            time.sleep(0.01)
        took = time.monotonic() - t0
        # A miss, by the connector's deadline or by the lookup client's own request timeout
        # (the same length), whichever ends first.
        assert n == 0
        # The deadline bounds the answer (0.5 s, plus slack for a loaded machine).
        assert took < 0.5 + 1.0, took
        if async_lookup:  # "not yet" while in flight, each call returning at once
            assert answers[0] is None and len(answers) > 1 and slowest < 0.4, slowest
    finally:
        os.kill(lone.proc.pid, signal.SIGCONT)
    assert lookup(sched, r2) == 2 * CT  # the daemon back: a hit
    work.close()
    sched.close()


class FlipByte:
    """A client whose chunk bytes are altered on the way (one byte of unit `which`)."""

    def __init__(self, client, which):
        self._c, self._which = client, which

    def __getattr__(self, name):
        return getattr(self._c, name)

    def get_chunk_bytes(self, model, keys, decoded=False):
        out = self._c.get_chunk_bytes(model, keys, decoded=decoded)
        if len(out) > self._which:
            b = bytearray(out[self._which])
            b[len(b) // 2] ^= 0x10
            out[self._which] = bytes(b)
        return out


@needs_daemons
@pytest.mark.parametrize("failure", ["missing", "checksum", "daemon_gone", "timeout"])
def test_every_load_failure_becomes_load_errors(lone, failure):
    """Between the scheduler's hit and the worker's load: chunk 1 deleted, chunk 1's bytes
    altered (its CRC fails), the daemon killed, the daemon stopped past the load's timeout.
    The blocks from the first failed chunk on are load errors and none of them is written."""
    s = settings([lone], "lossless", timeout=1.0)
    a = paged(33)
    r, ids = save_prompt(s, 33, 3 * CT + 1, a)
    b = paged(34)
    before = {n: t.clone() for n, t in b.items()}
    sched, work = engine(s, b)
    r2 = Req("fail-" + failure, 0, r.num_prompt_tokens)
    r2.block_hashes = r.block_hashes
    n = lookup(sched, r2)
    assert n == 3 * CT
    h1 = kv.chunk_hashes(r.block_hashes, CB)[1]
    first_bad = 1
    if failure == "missing":
        work.store.client.delete(s.model, kv.shard_key(h1, UNITS[1]))
    elif failure == "checksum":
        work.store.client = FlipByte(work.store.client, len(UNITS) + 1)  # chunk 1, head 1
    elif failure == "daemon_gone":
        lone.proc.kill()
        lone.proc.wait()
        first_bad = 0
    else:
        sigstop(lone.proc)
        first_bad = 0
    sched.after_alloc(r2, n)
    ids_b = list(range(20, 27))
    t0 = time.monotonic()
    try:
        step(work, sched.build([(r2.request_id, ids_b, n, 1)], []))
    finally:
        if failure == "timeout":
            os.kill(lone.proc.pid, signal.SIGCONT)
    took = time.monotonic() - t0
    assert work.take_load_errors() == set(ids_b[first_bad * CB:3 * CB])
    assert work.stats.get("load_error_blocks") == (3 - first_bad) * CB
    for name in a:
        assert torch.equal(b[name][ids_b[:first_bad * CB]], a[name][ids[:first_bad * CB]])
        assert torch.equal(b[name][ids_b[first_bad * CB:]], before[name][ids_b[first_bad * CB:]])
    if failure == "timeout":
        assert took < 1.0 + 2.0, took  # the load's timeout bounds the step
    work.close()
    sched.close()


# --- tensor parallelism: each rank its own heads; caches move between TP sizes -------------

def rank_view(caches, h0, h1):
    """What rank [h0, h1) of a TP group holds of a layer: its own blocks with those heads."""
    return {n: t[:, h0:h1].clone() for n, t in caches.items()}


def tp_save(s, seed, tokens, caches, tp):
    """A prompt computed at TP=tp: every rank saves its heads of each chunk."""
    sched = kv.SchedulerLogic(s, kv.ChunkStore(s), BS, kv.all_units(HEADS, s.head_group))
    r = Req(f"tp{tp}-{seed}", seed, tokens)
    assert lookup(sched, r) == 0
    sched.after_alloc(r, 0)
    ids = list(range(1, 1 + -(-tokens // BS)))
    plan = sched.build([(r.request_id, ids, 0, tokens)], [])
    for rank in range(tp):
        h0, h1, stores = kv.rank_heads(rank, tp, HEADS)
        work = kv.WorkerLogic(s, kv.ChunkStore(s), BS, kv.Shard(h0, stores=stores))
        work.register(rank_view(caches, h0, h1))
        step(work, plan)
        work.close()
    sched.close()
    return r, ids


def tp_load(s, r, caches, ids, tp):
    """The same prompt at TP=tp: the scheduler counts chunks every head of which is held, each
    rank loads its heads into its blocks; returns the tokens matched and the ranks' caches."""
    sched = kv.SchedulerLogic(s, kv.ChunkStore(s), BS, kv.all_units(HEADS, s.head_group))
    r2 = Req(r.request_id + "-load", 0, r.num_prompt_tokens)
    r2.block_hashes = r.block_hashes
    n = lookup(sched, r2)
    sched.after_alloc(r2, n)
    plan = sched.build([(r2.request_id, ids, n, 1)], [])
    ranks = []
    for rank in range(tp):
        h0, h1, stores = kv.rank_heads(rank, tp, HEADS)
        mine = rank_view(caches, h0, h1)
        work = kv.WorkerLogic(s, kv.ChunkStore(s), BS, kv.Shard(h0, stores=stores))
        work.register(mine)
        step(work, plan)
        assert not work.take_load_errors()
        work.close()
        ranks.append(mine)
    sched.close()
    return n, ranks


@needs_daemons
@pytest.mark.parametrize("save_tp,load_tp", [(2, 1), (1, 2), (4, 1)])
def test_caches_move_between_tensor_parallel_sizes(pool, save_tp, load_tp):
    s = settings(pool, "lossless")
    s = kv.Settings(**{**s.__dict__, "model": f"test/vllm-tp{save_tp}-{load_tp}"})
    a = paged(40 + save_tp)
    r, ids = tp_save(s, 40 + 10 * save_tp + load_tp, 2 * CT + 3, a, save_tp)
    b = paged(50)
    ids_b = [30 + i for i in range(len(ids))]
    n, ranks = tp_load(s, r, b, ids_b, load_tp)
    assert n == 2 * CT
    for rank, mine in enumerate(ranks):
        h0, h1, _ = kv.rank_heads(rank, load_tp, HEADS)
        for name in a:
            assert torch.equal(mine[name][ids_b[:2 * CB]], a[name][ids[:2 * CB], h0:h1])


@needs_daemons
def test_a_missing_head_is_a_miss_for_the_whole_chunk(pool):
    """A chunk is a hit only when every head of it is held (a rank of the writer failed)."""
    s = settings(pool, "lossless")
    s = kv.Settings(**{**s.__dict__, "model": "test/vllm-tp-partial"})
    a = paged(60)
    r, ids = tp_save(s, 60, 2 * CT + 1, a, 2)
    h1 = kv.chunk_hashes(r.block_hashes, CB)[1]
    kvcomp.Client(list(s.endpoints)).delete(s.model, kv.shard_key(h1, kv.unit_name(1, 2)))
    n, _ = tp_load(s, r, paged(61), [30 + i for i in range(len(ids))], 1)
    assert n == CT


@needs_daemons
def test_connector_counters(pool):
    s = settings(pool, "lossless")
    s = kv.Settings(**{**s.__dict__, "model": "test/vllm-stats"})
    a = paged(70)
    sched, work = engine(s, a)
    r = Req("st", 70, 2 * CT + 1)
    lookup(sched, r)
    sched.after_alloc(r, 0)
    step(work, sched.build([(r.request_id, list(range(1, 6)), 0, 2 * CT + 1)], []))
    c = work.store.stats.take()
    assert c["lookups"] == 1 and c["saved_units"] == 2 * len(UNITS)
    assert c["original_bytes"] == 2 * LAYERS * HEADS * CT * D * 2 * 2  # keys + values, fp16
    assert c["stored_bytes"] > 0
    assert work.store.stats.take() == {}  # taken: reset
    work.close()
    sched.close()


# --- vLLM's own classes (scripts/test_vllm.sh runs these in a virtual environment with vllm) --

def _vllm():
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
        return True
    except Exception:
        return False


needs_vllm = pytest.mark.skipif(not _vllm(), reason="vllm not installed (scripts/test_vllm.sh)")


def _endpoints(daemons):
    return [f"{p.data_endpoint},127.0.0.1:{p.control_port}" for p in daemons]


def _vllm_config(model_dir, endpoints, codec="lossless", tp=1, model=None, **opts):
    """A VllmConfig for the tiny local Llama with the connector on, on a CPU device, and the
    KV cache config of one rank (HEADS / tp KV heads)."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig, VllmConfig)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    extra = dict(endpoints=list(endpoints), codec=codec, chunk_blocks=CB,
                 model=model or f"test/vllm-real-{codec}", **opts)
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                                 skip_tokenizer_init=True, dtype="float16", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, gpu_memory_utilization=0.9,
                                 enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvcompConnector",
            kv_connector_module_path="kvcomp.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = NBLOCKS
    kcc = KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                         FullAttentionSpec(block_size=BS, num_kv_heads=HEADS // tp,
                                           head_size=D, dtype=torch.float16))])
    return vc, kcc


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory, pool):
    """vllm_env(codec, daemons=pool, tp=1, model=None, **options): a VllmConfig for a tiny
    local Llama (config only, no weights) with the connector on, on a CPU device, and its KV
    cache config."""
    from transformers import LlamaConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=HEADS * 2 * D, intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS * 2, num_key_value_heads=HEADS, head_dim=D,
                vocab_size=1000, max_position_embeddings=4096).save_pretrained(d)
    init_none_hash(sha256)

    def config(codec="lossless", daemons=None, **kw):
        return _vllm_config(d, _endpoints(pool if daemons is None else daemons), codec, **kw)
    config.model_dir = d
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


def _vllm_step(sched, worker, caches, before_load=None, token=7, outputs=None,
               transfers=None):
    """schedule -> the worker's connector calls around a forward -> update_from_output. While
    the connector's lookups are in flight vLLM schedules nothing new: those empty steps run
    (as vLLM's engine runs them) until a step schedules tokens or nothing waits."""
    for _ in range(5000):
        so = sched.schedule()
        if so.total_num_scheduled_tokens or not sched.get_request_counts()[1]:
            break
        _vllm_finish_step(sched, worker, caches, so, None, token, outputs, transfers)
        time.sleep(0.001)
    return so, _vllm_finish_step(sched, worker, caches, so, before_load, token, outputs,
                                 transfers)


def _vllm_finish_step(sched, worker, caches, so, before_load, token, outputs, transfers=None):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    if before_load is not None:
        before_load(so)
    worker.bind_connector_metadata(so.kv_connector_metadata)
    # vLLM starts a step's loads before the forward when one of them is synchronous, after it
    # launched when all are asynchronous (kv_connector_model_runner_mixin).
    if so.has_sync_kv_loads:
        worker.start_load_kv(None)
    for name, t in caches.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, t, None)
    if not so.has_sync_kv_loads:
        worker.start_load_kv(None)
    worker.wait_for_save()
    worker.worker.uploader.flush()
    results = worker.get_transfer_results(so.finished_req_ids)
    if transfers is not None:
        transfers.append(results)
    errors = worker.get_block_ids_with_load_errors()
    stats = worker.get_kv_connector_stats()
    worker.clear_connector_metadata()
    ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    out = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids], logprobs=None, prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(finished_sending=results.finished_sending,
                                              finished_recving=results.finished_recving,
                                              failed_recving=results.failed_recving,
                                              invalid_block_ids=errors,
                                              kv_connector_stats=stats))
    res = sched.update_from_output(so, out)
    if outputs is not None:
        outputs.append(res)
    return errors


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
    keys = kv.unit_keys(hashes, UNITS)
    # KV exists for every token but the last sampled: 4 * CT + 4 tokens, four chunks, the last
    # two completed while decoding and stored when the request finished.
    assert len(r.all_token_ids) == 4 * CT + 5 and len(keys) == 4 * len(UNITS)
    assert worker.worker.store.client.lookup_prefix(sched.connector.settings.model,
                                                    keys) == 4 * len(UNITS)

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
@pytest.mark.parametrize("failure", ["missing", "checksum", "daemon_gone", "timeout"])
def test_vllm_real_load_failure_is_recomputed(vllm_env, lone, failure):
    """Each way a load fails after vLLM's scheduler counted the hit, on one daemon: vLLM
    (kv_load_failure_policy "recompute") rolls the request back to its first bad block and
    computes the rest; the blocks are never written from a failed chunk."""
    cfg = vllm_env("lossless", daemons=[lone], model="test/vllm-fail-" + failure, timeout=1.0)
    a = paged(23)
    sched, worker = _vllm_engine(cfg, a)
    prompt = list(range(500, 500 + 3 * CT + 1))
    sched.add_request(_vllm_request("c", prompt))
    _vllm_step(sched, worker, a)
    model = sched.connector.settings.model

    b = paged(24)
    before = {n: t.clone() for n, t in b.items()}
    sched2, worker2 = _vllm_engine(vllm_env("lossless", daemons=[lone], model=model,
                                            timeout=1.0), b)
    r2 = _vllm_request("d", prompt, max_tokens=4)
    sched2.add_request(r2)
    h1 = kv.chunk_hashes(r2.block_hashes, CB)[1]
    first_bad = 0 if failure in ("daemon_gone", "timeout") else 1

    def fail(so):  # after vLLM's scheduler counted 3 chunks, before the worker loads
        assert so.scheduled_new_reqs[0].num_computed_tokens == 3 * CT
        store = worker2.worker.store
        if failure == "missing":
            store.client.delete(model, kv.shard_key(h1, U0))
        elif failure == "checksum":
            store.client = FlipByte(store.client, len(UNITS))  # chunk 1, head 0
        elif failure == "daemon_gone":
            lone.proc.kill()
            lone.proc.wait()
        else:
            sigstop(lone.proc)

    try:
        so, errors = _vllm_step(sched2, worker2, b, before_load=fail)
    finally:
        if failure == "timeout":
            os.kill(lone.proc.pid, signal.SIGCONT)
    ids_b = so.scheduled_new_reqs[0].block_ids[0]
    assert errors == set(ids_b[first_bad * CB:3 * CB])
    for name in a:
        bad = ids_b[first_bad * CB:3 * CB]
        assert torch.equal(b[name][bad], before[name][bad])
    # vLLM (kv_load_failure_policy "recompute") rolls the request back to its first bad block.
    assert r2.num_computed_tokens == first_bad * CT
    so, errors = _vllm_step(sched2, worker2, b)
    assert so.num_scheduled_tokens["d"] == (3 - first_bad) * CT + 1 and not errors
    worker.shutdown()
    worker2.shutdown()
    sched.connector.shutdown()
    sched2.connector.shutdown()


@needs_daemons
@needs_vllm
def test_vllm_real_scheduler_never_waits_for_a_stopped_daemon(vllm_env, lone):
    """The daemon SIGSTOPped: vLLM's schedule() returns at once while the lookup is in flight
    (the request waits, others run), and the request runs as a miss once lookup_timeout
    passes."""
    cfg = vllm_env("lossless", daemons=[lone], model="test/vllm-stopped", lookup_timeout=0.5)
    a = paged(25)
    sched, worker = _vllm_engine(cfg, a)
    prompt = list(range(700, 700 + 2 * CT + 1))
    sched.add_request(_vllm_request("e", prompt))
    _vllm_step(sched, worker, a)
    b = paged(26)
    sched2, worker2 = _vllm_engine(vllm_env("lossless", daemons=[lone],
                                            model="test/vllm-stopped", lookup_timeout=0.5), b)
    r2 = _vllm_request("f", prompt, max_tokens=1)
    sigstop(lone.proc)
    try:
        sched2.add_request(r2)
        t0, slowest, empty = time.monotonic(), 0.0, 0
        while True:
            t = time.monotonic()
            so = sched2.schedule()
            slowest = max(slowest, time.monotonic() - t)
            if so.total_num_scheduled_tokens:
                break
            empty += 1
            _vllm_finish_step(sched2, worker2, b, so, None, 7, None)
            time.sleep(0.01)
        took = time.monotonic() - t0
    finally:
        os.kill(lone.proc.pid, signal.SIGCONT)
    assert empty >= 1 and slowest < 0.4, (empty, slowest)   # "not yet", never a wait
    assert took < 0.5 + 1.0, took                           # a miss by the deadline
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and \
        so.num_scheduled_tokens["f"] == 2 * CT + 1
    _vllm_finish_step(sched2, worker2, b, so, None, 7, None)
    for c in (worker, worker2, sched.connector, sched2.connector):
        c.shutdown()


@needs_daemons
@needs_vllm
def test_vllm_real_connector_stats_reach_the_scheduler_stats(vllm_env):
    """Worker and scheduler counters go through vLLM's hook (get_kv_connector_stats, the
    class's build_kv_connector_stats) into the scheduler's stats."""
    from kvcomp.integrations.vllm import KvcompConnector, KvcompConnectorStats

    cfg = vllm_env("lossless", model="test/vllm-stats-real")
    a = paged(27)
    sched, worker = _vllm_engine(cfg, a)
    sched.add_request(_vllm_request("g", list(range(900, 900 + 2 * CT + 1))))
    outputs = []
    _vllm_step(sched, worker, a, outputs=outputs)
    stats = [o.scheduler_stats.kv_connector_stats for res in outputs for o in res.values()
             if o.scheduler_stats is not None and o.scheduler_stats.kv_connector_stats]
    total = KvcompConnector.build_kv_connector_stats({})
    for d in stats:
        total.aggregate(KvcompConnector.build_kv_connector_stats(d))
    assert isinstance(total, KvcompConnectorStats)
    got = total.reduce()
    assert got["lookups"] == 1 and got["saved_units"] == 2 * len(UNITS)
    assert got["compression_ratio"] > 0
    worker.shutdown()
    sched.connector.shutdown()


# --- tensor parallelism with vLLM's parallel state: one CPU process per rank ----------------

def _tp_rank(rank, tp, port, model_dir, endpoints, model, seed, conn):
    """One tensor-parallel rank: vLLM's distributed state (gloo on CPU) set for `rank` of `tp`,
    the worker-side connector built by vLLM's factory over this rank's heads of paged(seed).
    Runs each step's metadata it receives; answers the load errors and its blocks."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 init_distributed_environment,
                                                 initialize_model_parallel)

    vc, kcc = _vllm_config(model_dir, endpoints, tp=tp, model=model)
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)
        assert get_tensor_model_parallel_rank() == rank
        h0, h1, _ = kv.rank_heads(rank, tp, HEADS)
        caches = rank_view(paged(seed), h0, h1)
        worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
        worker.register_kv_caches(caches)
        while True:
            meta = conn.recv()
            if meta is None:
                break
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            for name, t in caches.items():
                worker.wait_for_layer_load(name)
                worker.save_kv_layer(name, t, None)
            worker.wait_for_save()
            worker.worker.uploader.flush()
            errors = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            conn.send((errors, {n: t.clone() for n, t in caches.items()}))
        worker.shutdown()
    conn.send("done")


class _TpGroup:
    """`tp` rank processes (spawned), driven step by step from vLLM's scheduler here."""

    def __init__(self, tp, model_dir, endpoints, model, seed):
        import multiprocessing
        import socket

        ctx = multiprocessing.get_context("spawn")
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        self.conns, self.procs = [], []
        for rank in range(tp):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_tp_rank, args=(rank, tp, port, model_dir, endpoints, model,
                                                   seed, theirs), daemon=True)
            p.start()
            self.conns.append(mine)
            self.procs.append(p)

    def step(self, meta):
        """Every rank runs the step (the metadata pickled, as vLLM's executor sends it)."""
        for c in self.conns:
            c.send(meta)
        return [c.recv() for c in self.conns]

    def close(self):
        for c in self.conns:
            c.send(None)
        for c, p in zip(self.conns, self.procs):
            assert c.recv() == "done"
            p.join(60)
            assert p.exitcode == 0


def _tp_run(vllm_env, tp, prompt, req_id, seed, model):
    """vLLM's scheduler for a TP=tp engine driving tp rank processes over one request until
    it finishes; returns the first step's output and the ranks' answers to it."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    vc, kcc = vllm_env("lossless", tp=tp, model=model)
    sched = Scheduler(vllm_config=vc, kv_cache_config=kcc, log_stats=False,
                      structured_output_manager=StructuredOutputManager(vc), block_size=BS)
    group = _TpGroup(tp, vllm_env.model_dir, vc.kv_transfer_config.kv_connector_extra_config[
        "endpoints"], model, seed)
    try:
        sched.add_request(_vllm_request(req_id, prompt, max_tokens=1))
        first = None
        for _ in range(5000):
            so = sched.schedule()
            answers = group.step(so.kv_connector_metadata)
            errors = set().union(*[a[0] for a in answers])
            if so.total_num_scheduled_tokens and first is None:
                first = (so, answers, errors)
            ids = [r.req_id for r in so.scheduled_new_reqs] + \
                list(so.scheduled_cached_reqs.req_ids)
            sched.update_from_output(so, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(invalid_block_ids=errors)))
            if first is not None and not sched.has_unfinished_requests():
                break
            time.sleep(0.001)
    finally:
        group.close()
        sched.connector.shutdown()
    return first


@needs_daemons
@needs_vllm
@pytest.mark.parametrize("save_tp,load_tp", [(2, 1), (1, 2)])
def test_vllm_real_tensor_parallel_caches_load_at_another_size(vllm_env, save_tp, load_tp):
    """A prompt computed by a TP=save_tp engine (one process per rank, vLLM's parallel state
    set per rank, each saving its own heads) is loaded by a TP=load_tp engine: vLLM's scheduler
    counts the held prefix and every rank's blocks receive its heads bit for bit."""
    model = f"test/vllm-real-tp{save_tp}-{load_tp}"
    prompt = list(range(1300 + 10 * save_tp, 1300 + 10 * save_tp + 2 * CT + 3))
    so, _, errors = _tp_run(vllm_env, save_tp, prompt, "w", 80, model)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and not errors
    ids_a = so.scheduled_new_reqs[0].block_ids[0]
    so, answers, errors = _tp_run(vllm_env, load_tp, prompt, "r", 81, model)
    assert not errors
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 2 * CT and so.num_scheduled_tokens["r"] == 3
    ids_b = new.block_ids[0][:2 * CB]
    a = paged(80)
    for rank, (_, caches) in enumerate(answers):
        h0, h1, _ = kv.rank_heads(rank, load_tp, HEADS)
        for name in a:
            assert torch.equal(caches[name][ids_b], a[name][ids_a[:2 * CB], h0:h1])


# --- hybrid models through vLLM's hybrid KV cache manager (SupportsHMA) --------------------

WINDOW = 2 * BS  # the sliding-window layers' window, in tokens


def _hybrid_vllm_config(vllm_env, **kw):
    """The tiny model's config with layers 0 and 2 full attention and 1 and 3 sliding window,
    grouped by vLLM's own get_kv_cache_groups under its hybrid KV cache manager."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            SlidingWindowSpec)

    vc, _ = vllm_env("lossless", **kw)
    # vLLM keeps its hybrid KV cache manager on for a connector that supports it (on a GPU
    # platform; a CPU platform turns it off whatever the connector, so it is set here).
    assert KVConnectorFactory.supports_hma_config(vc.kv_transfer_config)
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    vc.cache_config.kv_cache_layout = "LBHNC"  # per layer [blocks, heads, tokens, K + V]
    spec = dict(block_size=BS, num_kv_heads=HEADS, head_size=D, dtype=torch.float16)
    specs = {n: FullAttentionSpec(**spec) for n in HYBRID[0]}
    specs.update({n: SlidingWindowSpec(**spec, sliding_window=WINDOW) for n in HYBRID[1]})
    groups = get_kv_cache_groups(vc, specs)
    assert [list(g.layer_names) for g in groups] == [HYBRID[0], HYBRID[1]]
    return vc, KVCacheConfig(num_blocks=NBLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


@needs_daemons
@needs_vllm
def test_vllm_real_hybrid_model_loads_both_groups(vllm_env):
    """vLLM's Scheduler with its hybrid KV cache manager: engine A saves every chunk of both
    groups; engine B's request waits while the connector loads it (asynchronously, between
    steps), then runs with the held prefix counted: the full-attention blocks and the
    sliding-window blocks inside the window hold A's KV, the null block is never written."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    a = paged_hybrid(71)
    sched, worker = _vllm_engine(_hybrid_vllm_config(vllm_env, model="test/vllm-real-hybrid"),
                                 a)
    assert isinstance(sched.connector, SupportsHMA)
    assert type(sched.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert sched.kv_cache_manager.block_pool.null_block.block_id == kv.NULL_BLOCK
    prompt = list(range(700, 700 + 3 * CT + 5))
    sched.add_request(_vllm_request("ha", prompt))
    so, _ = _vllm_step(sched, worker, a)
    ids_a = so.scheduled_new_reqs[0].block_ids
    assert len(ids_a) == 2
    assert [s.chunk for s in so.kv_connector_metadata.plan.saves] == [0, 1, 2]
    for _ in range(3):
        _vllm_step(sched, worker, a)
    model = sched.connector.settings.model
    keys = kv.unit_keys(kv.chunk_hashes(_vllm_request("x", prompt).block_hashes, CB), HUNITS)
    assert worker.worker.store.client.lookup_prefix(model, keys) == 3 * len(HUNITS)

    b = paged_hybrid(72)
    before = {n: t.clone() for n, t in b.items()}
    sched2, worker2 = _vllm_engine(_hybrid_vllm_config(vllm_env, model=model), b)
    sched2.add_request(_vllm_request("hb", prompt))
    transfers = []
    so, errors = _vllm_step(sched2, worker2, b, transfers=transfers)
    assert not errors
    assert {"hb"} == set().union(*(t.finished_recving for t in transfers))
    assert not any(t.failed_recving for t in transfers)
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 3 * CT and so.num_scheduled_tokens["hb"] == 5
    full_b, window_b = new.block_ids
    for name in HYBRID[0]:
        assert torch.equal(b[name][full_b[:3 * CB]], a[name][ids_a[0][:3 * CB]])
    live = [i for i, x in enumerate(window_b[:3 * CB]) if x != kv.NULL_BLOCK]
    assert 0 < len(live) < 3 * CB  # vLLM allocated the window's blocks only
    for name in HYBRID[1]:
        assert torch.equal(b[name][[window_b[i] for i in live]],
                           a[name][[ids_a[1][i] for i in live]])
    for name in b:
        assert torch.equal(b[name][kv.NULL_BLOCK], before[name][kv.NULL_BLOCK])
    for w in (worker, worker2, sched.connector, sched2.connector):
        w.shutdown()


@needs_daemons
@needs_vllm
def test_vllm_real_hybrid_failed_load_recomputes_the_request(vllm_env):
    """A sliding-window unit of chunk 1 fails its checksum on engine B's load: the connector
    reports the request's load failed (vLLM refuses block-level errors with several KV cache
    groups), vLLM (kv_load_failure_policy "recompute") computes the whole prompt, the
    connector does not offer the hit again, and no block was written from the pool."""
    a = paged_hybrid(73)
    sched, worker = _vllm_engine(
        _hybrid_vllm_config(vllm_env, model="test/vllm-real-hybrid-fail"), a)
    prompt = list(range(900, 900 + 3 * CT + 5))
    sched.add_request(_vllm_request("hc", prompt))
    for _ in range(3):
        _vllm_step(sched, worker, a)
    model = sched.connector.settings.model

    b = paged_hybrid(74)
    before = {n: t.clone() for n, t in b.items()}
    sched2, worker2 = _vllm_engine(_hybrid_vllm_config(vllm_env, model=model), b)
    store = worker2.worker.store
    store.client = FlipByte(store.client, len(HUNITS) + len(UNITS))  # chunk 1, window, head 0
    r = _vllm_request("hd", prompt)
    sched2.add_request(r)
    transfers = []
    so, errors = _vllm_step(sched2, worker2, b, transfers=transfers)
    assert not errors
    assert {"hd"} == set().union(*(t.failed_recving for t in transfers))
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 0 and so.num_scheduled_tokens["hd"] == len(prompt)
    assert not so.kv_connector_metadata.plan.loads
    for name in b:
        assert torch.equal(b[name], before[name])
    for w in (worker, worker2, sched.connector, sched2.connector):
        w.shutdown()


# --- vLLM's own step and layer hooks around a forward ------------------------------------

def _vllm_forward_step(sched, worker, vc, attention):
    """One engine step as vLLM's model runner makes it: the step's connector calls from vLLM's
    KVConnectorModelRunnerMixin inside vLLM's set_forward_context, and for a step with tokens a
    "forward" that calls `attention(query, layer_name)` for every layer in order, a function
    wrapped in vLLM's maybe_transfer_kv_layer (the hook vLLM's attention layers run under: wait
    for the layer's load on entry, save the layer on exit). Steps without tokens (lookups in
    flight) run as vLLM's kv_connector_no_forward."""
    import vllm.distributed.kv_transfer.kv_transfer_state as state
    from vllm.forward_context import set_forward_context
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as M

    prev, state._KV_CONNECTOR_AGENT = state._KV_CONNECTOR_AGENT, worker
    try:
        for _ in range(5000):
            so = sched.schedule()
            if so.total_num_scheduled_tokens or not sched.get_request_counts()[1]:
                break
            sched.update_from_output(so, M.kv_connector_no_forward(so, vc))
            time.sleep(0.001)
        names = list(vc.compilation_config.static_forward_context)
        with set_forward_context({n: object() for n in names}, vc, slot_mapping={}):
            with M.maybe_get_kv_connector_output(so) as out:
                for name in names:
                    attention(None, name)
        worker.worker.uploader.flush()
        ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        sched.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=None, kv_connector_output=out))
        return so, out
    finally:
        state._KV_CONNECTOR_AGENT = prev


def _capture_blocks(sched, blocks, key):
    """Records the first scheduled request's blocks of each step that schedules tokens."""
    real = sched.schedule

    def schedule():
        so = real()
        if so.total_num_scheduled_tokens:
            blocks[key] = so.scheduled_new_reqs[0].block_ids[0]
        return so
    sched.schedule = schedule


@needs_daemons
@needs_vllm
def test_vllm_real_layer_hooks_save_after_the_kv_write_and_load_before_the_layer(vllm_env):
    """Through vLLM's own step (KVConnectorModelRunnerMixin) and layer hook
    (maybe_transfer_kv_layer): engine A's "attention" writes each layer's new KV into the
    request's blocks; each layer is copied out as it ends, before the next runs, and what the
    pool holds afterwards is the KV written (saved after the write, not before); engine B's "attention" finds the held prefix already in its blocks on
    entry to each layer (each layer loaded before it runs)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

    prompt = list(range(300, 300 + 2 * CT + 5))
    g = torch.Generator().manual_seed(83)
    written = {f"model.layers.{i}.self_attn.attn":
               torch.randn(2 * CB + 1, HEADS, BS, 2 * D, generator=g).half()
               for i in range(LAYERS)}

    def engine_with_layers(caches, model):
        cfg = vllm_env("lossless", model=model)
        vc, _ = cfg
        sched, worker = _vllm_engine(cfg, caches)
        vc.compilation_config.static_forward_context.clear()
        for name, t in caches.items():  # what vLLM's attention layers hold: their KV cache
            vc.compilation_config.static_forward_context[name] = SimpleNamespace(kv_cache=t)
        return sched, worker, vc

    a = paged(81)
    sched, worker, vc = engine_with_layers(a, "test/vllm-layer-hooks")
    sched.add_request(_vllm_request("la", prompt))
    order, saved_before = [], []
    blocks = {}

    @maybe_transfer_kv_layer
    def write_kv(query, layer_name):  # the layer's KV write (vLLM's cache update), in order
        order.append(layer_name)
        saved_before.append(sorted(worker.worker._saved_layers))
        a[layer_name][blocks["a"]] = written[layer_name]

    _capture_blocks(sched, blocks, "a")
    _, out = _vllm_forward_step(sched, worker, vc, write_kv)
    assert order == list(a)
    # Layer by layer: each layer's blocks were copied out as it ended (vLLM's hook), before the
    # next one ran, although vLLM starts this step's (absent) loads only after the forward.
    assert saved_before == [sorted(order[:i]) for i in range(LAYERS)]
    assert not out.invalid_block_ids
    model = sched.connector.settings.model

    b = paged(82)
    sched2, worker2, vc2 = engine_with_layers(b, model)
    sched2.add_request(_vllm_request("lb", prompt))
    checked = []

    @maybe_transfer_kv_layer
    def check_loaded(query, layer_name):  # on entry: the held prefix is in this layer's blocks
        ids = blocks["b"][:2 * CB]
        checked.append(torch.equal(b[layer_name][ids], written[layer_name][:2 * CB]))

    _capture_blocks(sched2, blocks, "b")
    so, out = _vllm_forward_step(sched2, worker2, vc2, check_loaded)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 2 * CT
    assert checked == [True] * LAYERS and not out.invalid_block_ids
    for w in (worker, worker2, sched.connector, sched2.connector):
        w.shutdown()

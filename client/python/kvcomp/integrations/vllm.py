"""kvcomp as a vLLM v1 KV connector (vLLM's KVConnectorBase_V1).

Turn it on with (docs/integrations.md, "vLLM"):

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvcompConnector",
        "kv_connector_module_path":"kvcomp.integrations.vllm","kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"endpoints":["10.0.0.5:7420,10.0.0.5:7421"]}}'

What it stores: the KV cache of every whole chunk of `chunk_blocks` vLLM blocks, one kvcomp cache
per chunk, pipeline stage and unit of `head_group` KV heads, under the chunk's last chained block
hash (which names the whole prefix up to it) and the unit's head range in the model's numbering.
Each tensor-parallel rank stores and loads only its own heads, so caches written at one TP size
load at another (a rank holding heads [4, 8) loads units kvh4-5 .. kvh7-8 whoever wrote them).
Chunks are full length: vLLM's scheduler counts a loaded prefix in prompt positions, so the
connector cannot hand it fewer tokens than the prefix has; no token is evicted. The codecs
compress: int8 keys and KVSplice values ("kvsplice", the daemon calibrates a projection per model
from the chunks it stores), int8 keys only ("int8"), or nothing ("lossless": bit-exact).

Scheduler side: get_num_new_matched_tokens starts a background lookup of how many leading chunks
the pool holds in full (one Client.lookup_prefix over every unit, on a client whose requests end
after lookup_timeout) and answers None ("not yet") while it is in flight; an answer not in by
lookup_timeout is a miss, so a stalled pool never holds the scheduler. update_state_after_alloc
and build_connector_meta turn hits into loads into the request's blocks and newly computed prompt
chunks into saves; request_finished saves the chunks completed while decoding, holding the
request's blocks until the worker has copied them to host memory (get_finished reports it).
Worker side: start_load_kv fetches the chunks' bytes (Client.get_chunk_bytes, decoded by the
daemons, within `timeout`) and parses them here (CRC32C of header, table and every section);
wait_for_layer_load writes each layer into vLLM's paged blocks; save_kv_layer copies the saved
blocks of each layer to pinned host memory as the layer finishes, wait_for_save waits for those
copies and hands the units to a background uploader. A missing unit, one failing its CRC, of
another layout, a daemon gone or a fetch past its timeout makes the chunk's blocks (and every
later block of that request's load) load errors (get_block_ids_with_load_errors), which vLLM
recomputes under kv_load_failure_policy "recompute": never wrong KV. Counters (lookups, hits,
timeouts, loads, load errors, saves, bytes stored against original) go to vLLM's connector stats
(get_kv_connector_stats, build_kv_connector_stats).

Hybrid models (vLLM's SupportsHMA: full-attention and sliding-window KV cache groups, each with
its own blocks): every chunk is stored as units of each group; loads run between steps (the
request waits for them; a failure fails the request's whole load, which vLLM recomputes, as it
accepts no block-level errors with several groups), writing the sliding-window blocks vLLM
allocated inside the window and never its null block; a chunk is stored only while all its
blocks exist. Other groups (Mamba and other state, MLA, chunked local) are refused at start.

The vLLM-independent parts (settings, keys, chunk planning, block gather/scatter on torch
tensors, the store, the scheduler and worker logic) import without vllm; KvcompConnector itself is
built on first access, importing vllm then.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

log = logging.getLogger("kvcomp.vllm")

CODECS = ("kvsplice", "int8", "lossless")
_KEY_PREFIX = b"vllm:"


# --- settings -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """The connector's options (kv_connector_extra_config), each with its default.

    endpoints: kvcompd endpoints "data_host:port,control_host:port" (list, or a space-separated
        string; default $KVCOMP_ENDPOINTS). The control address is required (prefix lookups).
    model: the kvcomp model id the chunks are stored under (default: vLLM's model name).
    tenant, token: credentials (default $KVCOMP_TENANT, $KVCOMP_TOKEN).
    codec: "kvsplice" (int8 keys, KVSplice values once the daemons hold a projection for the
        model; int8 keys and raw values until then), "int8" (int8 keys, raw values), or
        "lossless" (raw keys and values, bit-exact).
    chunk_blocks: vLLM blocks per stored chunk (default 4: 64 tokens at block size 16).
    error_budget: relative value error the daemons calibrate KVSplice to (default 0.05).
    calibrate_after: chunks stored with raw values before the connector asks the daemons to
        calibrate the model's projection (codec "kvsplice"; default 32; 0 = never ask).
    save_decode: also store chunks completed while decoding, at request end (default true).
    timeout: seconds per SDK put or get (default 10); a load past it is a load error
        (recomputed).
    lookup_timeout: seconds the scheduler waits for a prefix lookup before counting it a miss
        (default 0.5). The lookup runs in the background: get_num_new_matched_tokens answers
        "not yet" (None) while it is in flight, so a stalled pool never holds the scheduler.
    async_lookup: answer "not yet" while a lookup is in flight (default true); false waits for
        it, up to lookup_timeout.
    head_group: KV heads per stored unit (default 1). Each tensor-parallel rank stores and loads
        its own heads in units of head_group, keyed by head range, so caches written at one
        tensor-parallel size load at another whose ranks hold whole units (head_group must divide
        every rank's head count; 1 always does). Larger units mean fewer requests.
    max_pending_uploads: chunks waiting for the uploader before new ones are dropped (default
        256; a dropped chunk is a later miss, never an error).
    """

    endpoints: Tuple[str, ...]
    model: str
    tenant: str = ""
    token: str = ""
    codec: str = "kvsplice"
    chunk_blocks: int = 4
    error_budget: float = 0.05
    calibrate_after: int = 32
    save_decode: bool = True
    timeout: float = 10.0
    lookup_timeout: float = 0.5
    async_lookup: bool = True
    head_group: int = 1
    max_pending_uploads: int = 256

    @staticmethod
    def from_extra_config(extra: Optional[Mapping[str, Any]], default_model: str) -> "Settings":
        """Validated settings; ValueError names the bad or unknown option."""
        extra = dict(extra or {})
        known = {f for f in Settings.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvcomp connector: unknown option(s) {unknown}; known: "
                             f"{sorted(known)}")
        eps = extra.get("endpoints", os.environ.get("KVCOMP_ENDPOINTS", ""))
        if isinstance(eps, str):
            eps = eps.split()
        eps = tuple(str(e) for e in eps)
        if not eps:
            raise ValueError("kvcomp connector: no endpoints (set kv_connector_extra_config "
                             "endpoints or KVCOMP_ENDPOINTS)")
        for e in eps:
            if "," not in e and not e.startswith("dns:"):
                raise ValueError(f"kvcomp connector: endpoint {e!r} has no control address "
                                 "(give \"data_host:port,control_host:port\")")
        s = Settings(
            endpoints=eps,
            model=str(extra.get("model") or default_model),
            tenant=str(extra.get("tenant", os.environ.get("KVCOMP_TENANT", ""))),
            token=str(extra.get("token", os.environ.get("KVCOMP_TOKEN", ""))),
            codec=str(extra.get("codec", "kvsplice")),
            chunk_blocks=int(extra.get("chunk_blocks", 4)),
            error_budget=float(extra.get("error_budget", 0.05)),
            calibrate_after=int(extra.get("calibrate_after", 32)),
            save_decode=bool(extra.get("save_decode", True)),
            timeout=float(extra.get("timeout", 10.0)),
            lookup_timeout=float(extra.get("lookup_timeout", 0.5)),
            async_lookup=bool(extra.get("async_lookup", True)),
            head_group=int(extra.get("head_group", 1)),
            max_pending_uploads=int(extra.get("max_pending_uploads", 256)))
        if not s.model:
            raise ValueError("kvcomp connector: empty model id")
        if s.codec not in CODECS:
            raise ValueError(f"kvcomp connector: codec {s.codec!r} not one of {CODECS}")
        if s.chunk_blocks <= 0:
            raise ValueError("kvcomp connector: chunk_blocks must be positive")
        if not 0.0 < s.error_budget < 1.0:
            raise ValueError("kvcomp connector: error_budget must be in (0, 1)")
        if s.calibrate_after < 0 or s.max_pending_uploads <= 0 or s.timeout <= 0 \
                or s.lookup_timeout <= 0:
            raise ValueError("kvcomp connector: calibrate_after >= 0, max_pending_uploads > 0, "
                             "timeout > 0 and lookup_timeout > 0 required")
        if s.head_group <= 0:
            raise ValueError("kvcomp connector: head_group must be positive")
        return s


def policy_for(codec: str, kvsplice_values: bool) -> Any:
    """The kvcomp.Policy a chunk is stored with: every token kept, no moments."""
    import kvcomp

    if codec == "lossless":
        return kvcomp.Policy(ratio=0.0, moments=False)
    if codec == "int8" or not kvsplice_values:
        return kvcomp.Policy(ratio=0.0, moments=False, key_codec="int8")
    return kvcomp.Policy(ratio=0.0, moments=False, key_codec="int8",
                         value_codec="orthogonal_int8")


# --- keys and plans -------------------------------------------------------------------------

def hash_bytes(h: Any) -> bytes:
    """vLLM's block hash (bytes, or an int for non-cryptographic hash functions) as bytes."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, int):
        return str(h).encode()
    raise TypeError(f"block hash of type {type(h).__name__}")


def chunk_hashes(block_hashes: Sequence[Any], chunk_blocks: int,
                 max_chunks: Optional[int] = None) -> List[bytes]:
    """One hash per whole chunk: the chained hash of its last block (which covers the whole
    prefix up to the chunk's end)."""
    n = len(block_hashes) // chunk_blocks
    if max_chunks is not None:
        n = min(n, max_chunks)
    return [hash_bytes(block_hashes[(i + 1) * chunk_blocks - 1]) for i in range(n)]


@dataclass(frozen=True)
class Shard:
    """A worker's part of the model: its pipeline stage and its KV heads, from head0 (of the
    model's KV heads) on; stores is False for a rank whose heads another rank also holds and
    stores (tensor-parallel size above the KV head count)."""
    head0: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    stores: bool = True


def rank_heads(tp_rank: int, tp_size: int, total_kv_heads: int) -> Tuple[int, int, bool]:
    """The KV heads [h0, h1) vLLM gives tensor-parallel rank tp_rank, and whether it stores
    them (a replicated head is stored by its first rank only)."""
    if not 0 <= tp_rank < tp_size or total_kv_heads <= 0:
        raise ValueError(f"rank {tp_rank} of {tp_size}, {total_kv_heads} KV heads")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over {tp_size} ranks")
        per = total_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per, True
    if tp_size % total_kv_heads:
        raise ValueError(f"{tp_size} ranks do not replicate {total_kv_heads} KV heads evenly")
    rep = tp_size // total_kv_heads
    return tp_rank // rep, tp_rank // rep + 1, tp_rank % rep == 0


def unit_name(h0: int, h1: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """One stored unit of a chunk: KV heads [h0, h1) of pipeline stage pp_rank (part of the
    key; independent of the tensor-parallel size)."""
    return f"kvh{h0}-{h1}.pp{pp_rank}-{pp_size}"


def shard_units(shard: Shard, num_heads: int, head_group: int) -> List[Tuple[str, int, int]]:
    """(unit name, first local head, end local head) of each unit a worker holding num_heads
    heads from shard.head0 stores and loads."""
    if num_heads % head_group:
        raise ValueError(f"head_group {head_group} does not divide this rank's {num_heads} KV "
                         "heads")
    return [(unit_name(shard.head0 + h, shard.head0 + h + head_group, shard.pp_rank,
                       shard.pp_size), h, h + head_group)
            for h in range(0, num_heads, head_group)]


def all_units(total_kv_heads: int, head_group: int, pp_size: int = 1) -> List[str]:
    """Every unit of a chunk (all heads, all pipeline stages): what a prefix hit needs."""
    if total_kv_heads % head_group:
        raise ValueError(f"head_group {head_group} does not divide {total_kv_heads} KV heads")
    return [unit_name(h, h + head_group, p, pp_size) for p in range(pp_size)
            for h in range(0, total_kv_heads, head_group)]


def group_units(units: Sequence[str], groups: int) -> List[str]:
    """The units of a model whose layers vLLM splits into `groups` KV cache groups (hybrid
    models: full-attention and sliding-window layers), group-major: one model with one group
    keeps the plain names; with several, group g's units are named "g<g>of<groups>." + unit,
    so that the same model served without vLLM's hybrid KV cache manager (one group of every
    layer) never reads them."""
    if groups <= 0:
        raise ValueError(f"{groups} KV cache groups")
    if groups == 1:
        return list(units)
    return [f"g{g}of{groups}.{u}" for g in range(groups) for u in units]


def shard_key(chunk_hash: bytes, unit: str) -> bytes:
    """The kvcomp key of one unit of a chunk (the model id scopes it further)."""
    return _KEY_PREFIX + chunk_hash + b"/" + unit.encode()


def unit_keys(hashes: Sequence[bytes], units: Sequence[str]) -> List[bytes]:
    """Keys of the chunks' units, chunk-major: a leading run of n * len(units) keys held is n
    whole chunks."""
    return [shard_key(h, u) for h in hashes for u in units]


class Stats:
    """Counters of one connector half, taken (and reset) by vLLM's stats hook."""

    NAMES = ("lookups", "lookup_hit_chunks", "lookup_timeouts", "lookup_errors",
             "load_chunks", "load_error_blocks", "load_failures", "saved_units",
             "save_failures", "save_drops", "stored_bytes", "original_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Dict[str, float] = {}

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def get(self, name: str) -> float:
        with self._lock:
            return self._c.get(name, 0)

    def take(self) -> Dict[str, float]:
        with self._lock:
            out, self._c = self._c, {}
        return out


# vLLM's BlockPool takes its first block (id 0) as the null block: the place of a block a
# sliding-window group has freed (outside the window) or never needed, in a request's block ids.
# Only block ids of several groups (the hybrid KV cache manager) are read for it: with one group
# every block id is a block.
NULL_BLOCK = 0

GroupIds = List[List[int]]   # a request's block ids, one list per KV cache group


def per_group(block_ids: Any, groups: int) -> GroupIds:
    """Block ids as one list per KV cache group: a tuple/list of lists (vLLM's form), or, for
    a single group, a flat list of ids."""
    ids = list(block_ids or [])
    if groups == 1 and (not ids or not isinstance(ids[0], (list, tuple))):
        return [[int(b) for b in ids]]
    if len(ids) != groups:
        raise ValueError(f"block ids of {len(ids)} KV cache groups, expected {groups}")
    return [[int(b) for b in g] for g in ids]


def _live(ids: Iterable[int], groups: int) -> List[int]:
    """The ids that are blocks: all of them for one group, all but NULL_BLOCK for several."""
    return list(ids) if groups == 1 else [b for b in ids if b != NULL_BLOCK]


@dataclass
class ChunkLoad:
    """One chunk to load: its index in the request, hash, the request's blocks it covers (one
    list per KV cache group; NULL_BLOCK where a sliding-window group holds none) and how many of
    them (leading) already hold the KV (vLLM's own prefix cache) and are not written."""
    chunk: int
    chunk_hash: bytes
    block_ids: GroupIds
    skip_blocks: int = 0

    def targets(self, group: int) -> List[int]:
        """The blocks of one group this chunk writes (NULL_BLOCK where none)."""
        return self.block_ids[group][self.skip_blocks:]


@dataclass
class LoadSpec:
    """A request's chunks to load. async_load: loaded between vLLM's steps (the request waits
    for it, hybrid models); a failure fails the whole load (vLLM recomputes the request),
    where a step's synchronous load reports the blocks from the first failed chunk on."""
    req_id: str
    chunks: List[ChunkLoad]
    async_load: bool = False

    def block_ids(self) -> List[int]:
        """The blocks this load writes, every group's."""
        return [b for c in self.chunks for g in range(len(c.block_ids))
                for b in _live(c.targets(g), len(c.block_ids))]


@dataclass
class SaveSpec:
    """One chunk to store: the request's blocks holding its tokens, one list per group."""
    req_id: str
    chunk: int
    chunk_hash: bytes
    block_ids: GroupIds


@dataclass
class ConnectorPlan:
    """What the scheduler hands the workers for one step."""
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)          # layer by layer, this step
    finish_saves: Dict[str, List[SaveSpec]] = field(default_factory=dict)  # finished requests


def plan_load(req_id: str, hashes: Sequence[bytes], block_ids: Any, first_token: int,
              end_token: int, block_size: int, chunk_blocks: int,
              async_load: bool = False) -> LoadSpec:
    """The chunks covering tokens [first_token, end_token): first_token is block-aligned (vLLM's
    local prefix hit), end_token chunk-aligned (held chunks). block_ids: the request's blocks
    (per group, or a flat list for one group)."""
    ids = per_group(block_ids, len(block_ids) if block_ids and isinstance(
        list(block_ids)[0], (list, tuple)) else 1)
    chunk_tokens = block_size * chunk_blocks
    if first_token % block_size or end_token % chunk_tokens or first_token >= end_token:
        raise ValueError(f"load range [{first_token}, {end_token}) not aligned to blocks of "
                         f"{block_size} / chunks of {chunk_tokens}")
    if end_token // chunk_tokens > len(hashes) or \
            any(end_token // block_size > len(g) for g in ids):
        raise ValueError("load range past the request's hashes or blocks")
    chunks = []
    for c in range(first_token // chunk_tokens, end_token // chunk_tokens):
        blocks = [list(g[c * chunk_blocks:(c + 1) * chunk_blocks]) for g in ids]
        skip = max(0, first_token // block_size - c * chunk_blocks)
        chunks.append(ChunkLoad(c, hashes[c], blocks, skip))
    return LoadSpec(req_id, chunks, async_load)


# --- paged blocks <-> dense tensors (torch) -------------------------------------------------

def _block_view(kv: Any, block_size: int) -> Any:
    """[B * r, H, block_size / r, C] -> [B, r, H, block_size / r, C] (vLLM's kernel blocks
    subdivide a scheduler block into r pieces; r = 1 mostly)."""
    n = kv.shape[2]
    if kv.dim() != 4 or block_size % n:
        raise ValueError(f"KV layer of shape {tuple(kv.shape)} is not [blocks, heads, "
                         f"block_tokens, 2 * head_size] for block size {block_size}")
    return kv.unflatten(0, (-1, block_size // n))


def gather_blocks(kv: Any, block_ids: Sequence[int], block_size: int,
                  head_size: int) -> Tuple[Any, Any]:
    """One layer's keys and values of `block_ids`, in order: [H, len * block_size, head_size]
    each, on kv's device. kv: vLLM's per-layer view [B, H, N, K + V] (keys first)."""
    import torch

    v5 = _block_view(kv, block_size)
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv.device)
    x = v5.index_select(0, idx)                       # [n, r, H, m, C]
    h, c = x.shape[2], x.shape[4]
    x = x.permute(2, 0, 1, 3, 4).reshape(h, -1, c)
    return x[..., :head_size], x[..., head_size:]


def scatter_blocks(kv: Any, block_ids: Sequence[int], keys: Any, values: Any, block_size: int,
                   head_size: int) -> None:
    """Writes keys/values [H, len(block_ids) * block_size, head_size] into `block_ids` of one
    layer (vLLM's view [B, H, N, K + V]), converting to its dtype and device."""
    import torch

    v5 = _block_view(kv, block_size)
    n, r = len(block_ids), v5.shape[1]
    h, m, c = v5.shape[2], v5.shape[3], v5.shape[4]
    if keys.shape != (h, n * block_size, head_size) or values.shape != keys.shape:
        raise ValueError(f"chunk of shape {tuple(keys.shape)} does not fill {n} blocks of "
                         f"{h} heads x {block_size} tokens x {head_size}")
    x = torch.cat([keys, values], dim=-1).to(device=kv.device, dtype=kv.dtype)
    if x.shape[-1] != c:
        raise ValueError(f"keys + values width {x.shape[-1]} != the layer's {c}")
    x = x.reshape(h, n, r, m, c).permute(1, 2, 0, 3, 4)
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv.device)
    v5.index_copy_(0, idx, x)


# --- the store (kvcompd through the Python SDK) -------------------------------------------

class ChunkStore:
    """Chunks of one model in a kvcompd pool: lookups, decoded gets and puts with the codec of
    Settings. Thread-safe (the SDK clients are). Lookups go through a client of their own whose
    requests end after lookup_timeout (connects included), puts and gets through one whose
    requests end after timeout."""

    def __init__(self, settings: Settings, client: Any = None, lookup_client: Any = None,
                 stats: Optional[Stats] = None):
        import kvcomp

        self.settings = settings
        self.stats = stats or Stats()
        eps = list(settings.endpoints)
        # connect=False: a pool down at start is a miss, not a failed engine start.
        self.client = client or kvcomp.Client(eps, tenant=settings.tenant, token=settings.token,
                                              timeout=settings.timeout,
                                              connect_timeout=min(5.0, settings.timeout),
                                              connect=False)
        self.lookup_client = lookup_client or kvcomp.Client(
            eps, tenant=settings.tenant, token=settings.token, timeout=settings.lookup_timeout,
            connect_timeout=settings.lookup_timeout, connect=False)
        self._lock = threading.Lock()
        self._kvsplice_ready = False      # the daemons encode values with a projection
        self._raw_value_puts = 0          # chunks stored with raw values since the last attempt

    def held(self, keys: Sequence[bytes], units: int) -> int:
        """Whole leading chunks held: `keys` are unit_keys (chunk-major, `units` per chunk).
        0 when the pool cannot be asked (a miss, never a failed request)."""
        if not keys or units <= 0:
            return 0
        try:
            n = self.lookup_client.lookup_prefix(self.settings.model, list(keys))
        except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
            log.warning("kvcomp lookup_prefix failed (treated as a miss): %s", e)
            self.stats.add("lookup_errors")
            return 0
        return n // units

    def put(self, key: bytes, keys: Any, values: Any) -> Dict[str, Any]:
        """Stores one unit [layers, kv_heads, tokens, head_dim] (host tensors; a strided view,
        such as one head range of a rank's buffer, is made contiguous here)."""
        s = self.settings
        if hasattr(keys, "is_contiguous"):
            keys, values = keys.contiguous(), values.contiguous()
        with self._lock:
            kvsplice = s.codec == "kvsplice" and self._kvsplice_ready
        if kvsplice:
            try:
                return self.client.put(s.model, key, keys, values,
                                       policy=policy_for(s.codec, True))
            except RuntimeError as e:  # projection gone (daemon replaced): back to raw values
                log.warning("kvcomp KVSplice put failed, storing raw values: %s", e)
                with self._lock:
                    self._kvsplice_ready = False
        res = self.client.put(s.model, key, keys, values, policy=policy_for(s.codec, False))
        if s.codec == "kvsplice":
            self._maybe_calibrate()
        return res

    def _maybe_calibrate(self) -> None:
        s = self.settings
        with self._lock:
            self._raw_value_puts += 1
            if s.calibrate_after == 0 or self._raw_value_puts < s.calibrate_after:
                return
            self._raw_value_puts = 0
        try:
            res = self.client.calibrate(s.model, error_budget=s.error_budget)
        except Exception as e:
            log.warning("kvcomp calibrate(%s) failed: %s", s.model, e)
            return
        ok = bool(res) and all(r.get("ok") for r in res)
        with self._lock:
            self._kvsplice_ready = ok
        if not ok:
            log.warning("kvcomp calibrate(%s): not every daemon calibrated: %s", s.model, res)

    def get(self, keys: Sequence[bytes], layers: Any, kv_heads: int, tokens: int,
            head_dim: int) -> List[Tuple[Any, Any]]:
        """The leading units held, decoded: (keys, values) float32 numpy [layers, kv_heads,
        tokens, head_dim] (layers: one count for every key, or one per key). Each unit's bytes
        are parsed here (header, section table and every section's CRC32C: bytes altered
        anywhere between storage and the engine are caught). Stops at the first unit missing,
        failing its checks, of another layout, with evicted tokens or non-finite data; a failed
        or timed-out request returns nothing."""
        import numpy as np

        import kvcomp

        per_key = [int(layers)] * len(keys) if isinstance(layers, int) else list(layers)
        if len(per_key) != len(keys):
            raise ValueError(f"{len(per_key)} layer counts for {len(keys)} keys")
        try:
            blobs = self.client.get_chunk_bytes(self.settings.model, list(keys), decoded=True)
        except Exception as e:  # noqa: BLE001 - every load failure is a recompute
            log.warning("kvcomp get_chunk_bytes failed (blocks recomputed): %s", e)
            self.stats.add("load_failures")
            return []
        out = []
        for i, b in enumerate(blobs):
            try:
                c = kvcomp.CompressedCache.from_bytes(b)
                got = (c.num_layers, c.num_kv_heads, c.original_tokens, c.head_dim)
                want = (per_key[i], kv_heads, tokens, head_dim)
                if got != want:
                    raise ValueError(f"layout {got} != {want}")
                if any(n != tokens for n in c.kept):
                    raise ValueError("tokens evicted")
                k, v = kvcomp.decompress(c)
                if not (np.isfinite(k).all() and np.isfinite(v).all()):
                    raise ValueError("non-finite values")
            except Exception as e:  # noqa: BLE001
                log.warning("kvcomp unit %d unusable (recomputed from here): %s", i, e)
                self.stats.add("load_failures")
                break
            out.append((k, v))
        return out


class Uploader:
    """A background thread storing chunks (ChunkStore.put) in the order submitted; a failed or
    dropped chunk is logged and counted (a later miss, never an engine error)."""

    def __init__(self, store: ChunkStore, max_pending: int):
        self.store = store
        self._q: "queue.Queue[Optional[Tuple[bytes, Any, Any]]]" = queue.Queue(max_pending)
        self.stored = self.failed = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvcomp-upload", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, keys: Any, values: Any) -> bool:
        try:
            self._q.put_nowait((key, keys, values))
            return True
        except queue.Full:
            self.dropped += 1
            self.store.stats.add("save_drops")
            log.warning("kvcomp uploader full: chunk dropped")
            return False

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                try:
                    res = self.store.put(*item)
                    self.stored += 1
                    self.store.stats.add("saved_units")
                    if isinstance(res, dict):
                        self.store.stats.add("stored_bytes", res.get("stored_bytes", 0))
                        self.store.stats.add("original_bytes", res.get("original_bytes", 0))
                except Exception as e:  # noqa: BLE001 - a failed save is a later miss
                    self.failed += 1
                    self.store.stats.add("save_failures")
                    log.warning("kvcomp chunk put failed: %s", e)
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Waits until every submitted chunk is stored or failed."""
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


# --- scheduler side -------------------------------------------------------------------------

@dataclass
class _ReqState:
    request: Any
    held_chunks: int = 0
    saved_chunks: int = 0                      # chunks [0, saved) stored or held
    block_ids: GroupIds = field(default_factory=list)
    load_range: Optional[Tuple[int, int]] = None
    lookup: Optional[Tuple[Any, float, int]] = None   # (future, start, chunks asked)
    async_load: Optional[LoadSpec] = None      # planned in after_alloc, sent with the next step


def _prompt_tokens(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    return int(n if n is not None else len(request.prompt_token_ids))


class SchedulerLogic:
    """The scheduler half, on duck-typed requests (request_id, block_hashes, num_prompt_tokens,
    num_computed_tokens): what to load, what to save, when a finished request's blocks may go.
    units: every stored unit of a chunk (all_units, group_units), all of which a hit needs.
    groups: vLLM's KV cache groups (block ids come one list per group; every group has blocks
    of block_size tokens). hash_block_size: the tokens each of a request's block_hashes covers
    (vLLM's hash block size, dividing block_size). async_load: loads run between steps, the
    request waiting for them, and a failed one makes vLLM recompute the whole request (what
    vLLM requires of several KV cache groups); otherwise within the step, failed blocks
    reported one by one."""

    def __init__(self, settings: Settings, store: Optional[ChunkStore], block_size: int,
                 units: Sequence[str], load: bool = True, save: bool = True, groups: int = 1,
                 hash_block_size: Optional[int] = None, async_load: bool = False):
        self.s = settings
        self.store = store
        self.block_size = block_size
        self.chunk_tokens = block_size * settings.chunk_blocks
        self.hash_block_size = hash_block_size or block_size
        if block_size % self.hash_block_size:
            raise ValueError(f"hash block size {self.hash_block_size} does not divide block "
                             f"size {block_size}")
        self.hashes_per_chunk = self.chunk_tokens // self.hash_block_size
        self.units = list(units)
        self.groups = groups
        self.async_load = async_load
        self.load, self.save = load, save
        self.reqs: Dict[str, _ReqState] = {}
        self._finish_saves: Dict[str, List[SaveSpec]] = {}
        self._failed_loads: Set[str] = set()
        self._pool: Any = None
        self.stats = store.stats if store is not None else Stats()

    def _state(self, request: Any) -> _ReqState:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _ReqState(request)
        return st

    def _hashes(self, request: Any, max_chunks: Optional[int] = None) -> List[bytes]:
        return chunk_hashes(request.block_hashes, self.hashes_per_chunk, max_chunks)

    def _submit(self, keys: List[bytes]) -> Any:
        import concurrent.futures

        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="kvcomp-lookup")
        return self._pool.submit(self.store.held, keys, len(self.units))

    def matched_tokens(self, request: Any, num_computed: int) -> Optional[int]:
        """Tokens past num_computed the pool can supply: whole held chunks, never the whole
        prompt (vLLM computes at least its last token). None ("not yet") while the lookup is in
        flight (async_lookup); a lookup not answered within lookup_timeout is a miss (0), and
        so is every lookup of a request whose load failed (it is recomputed, not fetched
        again)."""
        import time

        st = self._state(request)
        if not self.load or self.store is None or request.request_id in self._failed_loads:
            return 0
        loadable = (_prompt_tokens(request) - 1) // self.chunk_tokens
        hashes = self._hashes(request, loadable)
        if len(hashes) * self.chunk_tokens <= num_computed:
            st.lookup = None
            return 0
        if st.lookup is None or st.lookup[2] != len(hashes):
            self.stats.add("lookups")
            st.lookup = (self._submit(unit_keys(hashes, self.units)), time.monotonic(),
                         len(hashes))
        fut, t0, _ = st.lookup
        if not fut.done():
            left = self.s.lookup_timeout - (time.monotonic() - t0)
            if left > 0 and self.s.async_lookup:
                return None
            if left > 0:
                import concurrent.futures
                try:
                    fut.result(timeout=left)
                except concurrent.futures.TimeoutError:
                    pass
        st.lookup = None
        if not fut.done():
            log.warning("kvcomp lookup of %s not answered in %.3f s (treated as a miss)",
                        request.request_id, self.s.lookup_timeout)
            self.stats.add("lookup_timeouts")
            held = 0
        else:
            held = fut.result()
        self.stats.add("lookup_hit_chunks", held)
        st.held_chunks = held
        st.saved_chunks = max(st.saved_chunks, held)
        return max(0, held * self.chunk_tokens - num_computed)

    def load_failed(self, req_id: str) -> None:
        """A request's asynchronous load failed (vLLM recomputes it): later lookups of it are
        misses."""
        self._failed_loads.add(req_id)
        st = self.reqs.get(req_id)
        if st is not None:  # its recomputed chunks are stored again, over what failed
            st.held_chunks = st.saved_chunks = 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def after_alloc(self, request: Any, num_external: int, block_ids: Any = None) -> None:
        """vLLM allocated the request's blocks, num_external of its tokens to be loaded.
        block_ids (the request's blocks, per group) are needed for asynchronous loads, which
        are planned here (the request is not scheduled until they end)."""
        st = self._state(request)
        if num_external <= 0:
            return
        end = st.held_chunks * self.chunk_tokens
        st.load_range = (end - num_external, end)
        if self.async_load:
            if block_ids is None:
                raise ValueError("asynchronous loads need the request's block ids")
            st.block_ids = per_group(block_ids, self.groups)
            st.async_load = self._load_spec(st)

    def _load_spec(self, st: _ReqState) -> Optional[LoadSpec]:
        if st.load_range is None:
            return None
        first, end = st.load_range
        st.load_range = None
        return plan_load(st.request.request_id, self._hashes(st.request), st.block_ids, first,
                         end, self.block_size, self.s.chunk_blocks, self.async_load)

    def _new_saves(self, st: _ReqState, computed_after: int) -> List[SaveSpec]:
        """Prompt chunks whose tokens are all computed once this step ends."""
        if not self.save:
            return []
        prompt_end = min(computed_after, _prompt_tokens(st.request))
        return self._saves_upto(st, prompt_end)

    def _saves_upto(self, st: _ReqState, tokens: int) -> List[SaveSpec]:
        """Chunks [saved_chunks, tokens // chunk_tokens) to store. A chunk a group holds no
        block of (a sliding-window group freed it: the tokens left the window before the chunk
        was stored) is not stored."""
        hashes = self._hashes(st.request)
        cb = self.s.chunk_blocks
        n = min(tokens // self.chunk_tokens, len(hashes),
                min((len(g) for g in st.block_ids), default=0) // cb)
        out = []
        for c in range(st.saved_chunks, n):
            ids = [g[c * cb:(c + 1) * cb] for g in st.block_ids]
            if self.groups > 1 and any(b == NULL_BLOCK for g in ids for b in g):
                continue
            out.append(SaveSpec(st.request.request_id, c, hashes[c], ids))
        st.saved_chunks = max(st.saved_chunks, n)
        return out

    def build(self, new_reqs: Iterable[Tuple[str, Any, int, int]],
              cached_reqs: Iterable[Tuple[str, Any, bool, int, int]]) -> ConnectorPlan:
        """new_reqs: (req_id, block_ids, num_computed_tokens, num_scheduled_tokens);
        cached_reqs: (req_id, new block_ids or None, resumed, num_computed, num_scheduled).
        Block ids per group (a flat list for one group). Asynchronous loads planned since the
        last step go first."""
        plan = ConnectorPlan()
        for st in self.reqs.values():
            if st.async_load is not None:
                plan.loads.append(st.async_load)
                st.async_load = None
        for req_id, block_ids, computed, scheduled in new_reqs:
            st = self.reqs.get(req_id)
            if st is None:
                continue
            st.block_ids = per_group(block_ids, self.groups)
            spec = self._load_spec(st)
            if spec is not None:
                plan.loads.append(spec)
            plan.saves += self._new_saves(st, computed + scheduled)
        for req_id, new_ids, resumed, computed, scheduled in cached_reqs:
            st = self.reqs.get(req_id)
            if st is None:
                continue
            if resumed:  # preempted and back: new_ids are all of its blocks, KV recomputed
                st.block_ids = per_group(new_ids, self.groups) if new_ids is not None else \
                    [[] for _ in range(self.groups)]
                st.saved_chunks = st.held_chunks
                spec = self._load_spec(st)
                if spec is not None:
                    plan.loads.append(spec)
            elif new_ids is not None:
                for g, ids in enumerate(per_group(new_ids, self.groups)):
                    if g < len(st.block_ids):
                        st.block_ids[g] += ids
                    else:
                        st.block_ids.append(list(ids))
            plan.saves += self._new_saves(st, computed + scheduled)
        plan.finish_saves, self._finish_saves = self._finish_saves, {}
        return plan

    def finished(self, request: Any, block_ids: Any) -> bool:
        """True when the request's blocks must stay until the workers report it in
        get_finished (chunks completed while decoding are copied out first). block_ids: the
        request's blocks now, per group (a flat list for one group)."""
        st = self.reqs.pop(request.request_id, None)
        self._failed_loads.discard(request.request_id)
        if st is None or not self.save or not self.s.save_decode:
            return False
        st.block_ids = per_group(block_ids, self.groups)
        # KV exists for every token but the last one sampled.
        computed = min(int(request.num_computed_tokens),
                       len(request.block_hashes) * self.hash_block_size)
        saves = self._saves_upto(st, computed)
        if not saves:
            return False
        self._finish_saves[request.request_id] = saves
        return True


# --- worker side ----------------------------------------------------------------------------

class WorkerLogic:
    """The worker half over registered per-layer KV tensors [B, H, N, K + V]: loads into
    blocks, layer-wise saves through pinned host memory, finish saves, load errors. Layers come
    in vLLM's KV cache groups (register's `groups`; one group of every layer by default), each
    group stored as units of its own (group_units) and written into its own blocks."""

    def __init__(self, settings: Settings, store: Optional[ChunkStore], block_size: int,
                 shard: Shard = Shard(), uploader: Optional[Uploader] = None):
        self.s = settings
        self.store = store
        self.stats = store.stats if store is not None else Stats()
        self.block_size = block_size
        self.shard = shard
        self.units: List[Tuple[str, int, int, int]] = []   # (name, head0, head1, group)
        self.uploader = uploader or (Uploader(store, settings.max_pending_uploads)
                                     if store is not None else None)
        self.layers: Dict[str, Any] = {}
        self.group_layers: List[List[str]] = []
        self._where: Dict[str, Tuple[int, int]] = {}      # layer -> (group, index in group)
        self.head_size = 0
        self._plan: Optional[ConnectorPlan] = None
        self._fetched = False
        self._pending_loads: Dict[str, List[Tuple[List[int], Any, Any]]] = {}
        self._load_errors: Set[int] = set()
        self._recv_done: Set[str] = set()
        self._recv_failed: Set[str] = set()
        self._save_bufs: List[Tuple[SaveSpec, List[Tuple[Any, Any]]]] = []
        self._saved_layers: Set[str] = set()
        self._finish_done: Set[str] = set()
        self._finished_seen: Set[str] = set()

    # registration
    def register(self, kv_caches: Mapping[str, Any], head_size: Optional[int] = None,
                 groups: Optional[Sequence[Sequence[str]]] = None) -> None:
        """kv_caches: vLLM's per-layer tensors. groups: the layer names of each KV cache group
        (vLLM's kv_cache_config); layers of no group are not stored. Layers of one group
        sharing one tensor (KV sharing) are stored once; layers of different groups may share
        a tensor (vLLM's hybrid allocator), each group using its own blocks of it."""
        names = [list(kv_caches)] if groups is None else [list(g) for g in groups]
        self.layers, self.group_layers, self._where = {}, [], {}
        for g, layer_names in enumerate(names):
            seen, mine = set(), []
            for name in layer_names:
                kv = kv_caches.get(name)
                if kv is None or kv.data_ptr() in seen:
                    continue
                seen.add(kv.data_ptr())
                _block_view(kv, self.block_size)
                c = kv.shape[-1]
                hs = head_size or c // 2
                if c != 2 * hs:
                    raise ValueError(f"layer {name}: last dim {c} is not keys + values of head "
                                     f"size {hs} (MLA and other latent caches are not "
                                     "supported)")
                if self.head_size and hs != self.head_size:
                    raise ValueError(f"layer {name}: head size {hs} != {self.head_size}")
                if self.layers and kv.shape[1] != self.num_kv_heads:
                    raise ValueError(f"layer {name}: {kv.shape[1]} KV heads, other layers "
                                     f"{self.num_kv_heads}")
                self.head_size = hs
                self._where[name] = (g, len(mine))
                self.layers[name] = kv
                mine.append(name)
            if not mine:
                raise ValueError(f"KV cache group {g}: no KV cache layers to register")
            self.group_layers.append(mine)
        units = shard_units(self.shard, self.num_kv_heads, self.s.head_group)
        n = len(self.group_layers)
        names = group_units([u[0] for u in units], n)   # group-major
        self.units = [(names[g * len(units) + i], h0, h1, g) for g in range(n)
                      for i, (_, h0, h1) in enumerate(units)]

    @property
    def num_kv_heads(self) -> int:
        return next(iter(self.layers.values())).shape[1]

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.s.chunk_blocks

    # a step
    def bind(self, plan: ConnectorPlan) -> None:
        """Binds the step's plan (before the forward: each layer is saved as it finishes)."""
        if self._plan is plan:
            return
        self._plan = plan
        self._fetched = False
        self._saved_layers = set()
        self._save_bufs = []

    def begin_step(self, plan: ConnectorPlan) -> None:
        """Binds the step's plan and fetches every load (the layers are written as they are
        waited for, the rest at the end of the step)."""
        self.bind(plan)
        if not self._fetched:
            self._fetched = True
            for spec in plan.loads:
                self._fetch(spec)

    def _fetch(self, spec: LoadSpec) -> None:
        import torch

        names = [u[0] for u in self.units]
        keys = unit_keys([c.chunk_hash for c in spec.chunks], names)
        layers = [len(self.group_layers[u[3]]) for u in self.units] * len(spec.chunks)
        g = self.s.head_group
        got = self.store.get(keys, layers, g, self.chunk_tokens,
                             self.head_size) if self.store is not None and keys else []
        whole = len(got) // len(self.units)   # chunks with every unit
        if spec.async_load:
            # vLLM takes an asynchronous load whole or not at all: the request is recomputed.
            if whole < len(spec.chunks):
                self._recv_failed.add(spec.req_id)
                self.stats.add("load_error_blocks", len(spec.block_ids()))
                return
        for i, c in enumerate(spec.chunks):
            if i >= whole:
                blocks = [b for grp in range(len(c.block_ids))
                          for b in _live(c.targets(grp), len(c.block_ids))]
                self._load_errors.update(blocks)
                self.stats.add("load_error_blocks", len(blocks))
                continue
            self.stats.add("load_chunks")
            t0 = c.skip_blocks * self.block_size
            parts = got[i * len(self.units):(i + 1) * len(self.units)]
            for grp, layer_names in enumerate(self.group_layers):
                mine = [p for p, u in zip(parts, self.units) if u[3] == grp]
                k = torch.cat([torch.from_numpy(p[0]) for p in mine], dim=1)[:, :, t0:]
                v = torch.cat([torch.from_numpy(p[1]) for p in mine], dim=1)[:, :, t0:]
                blocks = c.targets(grp) if grp < len(c.block_ids) else []
                live = [j for j, b in enumerate(blocks)
                        if len(self.group_layers) == 1 or b != NULL_BLOCK]
                if not live:
                    continue
                if len(live) < len(blocks):  # a sliding window's freed blocks: not written
                    bs = self.block_size
                    sel = torch.as_tensor([j * bs + t for j in live for t in range(bs)])
                    k, v = k.index_select(2, sel), v.index_select(2, sel)
                    blocks = [blocks[j] for j in live]
                for li, name in enumerate(layer_names):
                    self._pending_loads.setdefault(name, []).append((blocks, k[li], v[li]))
        if spec.async_load:  # vLLM waits on no layer of it: written now, then reported
            for name in list(self._pending_loads):
                self.layer_load(name)
            self._recv_done.add(spec.req_id)

    def layer_load(self, name: str) -> None:
        """Writes the fetched chunks of one layer into its blocks."""
        for blocks, k, v in self._pending_loads.pop(name, []):
            scatter_blocks(self.layers[name], blocks, k, v, self.block_size, self.head_size)

    def save_layer(self, name: str, kv: Any = None) -> None:
        """Copies this step's saved blocks of one layer to (pinned) host memory."""
        if self._plan is None or not self._plan.saves or name not in self.layers \
                or name in self._saved_layers or not self.shard.stores:
            return
        kv = self.layers[name] if kv is None else kv
        if not self._save_bufs:
            self._save_bufs = [(s, [self._group_bufs(g, kv.dtype)
                                    for g in range(len(self.group_layers))])
                               for s in self._plan.saves]
        g, li = self._where[name]
        for spec, bufs in self._save_bufs:
            kb, vb = bufs[g]
            k, v = gather_blocks(kv, spec.block_ids[g], self.block_size, self.head_size)
            kb[li].copy_(k, non_blocking=kb.is_pinned())
            vb[li].copy_(v, non_blocking=vb.is_pinned())
        self._saved_layers.add(name)

    def _group_bufs(self, g: int, dtype: Any) -> Tuple[Any, Any]:
        shape = (len(self.group_layers[g]), self.num_kv_heads, self.chunk_tokens,
                 self.head_size)
        return self._host(shape, dtype), self._host(shape, dtype)

    @staticmethod
    def _host(shape: Tuple[int, ...], dtype: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())

    def end_step(self) -> None:
        """Completes the step: writes layers not yet waited for, copies layers whose
        save_kv_layer did not run, waits for the host copies, hands the chunks to the uploader,
        and copies out finished requests' chunks."""
        import torch

        for name in list(self._pending_loads):
            self.layer_load(name)
        plan, self._plan = self._plan, None
        if plan is None:
            return
        if plan.saves:
            for name in self.layers:
                if name not in self._saved_layers:
                    self._plan = plan
                    self.save_layer(name)
                    self._plan = None
        finish = []
        for req_id, specs in plan.finish_saves.items():
            for spec in (specs if self.shard.stores else []):
                finish.append((spec, self._gather_all(spec)))
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        if self.uploader is not None and self.shard.stores:
            for spec, bufs in self._save_bufs + finish:
                for unit, h0, h1, g in self.units:
                    k, v = bufs[g]
                    self.uploader.submit(shard_key(spec.chunk_hash, unit), k[:, h0:h1],
                                         v[:, h0:h1])
        self._save_bufs = []
        self._finish_done.update(plan.finish_saves)

    def _gather_all(self, spec: SaveSpec) -> List[Tuple[Any, Any]]:
        dtype = next(iter(self.layers.values())).dtype
        out = []
        for g, layer_names in enumerate(self.group_layers):
            kb, vb = self._group_bufs(g, dtype)
            for li, name in enumerate(layer_names):
                k, v = gather_blocks(self.layers[name], spec.block_ids[g], self.block_size,
                                     self.head_size)
                kb[li].copy_(k, non_blocking=kb.is_pinned())
                vb[li].copy_(v, non_blocking=vb.is_pinned())
            out.append((kb, vb))
        return out

    def finished_sending(self, finished_req_ids: Iterable[str]) -> Set[str]:
        """Finished requests whose chunks are in host memory (their blocks may go), among the
        ids vLLM reported finished (this call or an earlier one)."""
        self._finished_seen.update(finished_req_ids)
        done = self._finish_done & self._finished_seen
        self._finish_done -= done
        self._finished_seen -= done
        return done

    def finished_recving(self) -> Tuple[Set[str], Set[str]]:
        """Requests whose asynchronous load ended since the last call: (every one, the ones
        that failed)."""
        done, failed = self._recv_done | self._recv_failed, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return done, failed

    def take_load_errors(self) -> Set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self.uploader is not None:
            self.uploader.close()


# --- the vLLM connector ---------------------------------------------------------------------

def cache_groups(kv_cache_config: Any) -> Tuple[List[List[str]], Optional[int]]:
    """The layer names of each of vLLM's KV cache groups and their common block size (None
    without a kv_cache_config). Full-attention and sliding-window groups are supported (hybrid
    models such as Gemma 2/3 or gpt-oss); ValueError names any other group (Mamba and other
    state, MLA, chunked-local, cross-attention) and groups of different block sizes."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return [], None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups, sizes = [], set()
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec) or \
                not getattr(group, "enable_kv_transfer", True):
            raise ValueError(
                f"kvcomp connector: KV cache group {g} ({type(spec).__name__}, layers "
                f"{list(group.layer_names)[:3]}...) is not supported: the connector stores "
                "full-attention and sliding-window KV caches only")
        groups.append(list(group.layer_names))
        sizes.add(spec.block_size)
    if len(sizes) > 1:
        raise ValueError(f"kvcomp connector: KV cache groups of different block sizes "
                         f"{sorted(sizes)} are not supported")
    return groups, sizes.pop()


def _build_connector_classes() -> Tuple[type, type]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    class KvcompConnectorMetadata(KVConnectorMetadata):
        """The step's ConnectorPlan."""

        def __init__(self, plan: ConnectorPlan):
            self.plan = plan

    class KvcompConnectorStats(KVConnectorStats):
        """The connector's counters (Stats.NAMES) since the last interval, summed over the
        scheduler and every worker."""

        def reset(self) -> None:
            self.data = {}

        def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
            for k, v in (other.data or {}).items():
                self.data[k] = self.data.get(k, 0) + v
            return self

        def reduce(self) -> Dict[str, Any]:
            out: Dict[str, Any] = dict(self.data)
            if self.data.get("original_bytes"):
                out["compression_ratio"] = round(
                    self.data["original_bytes"] / max(1, self.data.get("stored_bytes", 0)), 3)
            return out

        def is_empty(self) -> bool:
            return not any(self.data.values())

    class KvcompConnector(KVConnectorBase_V1, SupportsHMA):
        """kvcomp as vLLM's KV connector (module docstring). Hybrid models (vLLM's hybrid KV
        cache manager: full-attention and sliding-window groups) load asynchronously, a
        failed load recomputing the whole request, as vLLM requires of several groups."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            kt = self._kv_transfer_config
            self.settings = Settings.from_extra_config(kt.kv_connector_extra_config,
                                                       vllm_config.model_config.model)
            self._groups, group_block_size = cache_groups(kv_cache_config)
            self.block_size = group_block_size or vllm_config.cache_config.block_size
            ngroups = max(1, len(self._groups))
            par = vllm_config.parallel_config
            self._store = ChunkStore(self.settings)
            total_heads = vllm_config.model_config.get_total_num_kv_heads()
            if role == KVConnectorRole.SCHEDULER:
                hash_block_size = self.block_size
                if ngroups > 1:
                    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
                    _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config,
                                                                      vllm_config)
                units = group_units(all_units(total_heads, self.settings.head_group,
                                              par.pipeline_parallel_size), ngroups)
                self.sched = SchedulerLogic(
                    self.settings, self._store, self.block_size, units,
                    load=kt.is_kv_consumer, save=kt.is_kv_producer, groups=ngroups,
                    hash_block_size=hash_block_size, async_load=ngroups > 1)
                self.worker = None
            else:
                tp_rank, tp_size, pp_rank = self._ranks(par)
                h0, _, stores = rank_heads(tp_rank, tp_size, total_heads)
                shard = Shard(h0, pp_rank, par.pipeline_parallel_size, stores)
                self.head_size = vllm_config.model_config.get_head_size()
                self.worker = WorkerLogic(self.settings, self._store, self.block_size, shard)
                self.sched = None

        @staticmethod
        def _ranks(par: Any) -> Tuple[int, int, int]:
            """(tp rank, tp size, pp rank) of this worker, from vLLM's parallel state."""
            if par.tensor_parallel_size == 1 and par.pipeline_parallel_size == 1:
                return 0, 1, 0
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )
            return (get_tensor_model_parallel_rank(), par.tensor_parallel_size,
                    get_pp_group().rank_in_group)

        @classmethod
        def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                     ) -> KVConnectorStats:
            return KvcompConnectorStats(data=dict(data or {}))

        def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
            data = self._store.stats.take()
            return KvcompConnectorStats(data=data) if any(data.values()) else None

        @property
        def requires_kv_delivery(self) -> bool:
            return False  # a cache: a dropped save is a later miss

        # worker side
        def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
            self.worker.register(kv_caches, self.head_size,
                                 self._groups if len(self._groups) > 1 else None)

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            # Bound here, before the forward: vLLM calls start_load_kv after the forward when
            # the step has no synchronous load, and save_kv_layer runs as each layer ends.
            super().bind_connector_metadata(connector_metadata)
            if self.worker is not None:
                self.worker.bind(connector_metadata.plan)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            self.worker.begin_step(self._get_connector_metadata().plan)

        def wait_for_layer_load(self, layer_name: str) -> None:
            self.worker.layer_load(layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                          **kwargs: Any) -> None:
            self.worker.save_layer(layer_name, kv_layer)

        def wait_for_save(self) -> None:
            if self.worker._plan is None and self.has_connector_metadata():
                self.worker.begin_step(self._get_connector_metadata().plan)
            self.worker.end_step()

        def get_finished(self, finished_req_ids: Set[str]):
            done = self.worker.finished_sending(finished_req_ids)
            recv, _ = self.worker.finished_recving()
            return (done or None), (recv or None)

        def get_transfer_results(self, finished_req_ids: Set[str]
                                 ) -> "KVConnectorTransferResults":
            recv, failed = self.worker.finished_recving()
            return KVConnectorTransferResults(
                finished_sending=self.worker.finished_sending(finished_req_ids),
                finished_recving=recv, failed_recving=failed)

        def get_block_ids_with_load_errors(self) -> Set[int]:
            return self.worker.take_load_errors()

        def shutdown(self) -> None:
            if self.worker is not None:
                self.worker.close()
            if self.sched is not None:
                self.sched.close()

        # scheduler side
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
            n = self.sched.matched_tokens(request, num_computed_tokens)
            return n, bool(n) and self.sched.async_load

        def update_state_after_alloc(self, request: Any, blocks: Any,
                                     num_external_tokens: int) -> None:
            ids = blocks.get_block_ids() if self.sched.async_load and num_external_tokens \
                else None
            self.sched.after_alloc(request, num_external_tokens, ids)

        def update_connector_output(self, connector_output: Any) -> None:
            for req_id in getattr(connector_output, "failed_recving", None) or ():
                self.sched.load_failed(req_id)

        def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
            so = scheduler_output
            cached = so.scheduled_cached_reqs
            new = [(r.req_id, r.block_ids, r.num_computed_tokens,
                    so.num_scheduled_tokens.get(r.req_id, 0)) for r in so.scheduled_new_reqs]
            old = []
            for i, req_id in enumerate(cached.req_ids):
                old.append((req_id, cached.new_block_ids[i],
                            req_id in cached.resumed_req_ids, cached.num_computed_tokens[i],
                            so.num_scheduled_tokens.get(req_id, 0)))
            return KvcompConnectorMetadata(self.sched.build(new, old))

        def request_finished(self, request: Any, block_ids: List[int]):
            return self.sched.finished(request, [block_ids]), None

        def request_finished_all_groups(self, request: Any, block_ids: Tuple[List[int], ...]):
            return self.sched.finished(request, block_ids), None

    # Importable by name (the module's __getattr__), so that pickle (vLLM sends the step's
    # metadata to its worker processes, and the workers' stats back) finds them.
    for c in (KvcompConnector, KvcompConnectorMetadata, KvcompConnectorStats):
        c.__module__, c.__qualname__ = __name__, c.__name__
    return KvcompConnector, KvcompConnectorMetadata, KvcompConnectorStats


_classes: Optional[Tuple[type, type, type]] = None
_NAMES = ("KvcompConnector", "KvcompConnectorMetadata", "KvcompConnectorStats")


def __getattr__(name: str) -> Any:
    """KvcompConnector, KvcompConnectorMetadata and KvcompConnectorStats, built on first
    access (imports vllm)."""
    global _classes
    if name in _NAMES:
        if _classes is None:
            _classes = _build_connector_classes()
        return _classes[_NAMES.index(name)]
    raise AttributeError(name)

"""kvcomp's codecs as an LMCache serde (LMCache multiprocess mode, lmcache 0.5.6).

LMCache's L2 adapters take a per-adapter serde that turns a KV chunk into the bytes the adapter
stores and back. Importing this module registers the serde type "kvcomp"
(lmcache.v1.distributed.serde.register_serde_factory); an adapter names it in its config:

    {"type": "fs", "base_path": "/cache",
     "serde": {"type": "kvcomp", "codec": "int8", "head_dim": 128}}

(the LMCache server must import kvcomp.integrations.lmcache first, e.g. through a
sitecustomize or its plugin loading; docs/integrations.md, "LMCache").

A chunk is LMCache's KV_2LTD memory object: [2, num_layers, num_tokens, num_kv_heads *
head_dim] in float16 or bfloat16 (keys at index 0, values at 1). The serde stores it as one
kvcomp cache (docs/format.md) of every token: "int8" (default) int8 keys with per-channel scales
per layer and head, values as they are; "lossless" keys and values as they are (bit-exact). The
bytes carry CRC32C checksums: a chunk altered in storage fails to deserialize (LMCache treats the
task as failed) instead of loading wrong KV. Serialization runs on LMCache's serde threads
(AsyncSerdeProcessor), on CPU, with kvcomp's C++ codec.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Dict, List

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import (
    get_registered_serde_types,
    register_serde_factory,
)
from lmcache.v1.memory_management import MemoryObj

import kvcomp

SERDE_NAME = "kvcomp"
CODECS = ("int8", "lossless")
_HEADER = 128


def _policy(codec: str) -> Any:
    if codec == "int8":
        return kvcomp.Policy(ratio=0.0, moments=False, key_codec="int8")
    return kvcomp.Policy(ratio=0.0, moments=False)


def _split(t: torch.Tensor, head_dim: int):
    """[2, L, T, H * D] -> keys, values [L, H, T, D] (contiguous)."""
    if t.dim() != 4 or t.shape[0] != 2 or t.shape[-1] % head_dim:
        raise ValueError(f"kvcomp serde: a chunk of shape {tuple(t.shape)} is not KV_2LTD "
                         f"[2, layers, tokens, kv_heads * {head_dim}]")
    if t.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"kvcomp serde: dtype {t.dtype} (float16 or bfloat16 only)")
    layers, tokens, hidden = t.shape[1], t.shape[2], t.shape[3]
    x = t.reshape(2, layers, tokens, hidden // head_dim, head_dim).permute(0, 1, 3, 2, 4)
    return x[0].contiguous(), x[1].contiguous()


class KvcompSerializer(Serializer):
    """A KV_2LTD chunk -> one kvcomp cache's bytes."""

    def __init__(self, codec: str = "int8", head_dim: int = 128):
        self.codec, self.head_dim = codec, head_dim

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        if src.tensor is None or dst.tensor is None:
            raise ValueError("kvcomp serde: src and dst need tensors")
        k, v = _split(src.tensor, self.head_dim)
        dtype = ""
        if k.dtype == torch.bfloat16:  # handed over as raw bits
            k, v, dtype = k.view(torch.int16).numpy().view("uint16"), \
                v.view(torch.int16).numpy().view("uint16"), "bf16"
        else:
            k, v = k.numpy(), v.numpy()
        blob = kvcomp.compress(k, v, _policy(self.codec), dtype=dtype or None).to_bytes()
        out = dst.tensor.view(torch.uint8).flatten()
        if out.numel() < len(blob):
            raise ValueError(f"kvcomp serde: {len(blob)} bytes do not fit the "
                             f"{out.numel()}-byte buffer")
        out[:len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        return len(blob)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """An upper bound: the chunk's bytes as they are plus the format's header, section
        table and per-channel scales (LMCache narrows the object to the bytes written)."""
        total = 0
        for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes):
            dims = [int(d) for d in shape]
            total += math.prod(dims) * dtype.itemsize
            if len(dims) == 4:   # [2, layers, tokens, heads * head_dim]
                layers, tokens, heads = dims[1], dims[2], max(1, dims[3] // self.head_dim)
                # kept positions (4 bytes per token and head), key scales, header and table
                total += 4 * layers * heads * tokens + 8 * layers * heads * self.head_dim
            total += 64 * 64 + _HEADER
        return total


class KvcompDeserializer(Deserializer):
    """One kvcomp cache's bytes -> the KV_2LTD chunk, in the destination's dtype."""

    def __init__(self, head_dim: int = 128):
        self.head_dim = head_dim

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        if src.tensor is None or dst.tensor is None:
            raise ValueError("kvcomp serde: src and dst need tensors")
        raw = src.tensor.view(torch.uint8).flatten()
        if raw.numel() < _HEADER:
            raise ValueError("kvcomp serde: stored object shorter than a header")
        total = struct.unpack_from("<Q", bytes(raw[:_HEADER].numpy()), 16)[0]
        if total > raw.numel():
            raise ValueError(f"kvcomp serde: stored object of {raw.numel()} bytes, its "
                             f"header says {total}")
        cache = kvcomp.CompressedCache.from_bytes(bytes(raw[:total].numpy()))  # CRCs
        out = dst.tensor
        if out.dim() != 4 or out.shape[0] != 2:
            raise ValueError(f"kvcomp serde: destination of shape {tuple(out.shape)} is not "
                             "KV_2LTD")
        layers, tokens, hidden = out.shape[1], out.shape[2], out.shape[3]
        want = (layers, hidden // self.head_dim, tokens, self.head_dim)
        got = (cache.num_layers, cache.num_kv_heads, cache.original_tokens, cache.head_dim)
        if got != want or any(n != tokens for n in cache.kept):
            raise ValueError(f"kvcomp serde: stored chunk of layout {got}, destination {want}")
        k, v = kvcomp.decompress(cache)
        x = torch.stack([torch.from_numpy(k), torch.from_numpy(v)])  # [2, L, H, T, D]
        out.copy_(x.permute(0, 1, 3, 2, 4).reshape(out.shape).to(out.dtype))


def create_kvcomp_serde(kwargs: Dict[str, object]) -> SerdeProcessor:
    """The factory LMCache calls with the adapter's serde options (all but "type"):
    codec ("int8" or "lossless"), head_dim (64, 128 or 256), max_workers (serde threads)."""
    known = {"codec", "head_dim", "max_workers"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"kvcomp serde: unknown option(s) {unknown}; known: {sorted(known)}")
    codec = str(kwargs.get("codec", "int8"))
    if codec not in CODECS:
        raise ValueError(f"kvcomp serde: codec {codec!r} not one of {CODECS}")
    head_dim = int(kwargs.get("head_dim", 128))  # type: ignore[call-overload]
    if head_dim not in (64, 128, 256):
        raise ValueError(f"kvcomp serde: head_dim {head_dim} (64, 128 or 256)")
    workers = int(kwargs.get("max_workers", 1))  # type: ignore[call-overload]
    return AsyncSerdeProcessor(KvcompSerializer(codec, head_dim), KvcompDeserializer(head_dim),
                               max_workers=workers)


if SERDE_NAME not in get_registered_serde_types():
    register_serde_factory(SERDE_NAME, create_kvcomp_serde)


# --- kvcompd as an L2 adapter (LMCache's plugin adapter type) -------------------------------

def _build_l2_adapter() -> type:
    import concurrent.futures
    import threading

    import numpy as np
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.internal_api import L2StoreResult
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.platform import create_event_notifier

    class _Adapter(L2AdapterInterface):
        """kvcompd as an LMCache L2 adapter, loaded by LMCache's plugin adapter type:

            {"type": "plugin", "module_path": "kvcomp.integrations.lmcache",
             "class_name": "KvcompL2Adapter",
             "adapter_params": {"endpoints": ["10.0.0.5:7420,10.0.0.5:7421"],
                                "codec": "int8", "head_dim": 128}}

        KV_2LTD chunks (float16 or bfloat16) are stored as KV caches, compressed by the
        daemons with the codec (int8 keys, or lossless); other objects (a serde's bytes) are
        refused: their store task fails (kvcompd stores KV, and checks it is finite). Keys: the object key's chunk hash, rank,
        group and salt under its model name. Lookups answer which keys the pool holds (no
        lock: a chunk evicted between lookup and load fails its load, which LMCache treats as
        a miss); a pool that does not answer within lookup_timeout holds nothing. Loads
        check every chunk's CRCs and layout before writing it."""

        def __init__(self, params: Any = None, l1_memory_desc: Any = None):
            import os

            super().__init__()
            p = dict(params or {})
            known = {"endpoints", "codec", "head_dim", "tenant", "token", "timeout",
                     "lookup_timeout", "io_threads"}
            unknown = sorted(set(p) - known)
            if unknown:
                raise ValueError(f"kvcomp L2 adapter: unknown option(s) {unknown}; known: "
                                 f"{sorted(known)}")
            eps = p.get("endpoints", os.environ.get("KVCOMP_ENDPOINTS", ""))
            eps = eps.split() if isinstance(eps, str) else [str(e) for e in eps]
            if not eps or any("," not in e and not e.startswith("dns:") for e in eps):
                raise ValueError("kvcomp L2 adapter: endpoints \"data,control\" required")
            self.codec = str(p.get("codec", "int8"))
            if self.codec not in CODECS:
                raise ValueError(f"kvcomp L2 adapter: codec {self.codec!r} not one of {CODECS}")
            self.head_dim = int(p.get("head_dim", 128))
            if self.head_dim not in (64, 128, 256):
                raise ValueError(f"kvcomp L2 adapter: head_dim {self.head_dim}")
            timeout = float(p.get("timeout", 10.0))
            lookup_timeout = float(p.get("lookup_timeout", 0.5))
            tenant = str(p.get("tenant", os.environ.get("KVCOMP_TENANT", "")))
            token = str(p.get("token", os.environ.get("KVCOMP_TOKEN", "")))
            self.client = kvcomp.Client(eps, tenant=tenant, token=token, timeout=timeout,
                                        connect_timeout=min(5.0, timeout), connect=False)
            self.lookup_client = kvcomp.Client(eps, tenant=tenant, token=token,
                                               timeout=lookup_timeout,
                                               connect_timeout=lookup_timeout, connect=False)
            self._efd = [create_event_notifier() for _ in range(3)]
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=int(p.get("io_threads", 2)), thread_name_prefix="kvcomp-l2")
            self._lock = threading.Lock()
            self._next = 0
            self._stores: Dict[int, Any] = {}
            self._lookups: Dict[int, Any] = {}
            self._loads: Dict[int, Any] = {}

        # event fds
        def get_store_event_fd(self) -> int:
            return self._efd[0].fileno()

        def get_lookup_and_lock_event_fd(self) -> int:
            return self._efd[1].fileno()

        def get_load_event_fd(self) -> int:
            return self._efd[2].fileno()

        # helpers
        def _task(self, table: str, efd: int, fail: Any, fn: Any, *args: Any) -> int:
            """Runs fn(*args) on the adapter's threads; its result (or `fail` on an
            exception) goes to the table named `table`, then the event fd is signalled."""
            with self._lock:
                tid = self._next
                self._next += 1

            def run() -> None:
                try:
                    res = fn(*args)
                except Exception as e:  # noqa: BLE001 - reported as the task's failure
                    log_warning("kvcomp L2 task failed: %s", e)
                    res = fail()
                with self._lock:
                    getattr(self, table)[tid] = res
                self._efd[efd].notify()

            self._pool.submit(run)
            return tid

        @staticmethod
        def _name(key: Any) -> bytes:
            return (b"lmcache:" + bytes(key.chunk_hash) + f"/{key.kv_rank}/"
                    f"{key.object_group_id}/{key.cache_salt}".encode())

        def _arrays(self, t: torch.Tensor):
            """keys, values of one KV_2LTD object as kvcompd stores them."""
            k, v = _split(t, self.head_dim)  # ValueError for anything else
            if t.dtype == torch.bfloat16:
                return (k.view(torch.int16).numpy().view(np.uint16),
                        v.view(torch.int16).numpy().view(np.uint16))
            return k.numpy(), v.numpy()

        # store
        def submit_store_task(self, keys: List[Any], objects: List[Any]) -> int:
            return self._task("_stores", 0, lambda: L2StoreResult(False, 0), self._store,
                              list(keys), list(objects))

        def _store(self, keys: List[Any], objects: List[Any]) -> Any:
            ok, total, done, sizes = True, 0, [], []
            for key, obj in zip(keys, objects):
                try:
                    k, v = self._arrays(obj.tensor)
                    r = self.client.put(key.model_name, self._name(key), k, v,
                                        policy=_policy(self.codec))
                    n = int(r.get("stored_bytes", 0))
                    total += n
                    done.append(key)
                    sizes.append(n)
                except Exception as e:  # noqa: BLE001 - the task fails, LMCache decides
                    log_warning("kvcomp L2 store failed: %s", e)
                    ok = False
            if done:
                self._notify_keys_stored(done, sizes)
            return L2StoreResult(ok, total)

        def pop_completed_store_tasks(self) -> Dict[int, Any]:
            with self._lock:
                out, self._stores = self._stores, {}
            return out

        # lookup
        def submit_lookup_and_lock_task(self, keys: List[Any], group_layout_descs: Any = None
                                        ) -> int:
            return self._task("_lookups", 1, lambda: Bitmap(len(keys)), self._lookup,
                              list(keys))

        def _lookup(self, keys: List[Any]) -> Any:
            bm = Bitmap(len(keys))
            for i, key in enumerate(keys):
                try:
                    if self.lookup_client.lookup_prefix(key.model_name, [self._name(key)]):
                        bm.set(i)
                except Exception as e:  # noqa: BLE001 - not held
                    log_warning("kvcomp L2 lookup failed (a miss): %s", e)
            return bm

        def query_lookup_and_lock_result(self, task_id: int) -> Any:
            with self._lock:
                return self._lookups.pop(task_id, None)

        def submit_unlock(self, keys: List[Any]) -> None:
            return None  # nothing is locked (see the class docstring)

        # load
        def submit_load_task(self, keys: List[Any], objects: List[Any]) -> int:
            return self._task("_loads", 2, lambda: Bitmap(len(keys)), self._load, list(keys),
                              list(objects))

        def _load(self, keys: List[Any], objects: List[Any]) -> Any:
            bm = Bitmap(len(keys))
            hit = []
            for i, (key, obj) in enumerate(zip(keys, objects)):
                try:
                    blob = self.client.get_chunk_bytes(key.model_name, [self._name(key)],
                                                       decoded=True)
                    if not blob:
                        continue
                    c = kvcomp.CompressedCache.from_bytes(blob[0])
                    k, v = kvcomp.decompress(c)
                    t = obj.tensor
                    if t.dim() != 4 or t.shape[0] != 2:
                        raise ValueError(f"buffer of shape {tuple(t.shape)} is not KV_2LTD")
                    want = (t.shape[1], t.shape[3] // self.head_dim, t.shape[2], self.head_dim)
                    if k.shape != want or any(n != t.shape[2] for n in c.kept):
                        raise ValueError(f"stored layout {k.shape}, buffer {want}")
                    x = torch.stack([torch.from_numpy(k), torch.from_numpy(v)])
                    t.copy_(x.permute(0, 1, 3, 2, 4).reshape(t.shape).to(t.dtype))
                except Exception as e:  # noqa: BLE001 - this key failed to load
                    log_warning("kvcomp L2 load failed: %s", e)
                    continue
                bm.set(i)
                hit.append(key)
            if hit:
                self._notify_keys_accessed(hit)
            return bm

        def query_load_result(self, task_id: int) -> Any:
            with self._lock:
                return self._loads.pop(task_id, None)

        def close(self) -> None:
            self._pool.shutdown(wait=True)
            for e in self._efd:
                e.close()

    _Adapter.__name__ = _Adapter.__qualname__ = "KvcompL2Adapter"
    _Adapter.__module__ = __name__
    return _Adapter


def log_warning(msg: str, *args: Any) -> None:
    import logging

    logging.getLogger("kvcomp.lmcache").warning(msg, *args)


KvcompL2Adapter = _build_l2_adapter()

"""kvcompd as a secondary tier of vLLM's native KV offloading (vLLM 0.33's TieringOffloadingSpec).

vLLM's offloading connector keeps offloaded KV in a CPU tier (the primary tier) and cascades it
to secondary tiers; a secondary tier loads back into the CPU tier, never into GPU memory.
`KvcompSecondaryTier` is such a tier over a kvcompd pool, loaded from configuration alone
(docs/integrations.md, "vLLM native offloading"):

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"OffloadingConnector",
        "kv_role":"kv_both","kv_connector_extra_config":{
        "spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":8589934592,
        "secondary_tiers":[{"type":"KvcompSecondaryTier",
            "module_path":"kvcomp.integrations.vllm_offload",
            "endpoints":["10.0.0.5:7420,10.0.0.5:7421"],"codec":"lossless"}]}}'

What it stores: each CPU-tier chunk (vLLM's offload page of `blocks_per_chunk` blocks, every
layer and every worker of the engine) as one kvcomp cache under the chunk's offload key (its
block hash and KV cache group), scoped by model and by the engine's parallel layout. The tier
sees the page as vLLM lays it out, which depends on the attention backend: "lossless" stores the
page's values unchanged (bit-exact), "int8" quantizes the first half of the page's vectors of
`head_dim` values to int8 with per-channel scales and keeps the second half (a bounded error on
every vector, not a per-head key codec). The KV cache must be float16 or bfloat16.

Lookups never block the scheduler: they go through vLLM's AsyncLookupManager (batched once per
step on a background thread); lookup answers RETRY while one is in flight, and a lookup the pool
does not answer within `lookup_timeout` seconds is a miss. Stores and loads run on a background
thread and report through get_finished_jobs; a chunk that cannot be loaded (missing, failing its
CRC, a daemon gone or past `timeout`) fails its job, vLLM releases its CPU slot, and the key is
marked missing so that vLLM does not ask again: a miss, recomputed by the engine.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

log = logging.getLogger("kvcomp.vllm_offload")

CODECS = ("lossless", "int8")
_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


class _Lookups(AsyncLookupManager):
    """vLLM's asynchronous lookup state, answered by one lookup_prefix per request batch."""

    def __init__(self, tier: "KvcompSecondaryTier"):
        self._tier = tier
        super().__init__(tier.tier_type)

    def batch_lookup(self, keys: List[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        t = self._tier
        names = [t.store_key(k) for k in keys]
        try:
            n = t.lookup_client.lookup_prefix(t.model, names)
        except Exception as e:  # noqa: BLE001 - an unanswered lookup is a miss
            log.warning("kvcomp tier lookup failed (treated as a miss): %s", e)
            t.counters["lookup_errors"] += 1
            return [False] * len(keys)
        # Keys come in a request's prefix order: the leading n are held; a later key held after
        # a missing one is reported missing (a miss, never a wrong hit).
        return [i < n for i in range(len(keys))]


class KvcompSecondaryTier(SecondaryTierManager):
    """A vLLM secondary offloading tier over a kvcompd pool (module docstring).

    Tier options (the tier's entry of secondary_tiers):
      endpoints: kvcompd endpoints "data_host:port,control_host:port" (list or space-separated;
          default $KVCOMP_ENDPOINTS); the control address is required.
      model: the kvcomp model id (default: vLLM's model name).
      tenant, token: credentials (default $KVCOMP_TENANT, $KVCOMP_TOKEN).
      codec: "lossless" (default) or "int8".
      head_dim: 16-bit values per vector (default 128): the int8 codec's channels, and the row
          width the page is cut into.
      timeout: seconds per put or get (default 10); lookup_timeout: seconds per lookup
          (default 0.5).
      io_threads: background threads for stores and loads (default 2).
    """

    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, endpoints: Any = None, model: str = "",
                 tenant: Optional[str] = None, token: Optional[str] = None,
                 codec: str = "lossless", head_dim: int = 128, timeout: float = 10.0,
                 lookup_timeout: float = 0.5, io_threads: int = 2, locality: Any = None,
                 client: Any = None):
        import os

        import kvcomp

        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                         tier_type=tier_type, backpressure_detector=backpressure_detector)
        cfg = getattr(offloading_spec, "config", None)
        if endpoints is None:
            endpoints = os.environ.get("KVCOMP_ENDPOINTS", "")
        if isinstance(endpoints, str):
            endpoints = endpoints.split()
        self.endpoints = [str(e) for e in endpoints]
        if not self.endpoints:
            raise ValueError("kvcomp tier: no endpoints (set the tier's endpoints or "
                             "KVCOMP_ENDPOINTS)")
        for e in self.endpoints:
            if "," not in e and not e.startswith("dns:"):
                raise ValueError(f"kvcomp tier: endpoint {e!r} has no control address")
        if codec not in CODECS:
            raise ValueError(f"kvcomp tier: codec {codec!r} not one of {CODECS}")
        if head_dim <= 0 or timeout <= 0 or lookup_timeout <= 0 or io_threads <= 0:
            raise ValueError("kvcomp tier: head_dim, timeout, lookup_timeout and io_threads "
                             "must be positive")
        self.model = model or (cfg.model.name if cfg is not None else "")
        if not self.model:
            raise ValueError("kvcomp tier: no model id")
        self.codec = codec
        self.head_dim = int(head_dim)
        dtype = str(cfg.model.dtype) if cfg is not None else "bfloat16"
        self.kv_dtype = _DTYPES.get(dtype.removeprefix("torch."))
        if self.kv_dtype is None:  # kvcompd stores float KV, and checks it is finite
            raise ValueError(f"kvcomp tier: a float16 or bfloat16 KV cache is needed, not "
                             f"{dtype}")
        if self.block_size_bytes % (4 * self.head_dim):
            raise ValueError(f"kvcomp tier: a chunk of {self.block_size_bytes} bytes is not "
                             f"two halves of vectors of {self.head_dim} 16-bit values")
        # The page layout depends on how the engine is split: keys name it.
        if cfg is not None:
            p, c = cfg.parallel, cfg.cache
            agnostic = getattr(p, "is_parallelism_agnostic", False) and \
                getattr(cfg, "canonical_layout", False)
            shape = "any" if agnostic else f"tp{p.tp_size}.pp{p.pp_size}.w{p.world_size}"
            self.layout = (f"{shape}.b{c.blocks_per_chunk}x{c.tokens_per_hash}."
                           f"{dtype}.{self.block_size_bytes}")
        else:
            self.layout = f"{self.block_size_bytes}"
        tenant = os.environ.get("KVCOMP_TENANT", "") if tenant is None else tenant
        token = os.environ.get("KVCOMP_TOKEN", "") if token is None else token
        self.client = client or kvcomp.Client(self.endpoints, tenant=tenant, token=token,
                                              timeout=timeout,
                                              connect_timeout=min(5.0, timeout),
                                              connect=False)
        self.lookup_client = kvcomp.Client(self.endpoints, tenant=tenant, token=token,
                                           timeout=lookup_timeout,
                                           connect_timeout=lookup_timeout, connect=False)
        self.counters: Dict[str, float] = {k: 0 for k in (
            "lookup_errors", "stored_chunks", "store_failures", "loaded_chunks",
            "load_failures", "stored_bytes", "original_bytes")}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=int(io_threads), thread_name_prefix="kvcomp-tier")
        self._lock = threading.Lock()
        self._finished: List[JobResult] = []
        self._failed_keys: List[OffloadKey] = []
        self._inflight: Dict[int, concurrent.futures.Future] = {}
        self._rows: Any = None
        self._lookups = _Lookups(self)

    # keys and pages -------------------------------------------------------------------------

    def store_key(self, key: OffloadKey) -> bytes:
        """The kvcomp key of one offload chunk (the model id scopes it further)."""
        return b"vllm-offload:" + self.layout.encode() + b"/" + bytes(key)

    def _page(self, chunk_id: int) -> Any:
        """The chunk's bytes in the CPU tier, as 16-bit words [rows, head_dim] (a view)."""
        import numpy as np

        if self._rows is None:  # the CPU tier's buffer [chunks, bytes], shared, no copy
            self._rows = np.asarray(self._primary_kv_view).view(np.uint8)
        return self._rows[int(chunk_id)].view(np.uint16).reshape(-1, self.head_dim)

    def _arrays(self, page: Any) -> tuple:
        """keys/values [1, 1, rows / 2, head_dim] of one page, as the codec stores them."""
        import numpy as np

        half = page.shape[0] // 2
        if self.kv_dtype == "float16":
            t = page.view(np.float16).copy()
        else:
            t = page.copy()  # bfloat16 as its raw bits
        k = t[:half].reshape(1, 1, half, self.head_dim)
        v = t[half:].reshape(1, 1, half, self.head_dim)
        return k, v

    def _policy(self) -> Any:
        import kvcomp

        if self.codec == "int8":
            return kvcomp.Policy(ratio=0.0, moments=False, key_codec="int8")
        return kvcomp.Policy(ratio=0.0, moments=False)

    def _write_page(self, chunk_id: int, blob: bytes) -> None:
        """Decodes one stored chunk into its CPU-tier slot; raises on any mismatch."""
        import numpy as np

        import kvcomp

        c = kvcomp.CompressedCache.from_bytes(blob)  # header, table and section CRCs
        page = self._page(chunk_id)
        half = page.shape[0] // 2
        got = (c.num_layers, c.num_kv_heads, c.original_tokens, c.head_dim)
        if got != (1, 1, half, self.head_dim) or any(n != half for n in c.kept):
            raise ValueError(f"stored chunk of layout {got}, the tier's is "
                             f"{(1, 1, half, self.head_dim)}")
        k, v = kvcomp.decompress(c)
        words = np.concatenate([k.reshape(half, -1), v.reshape(half, -1)]).astype(np.float32)
        if self.kv_dtype == "float16":
            page[...] = words.astype(np.float16).view(np.uint16)
        else:
            import torch  # float32 -> bfloat16, rounded to nearest (exact for stored bf16)

            page[...] = torch.from_numpy(words).to(torch.bfloat16).view(torch.int16) \
                .numpy().view(np.uint16)

    # SecondaryTierManager -------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        ids = [int(c) for c in job_metadata.chunk_ids]
        if len(keys) != len(ids):
            raise ValueError(f"{len(keys)} keys for {len(ids)} chunks")
        # The pages are copied here, on the caller's thread, before the job is reported: the
        # slots are pinned until then, the copies are what the thread sends.
        pages = [self._arrays(self._page(c)) for c in ids]
        self._start(job_metadata.job_id, self._store, keys, pages)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        ids = [int(c) for c in job_metadata.chunk_ids]
        if len(keys) != len(ids):
            raise ValueError(f"{len(keys)} keys for {len(ids)} chunks")
        self._start(job_metadata.job_id, self._load, keys, ids)

    def _start(self, job_id: int, fn: Any, *args: Any) -> None:
        fut = self._pool.submit(self._run, job_id, fn, *args)
        with self._lock:
            self._inflight[job_id] = fut

    def _run(self, job_id: int, fn: Any, *args: Any) -> None:
        t0 = time.monotonic()
        try:
            res = fn(job_id, *args)
        except Exception as e:  # noqa: BLE001 - a failed job, never an engine error
            log.warning("kvcomp tier job %d failed: %s", job_id, e)
            res = JobResult(job_id=job_id, success=False)
        res.transfer_time = time.monotonic() - t0
        with self._lock:
            self._finished.append(res)
            self._inflight.pop(job_id, None)

    def _store(self, job_id: int, keys: Sequence[OffloadKey], pages: Sequence[tuple]
               ) -> JobResult:
        stored, ok = 0, True
        for key, (k, v) in zip(keys, pages):
            try:
                r = self.client.put(self.model, self.store_key(key), k, v, policy=self._policy())
                stored += int(r.get("stored_bytes", 0))
                self.counters["stored_chunks"] += 1
                self.counters["original_bytes"] += int(r.get("original_bytes", 0))
            except Exception as e:  # noqa: BLE001
                log.warning("kvcomp tier store failed: %s", e)
                self.counters["store_failures"] += 1
                ok = False
        self.counters["stored_bytes"] += stored
        return JobResult(job_id=job_id, success=ok, transfer_bytes=stored)

    def _load(self, job_id: int, keys: Sequence[OffloadKey], ids: Sequence[int]) -> JobResult:
        names = [self.store_key(k) for k in keys]
        try:
            blobs = self.client.get_chunk_bytes(self.model, names, decoded=True)
        except Exception as e:  # noqa: BLE001 - a daemon gone or past the timeout
            log.warning("kvcomp tier load failed: %s", e)
            blobs = []
        loaded: List[OffloadKey] = []
        nbytes = 0
        for key, chunk_id, blob in zip(keys, ids, blobs):
            try:
                self._write_page(chunk_id, blob)
            except Exception as e:  # noqa: BLE001 - CRC, layout: this chunk and the rest fail
                log.warning("kvcomp tier chunk unusable: %s", e)
                break
            loaded.append(key)
            nbytes += len(blob)
        self.counters["loaded_chunks"] += len(loaded)
        failed = [k for k in keys if k not in set(loaded)]
        if failed:
            self.counters["load_failures"] += len(failed)
            with self._lock:
                self._failed_keys += failed
            return JobResult(job_id=job_id, success=False, successful_keys=loaded,
                             transfer_bytes=nbytes)
        return JobResult(job_id=job_id, success=True, transfer_bytes=nbytes)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            out, self._finished = self._finished, []
            failed, self._failed_keys = self._failed_keys, []
        if failed:  # not offered again: vLLM recomputes them
            self._lookups.mark_miss(failed)
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight or self._finished)

    def drain_jobs(self) -> None:
        with self._lock:
            futs = list(self._inflight.values())
        concurrent.futures.wait(futs)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self._lookups.shutdown()

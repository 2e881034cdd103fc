"""kvcompd as a storage backend of SGLang's HiCache (sglang 0.5.23, HiCacheStorage).

SGLang's hierarchical cache keeps KV pages in host memory and, with a storage backend, stores
them by page hash and prefetches them back. `HiCacheKvcomp` is such a backend over a kvcompd
pool, loaded by SGLang's dynamic backend loader (docs/integrations.md, "SGLang"):

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name":"kvcomp",
            "module_path":"kvcomp.integrations.sglang","class_name":"HiCacheKvcomp",
            "endpoints":["10.0.0.5:7420,10.0.0.5:7421"],"codec":"int8"}'

What it stores: each host page of an MHA model (SGLang's flat data page: keys of every layer,
then values, in the host pool's layout: layer_first, page_first or page_first_direct) as one
kvcomp cache [layers, kv_heads, page_size, head_dim] under the page's hash, scoped by model, TP
rank and size and pipeline stage: "int8" (default) int8 keys with per-channel scales per layer
and head and values as they are, "lossless" both as they are (bit-exact). A page that is
missing, fails its CRC, is of another layout or cannot be fetched in time is a failed get:
SGLang stops the prefetch there and computes the rest. batch_exists answers the longest stored
prefix with one request per daemon. MLA models, Mamba/sliding-window sidecar pools (the _v2
transfers) and zero-copy (_v1) transfers are not supported.
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

import kvcomp

log = logging.getLogger("kvcomp.sglang")

CODECS = ("int8", "lossless")
_OWN = {"backend_name", "module_path", "class_name"}
_OPTIONS = {"endpoints", "codec", "model", "tenant", "token", "timeout", "lookup_timeout"}


class HiCacheKvcomp(HiCacheStorage):
    """SGLang HiCache storage over kvcompd (module docstring). Options (the backend's extra
    config): endpoints ("data,control" addresses; default $KVCOMP_ENDPOINTS), codec, model
    (default SGLang's model name), tenant, token, timeout (seconds per get or set, default 10),
    lookup_timeout (seconds per batch_exists, default 0.5; past it: no page held)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None,
                 client: Any = None):
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - _OWN - _OPTIONS)
        if unknown:
            raise ValueError(f"kvcomp HiCache backend: unknown option(s) {unknown}; known: "
                             f"{sorted(_OPTIONS)}")
        if storage_config.is_mla_model:
            raise ValueError("kvcomp HiCache backend: MLA models are not supported")
        eps = extra.get("endpoints", os.environ.get("KVCOMP_ENDPOINTS", ""))
        if isinstance(eps, str):
            eps = eps.split()
        self.endpoints = [str(e) for e in eps]
        if not self.endpoints:
            raise ValueError("kvcomp HiCache backend: no endpoints")
        for e in self.endpoints:
            if "," not in e and not e.startswith("dns:"):
                raise ValueError(f"kvcomp HiCache backend: endpoint {e!r} has no control "
                                 "address")
        self.codec = str(extra.get("codec", "int8"))
        if self.codec not in CODECS:
            raise ValueError(f"kvcomp HiCache backend: codec {self.codec!r} not one of {CODECS}")
        self.model = str(extra.get("model") or storage_config.model_name or "")
        if not self.model:
            raise ValueError("kvcomp HiCache backend: no model id")
        timeout = float(extra.get("timeout", 10.0))
        lookup_timeout = float(extra.get("lookup_timeout", 0.5))
        tenant = str(extra.get("tenant", os.environ.get("KVCOMP_TENANT", "")))
        token = str(extra.get("token", os.environ.get("KVCOMP_TOKEN", "")))
        self.client = client or kvcomp.Client(self.endpoints, tenant=tenant, token=token,
                                              timeout=timeout,
                                              connect_timeout=min(5.0, timeout),
                                              connect=False)
        self.lookup_client = kvcomp.Client(self.endpoints, tenant=tenant, token=token,
                                           timeout=lookup_timeout,
                                           connect_timeout=lookup_timeout, connect=False)
        c = storage_config
        self.suffix = f"/tp{c.tp_rank}-{c.tp_size}.pp{c.pp_rank}-{c.pp_size}".encode()
        self.mem_pool_host: Any = None
        self.stats = {"sets": 0, "set_failures": 0, "gets": 0, "get_failures": 0,
                      "stored_bytes": 0, "original_bytes": 0}

    # the host pool's page layout ------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        for a in ("layer_num", "head_num", "head_dim", "page_size", "layout", "dtype"):
            if not hasattr(mem_pool_host, a):
                raise ValueError(f"kvcomp HiCache backend: host pool {type(mem_pool_host)} "
                                 f"has no {a} (MHA pools only)")
        if mem_pool_host.layout not in ("layer_first", "page_first", "page_first_direct"):
            raise ValueError(f"kvcomp HiCache backend: host layout {mem_pool_host.layout!r}")
        if mem_pool_host.head_dim not in (64, 128, 256):
            raise ValueError(f"kvcomp HiCache backend: head_dim {mem_pool_host.head_dim} "
                             "(64, 128 or 256)")
        super().register_mem_pool_host(mem_pool_host)

    def _page_shape(self) -> tuple:
        p = self.mem_pool_host
        L, T, H, D = p.layer_num, p.page_size, p.head_num, p.head_dim
        if p.layout == "layer_first":
            return (2, L, T, H, D), (0, 1, 3, 2, 4)        # -> [2, L, H, T, D]
        if p.layout == "page_first":
            return (2, T, L, H, D), (0, 2, 3, 1, 4)
        return (2, L, T, H, D), (0, 1, 3, 2, 4)            # page_first_direct: [2, 1, L, T, H, D]

    def _to_kv(self, page: torch.Tensor):
        if self.mem_pool_host is None:
            raise RuntimeError("kvcomp HiCache backend: no host pool registered")
        shape, perm = self._page_shape()
        x = page.reshape(shape).permute(*perm)
        return x[0].contiguous(), x[1].contiguous()

    def _from_kv(self, k: Any, v: Any, out: torch.Tensor) -> None:
        shape, perm = self._page_shape()
        inv = [perm.index(i) for i in range(5)]
        x = torch.stack([torch.from_numpy(k), torch.from_numpy(v)]).permute(*inv)
        out.copy_(x.reshape(out.shape).to(out.dtype))

    def _key(self, key: str) -> bytes:
        return b"sglang:" + key.encode() + self.suffix

    def _policy(self) -> Any:
        if self.codec == "int8":
            return kvcomp.Policy(ratio=0.0, moments=False, key_codec="int8")
        return kvcomp.Policy(ratio=0.0, moments=False)

    # HiCacheStorage ---------------------------------------------------------------------------

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        try:
            k, v = self._to_kv(value)
            r = self.client.put(self.model, self._key(key), k, v, policy=self._policy())
        except Exception as e:  # noqa: BLE001 - a failed store is a later miss
            log.warning("kvcomp HiCache set %s failed: %s", key, e)
            self.stats["set_failures"] += 1
            return False
        self.stats["sets"] += 1
        self.stats["stored_bytes"] += int(r.get("stored_bytes", 0))
        self.stats["original_bytes"] += int(r.get("original_bytes", 0))
        return True

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        return all([self.set(k, v) for k, v in zip(keys, values or [])]) and \
            len(keys) == len(values or [])

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """The leading pages held, decoded into target_locations (flat host pages); None from
        the first page missing or unusable on."""
        out: List[Optional[torch.Tensor]] = [None] * len(keys)
        if not keys:
            return out
        try:
            blobs = self.client.get_chunk_bytes(self.model, [self._key(k) for k in keys],
                                                decoded=True)
        except Exception as e:  # noqa: BLE001 - a daemon gone or past the timeout
            log.warning("kvcomp HiCache get failed (pages recomputed): %s", e)
            self.stats["get_failures"] += len(keys)
            return out
        p = self.mem_pool_host
        want = (p.layer_num, p.head_num, p.page_size, p.head_dim)
        for i, blob in enumerate(blobs):
            try:
                c = kvcomp.CompressedCache.from_bytes(blob)
                got = (c.num_layers, c.num_kv_heads, c.original_tokens, c.head_dim)
                if got != want or any(n != p.page_size for n in c.kept):
                    raise ValueError(f"layout {got} != {want}")
                k, v = kvcomp.decompress(c)
                dst = target_locations[i]
                if dst is None:
                    dst = p.get_dummy_flat_data_page()
                self._from_kv(k, v, dst)
            except Exception as e:  # noqa: BLE001
                log.warning("kvcomp HiCache page %d unusable (recomputed from here): %s", i, e)
                break
            out[i] = dst
            self.stats["gets"] += 1
        self.stats["get_failures"] += sum(o is None for o in out)
        return out

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """Leading pages stored (0 when the pool does not answer within lookup_timeout)."""
        if not keys:
            return 0
        try:
            return int(self.lookup_client.lookup_prefix(self.model,
                                                        [self._key(k) for k in keys]))
        except Exception as e:  # noqa: BLE001 - a miss
            log.warning("kvcomp HiCache batch_exists failed (a miss): %s", e)
            return 0

    def get_stats(self):
        return dict(self.stats)

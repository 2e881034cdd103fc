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
from typing import Any, Dict

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

"""kvcomp.Client: the Python SDK of kvcompd (a thin layer over the C++ SDK, kvcomp::client).

    import kvcomp
    c = kvcomp.Client(["127.0.0.1:7420,127.0.0.1:7421"], tenant="team-a", token="...")
    c.put("llama-3.1-8b", "req-17", keys, values)          # [layers, kv_heads, tokens, head_dim]
    with c.put_stream("llama-3.1-8b", "req-18", layers=32, kv_heads=8, head_dim=128,
                      tokens=n, dtype="bf16") as s:
        for layer in range(32):
            s.append(layer, k[layer], v[layer])             # [kv_heads, tokens, head_dim]
    cache = c.get("llama-3.1-8b", "req-17")                 # kvcomp.CompressedCache
    kvcomp.attention(q, cache, layer=0)

Endpoints are "host:port" (UCX data port) or "host:port,host:port" (data, then Thrift control,
which stats() needs), or "dns:///name:port[,control_port]" for every address of a DNS name (a
headless Service), resolved again every dns_refresh_interval seconds and after a member fails;
dns_server ("ip[:port]") picks the DNS server. With no endpoints, KVCOMP_ENDPOINTS (space-separated)
gives them. Keys are str (UTF-8) or bytes. Several endpoints are sharded by rendezvous
hashing; replicas > 1 keeps copies on distinct endpoints, with reads failing over between them.

Arrays are NumPy-like in host memory, C-contiguous (non-contiguous arrays raise ValueError;
pass numpy.ascontiguousarray(a)), float32, float16 or bfloat16 (ml_dtypes.bfloat16, a torch
tensor, or uint16 raw bits with dtype="bf16"). Nothing is copied on the way in except to split
a layer into blocks.

Errors: ValueError (bad arguments), KeyError (no such cache), PermissionError (credentials),
ConnectionError (no endpoint reachable), TimeoutError, MemoryError (quota), RuntimeError.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _kvcomp

Key = Union[str, bytes]


def _key(key: Key) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise TypeError(f"key must be str or bytes, not {type(key).__name__}")


def _host_array(a: Any, what: str) -> Tuple[Any, str]:
    """The array as the extension reads it, and the dtype hint ("bf16" for raw bits)."""
    import numpy as np

    # Host memory: DLPack kDLCPU, or kDLCUDAHost (pinned host memory, e.g. a torch tensor made
    # with pin_memory=True), which the CPU reads as any other.
    if hasattr(a, "__cuda_array_interface__") or (
            hasattr(a, "__dlpack_device__") and a.__dlpack_device__()[0] not in (1, 3)):
        raise ValueError(f"{what}: a put stream sends host memory; use Client.put_device for GPU "
                         "tensors")
    if type(a).__module__.startswith("torch"):
        if not a.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous (call .contiguous())")
        if str(a.dtype) == "torch.bfloat16":
            import torch
            return a.view(torch.int16).numpy().view(np.uint16), "bf16"
        return a.numpy(), ""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array or torch tensor, not {type(a).__name__}")
    if not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{what}: array is not C-contiguous (use numpy.ascontiguousarray)")
    if a.dtype.name == "bfloat16":
        return a.view(np.uint16), "bf16"
    if a.dtype == np.uint16:
        return a, "bf16"
    if a.dtype not in (np.float32, np.float16):
        raise ValueError(f"{what}: dtype {a.dtype} unsupported (float32, float16, bfloat16)")
    return a, ""


# A stored cache more than this many times its input warns: positions and the header alone add
# under 1% to a raw cache of 16 tokens or more; what passes it is a policy that does not pay for
# itself (moment summaries of short chunks, codec side data at few tokens).
EXPANSION_WARNING = 1.1


def _warn_if_expanded(result: Dict[str, Any], what: str) -> None:
    """A put whose stored cache is larger than its input says so (RuntimeWarning)."""
    stored, original = result.get("stored_bytes"), result.get("original_bytes")
    if stored is not None and original is not None and stored > EXPANSION_WARNING * original:
        import warnings
        warnings.warn(f"{what}: the stored cache ({stored} bytes) is larger than the original "
                      f"({original} bytes, {stored / max(original, 1):.2f}x); the policy does "
                      f"not pay for itself at this size (docs/research.md, \"Presets\")",
                      RuntimeWarning, stacklevel=3)


def _is_cuda(a: Any) -> bool:
    """True for a CUDA array (DLPack device type 2, or __cuda_array_interface__)."""
    if hasattr(a, "__dlpack_device__"):
        return a.__dlpack_device__()[0] in (2, 13)  # kDLCUDA, kDLCUDAManaged
    return hasattr(a, "__cuda_array_interface__")


def _call_stream(a: Any, stream: Any) -> int:
    """The CUDA stream a device call runs on, as a cudaStream_t number (0: the legacy default
    stream): `stream` when given (an int, or an object with .cuda_stream such as a
    torch.cuda.Stream), else torch's current stream for a torch tensor's device."""
    if stream is not None:
        return int(getattr(stream, "cuda_stream", stream))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor) and a.is_cuda:
        return int(torch.cuda.current_stream(a.device).cuda_stream)
    return 0


def _cuda_capsule(a: Any, stream: int, what: str) -> Any:
    """A DLPack capsule of CUDA array `a`, ordered after its producer on `stream`: the DLPack
    protocol's stream argument makes the producer have `stream` wait for its pending writes
    (1 names the legacy default stream). Nothing synchronises the device."""
    if not _is_cuda(a):
        raise ValueError(f"{what}: expected a CUDA array (a torch CUDA tensor or any DLPack "
                         "producer in CUDA memory); use put()/get() for host memory")
    if not hasattr(a, "__dlpack__"):
        raise TypeError(f"{what}: the device path takes DLPack producers (__dlpack__)")
    try:
        return a.__dlpack__(stream=stream if stream != 0 else 1)
    except TypeError:  # producers of the older protocol take no stream
        return a.__dlpack__()


class DevicePutStream:
    """A put from GPU memory fed one layer at a time as the engine produces it
    (Client.put_device_stream). Over an NCCL channel each layer is sent when appended, after
    its producer's pending writes on the call's stream, overlapping the engine's later layers;
    otherwise (CUDA IPC on the daemon's own GPU, or host memory over UCX) the layers are taken
    at commit. A layer's memory must stay as it was until commit returns. Leaving the `with`
    block without commit (or on an exception) aborts the put: nothing is stored."""

    def __init__(self, native: Any):
        self._s = native

    @property
    def path(self) -> str:
        """"nccl" while layers go over the GPU channel as appended, else "ipc" or "ucx"."""
        return self._s.path

    def append_layer(self, layer: int, keys: Any, values: Any, *, stream: Any = None) -> None:
        """Layer `layer` (in order from 0): keys/values CUDA arrays [kv_heads, tokens, head_dim]."""
        s = _call_stream(keys, stream)
        self._s.append_layer(layer, _cuda_capsule(keys, s, "keys"),
                             _cuda_capsule(values, s, "values"), stream=s)

    def commit(self) -> Dict[str, Any]:
        return self._s.commit()

    def close(self) -> None:
        self._s.close()

    def __enter__(self) -> "DevicePutStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._s.close()


class DeviceGetStream:
    """A dense get into preallocated CUDA arrays handed back one layer at a time
    (Client.get_layers). Over an NCCL channel the layers arrive in order on a stream of the
    SDK and wait_layer(l) makes a stream (default: torch's current one) wait for layer l on the
    device, so decode can start on layer 0 while later layers arrive; otherwise every layer is
    in place already. Iterating yields the layer indices after waiting for each. finish()
    (also on leaving a `with` block) waits for every layer, ordered on the call's stream."""

    def __init__(self, native: Any, layers: int, like: Any):
        self._s = native
        self._layers = layers
        self._like = like

    def wait_layer(self, layer: int, *, stream: Any = None) -> None:
        self._s.wait_layer(layer, stream=_call_stream(self._like, stream))

    def __iter__(self):
        for layer in range(self._layers):
            self.wait_layer(layer)
            yield layer

    def finish(self) -> Dict[str, Any]:
        return self._s.finish()

    def __enter__(self) -> "DeviceGetStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._s.finish()
        except Exception:  # noqa: BLE001 - the body's exception, if any, goes on
            if exc[0] is None:
                raise


class PutStream:
    """A put fed layer by layer; a context manager that commits on success, aborts on error."""

    def __init__(self, native: Any, dtype: str):
        self._s = native
        self._dtype = dtype
        self.result: Optional[Dict[str, Any]] = None

    def append(self, layer: int, keys: Any, values: Any, token_begin: int = 0) -> None:
        """Sends keys/values [kv_heads, n, head_dim] of `layer` for tokens [token_begin, +n)."""
        k, hk = _host_array(keys, "keys")
        v, hv = _host_array(values, "values")
        if (hk == "bf16") != (self._dtype == "bf16") or (hv == "bf16") != (self._dtype == "bf16"):
            raise ValueError(f"keys/values dtype differs from the stream's {self._dtype}")
        self._s.append(layer, k, v, token_begin)

    def commit(self) -> Dict[str, Any]:
        """Stores the cache; returns original_bytes, stored_bytes, total_kept, endpoints."""
        self.result = self._s.commit()
        return self.result

    def abort(self) -> None:
        self._s.abort()

    def __enter__(self) -> "PutStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.result is None:
                self.commit()
        else:
            self.abort()


class Client:
    """A connection to one or more kvcompd instances (thread-safe; share it)."""

    def __init__(self, endpoints: Union[str, Sequence[str], None] = None, *, tenant: str = "",
                 token: str = "", replicas: int = 1, connect_timeout: float = 5.0,
                 timeout: float = 60.0, max_block_bytes: int = 8 << 20,
                 ucx: Optional[Dict[str, str]] = None, connect: bool = True,
                 dns_server: str = "", dns_refresh_interval: float = 5.0,
                 lookup_timeout: float = 1.0, get_timeout: float = 10.0):
        """endpoints: "data_host:port[,control_host:port]" each (or "dns:///NAME:DATA[,CONTROL]");
        None reads KVCOMP_ENDPOINTS (whitespace-separated). timeout: one data-plane request;
        lookup_timeout: the deadline of one lookup_prefix call as a whole (TimeoutError when no
        daemon answers in time, e.g. a stalled one); get_timeout: the same for get, get_bytes,
        lookup and get_chunks. Each of those calls also takes its own `timeout` (seconds), which
        replaces the client's for that call.
        An address that is not a kvcompd port raises RuntimeError naming what answered there."""
        if endpoints is None:
            endpoints = os.environ.get("KVCOMP_ENDPOINTS", "").split()
            if not endpoints:
                raise ValueError("no endpoints given and KVCOMP_ENDPOINTS is not set")
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        self.endpoints = list(endpoints)
        self._c = _kvcomp._Client.connect(
            self.endpoints, tenant=tenant, token=token, replicas=replicas,
            connect_timeout=connect_timeout, request_timeout=timeout,
            max_block_bytes=max_block_bytes, ucx=sorted((ucx or {}).items()),
            connect_now=connect, dns_server=dns_server,
            dns_refresh_interval=dns_refresh_interval, lookup_timeout=lookup_timeout,
            get_timeout=get_timeout)

    def put(self, model: str, key: Key, keys: Any, values: Any, *, policy: Any = None,
            num_q_heads: Optional[int] = None, k_scale: Any = None,
            v_scale: Any = None) -> Dict[str, Any]:
        """Pushes a whole cache: keys/values [layers, kv_heads, tokens, head_dim].

        policy: a kvcomp.Policy, or None for the tenant's default on the daemon.
        Returns original_bytes, stored_bytes, total_kept and the endpoints holding copies.
        CUDA arrays go to put_device (torch's current stream). fp8 (float8_e4m3fn) keys and
        values go with their scales k_scale and v_scale and are sent as float32
        (kvcomp.layouts.dequantize_fp8).
        """
        from .layouts import dequantize_fp8, is_fp8
        if is_fp8(keys) or is_fp8(values):
            if k_scale is None or v_scale is None:
                raise ValueError("fp8 keys and values need their scales (k_scale, v_scale)")
            keys, values = dequantize_fp8(keys, k_scale), dequantize_fp8(values, v_scale)
        elif k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale are for fp8 (float8_e4m3fn) keys and values")
        if _is_cuda(keys) or _is_cuda(values):
            return self.put_device(model, key, keys, values, policy=policy,
                                   num_q_heads=num_q_heads)
        k, hk = _host_array(keys, "keys")
        v, hv = _host_array(values, "values")
        out = self._c.put(model, _key(key), k, v, q_heads=num_q_heads or 0, policy=policy,
                          dtype=hk or hv)
        _warn_if_expanded(out, "Client.put")
        return out

    def put_device(self, model: str, key: Key, keys: Any, values: Any, *, policy: Any = None,
                   num_q_heads: Optional[int] = None, stream: Any = None) -> Dict[str, Any]:
        """Pushes a cache held in GPU memory, zero-copy: keys/values are CUDA arrays
        [layers, kv_heads, tokens, head_dim] (torch CUDA tensors or any DLPack producer), read
        on `stream` (default: torch's current stream for torch tensors, else the legacy default
        stream) after their producer's pending writes. Over the GPU channel when the daemon
        offers one (NCCL from another GPU, CUDA IPC on the daemon's own GPU), else over UCX: out of
        device memory where both sides' UCX has CUDA memory, else staged through pinned host
        memory (docs/protocol.md, "GPU channel", "CUDA-aware UCX"); the result's "path" says
        which ("nccl", "ipc", "ucx-cuda" or "ucx")."""
        s = _call_stream(keys, stream)
        k = _cuda_capsule(keys, s, "keys")
        v = _cuda_capsule(values, s, "values")
        return self._c.put_device(model, _key(key), k, v, q_heads=num_q_heads or 0,
                                  policy=policy, stream=s)

    def get_into(self, model: str, key: Key, keys: Any, values: Any, *,
                 num_q_heads: Optional[int] = None, stream: Any = None) -> Dict[str, Any]:
        """Writes a cache that kept every token (a ratio-0 policy) into preallocated CUDA arrays
        keys/values [layers, kv_heads, tokens, head_dim] of its layout and dtype, on `stream`
        (as put_device): work queued on that stream after the call sees the data. Raises for a
        cache that evicted tokens (use get())."""
        s = _call_stream(keys, stream)
        k = _cuda_capsule(keys, s, "keys")
        v = _cuda_capsule(values, s, "values")
        return self._c.get_kv_into(model, _key(key), k, v, q_heads=num_q_heads or 0, stream=s)

    def get_bytes_into(self, model: str, key: Key, out: Any, *, decoded: bool = False,
                       stream: Any = None) -> Dict[str, Any]:
        """Writes the cache's bytes as stored (docs/format.md), or decoded, into a preallocated
        contiguous CUDA array `out` (any dtype; e.g. a torch.uint8 tensor) on `stream` (as
        put_device). Returns bytes written and the path; raises when `out` is too small."""
        s = _call_stream(out, stream)
        return self._c.get_bytes_into(model, _key(key), _cuda_capsule(out, s, "out"),
                                      decoded=decoded, stream=s)

    def put_device_stream(self, model: str, key: Key, *, layers: int, kv_heads: int,
                          head_dim: int, tokens: int, dtype: str = "bf16", device: int = 0,
                          q_heads: Optional[int] = None, policy: Any = None) -> DevicePutStream:
        """Opens a put from GPU memory (CUDA `device`) fed layer by layer (DevicePutStream)."""
        native = self._c.open_device_put_stream(model, _key(key), layers, kv_heads, q_heads or 0,
                                                head_dim, tokens, dtype, device=device,
                                                policy=policy)
        return DevicePutStream(native)

    def get_layers(self, model: str, key: Key, keys: Any, values: Any, *,
                   num_q_heads: Optional[int] = None, stream: Any = None) -> DeviceGetStream:
        """As get_into, handed back layer by layer (DeviceGetStream): keys/values CUDA arrays
        [layers, kv_heads, tokens, head_dim], written after the work queued on `stream`."""
        s = _call_stream(keys, stream)
        k = _cuda_capsule(keys, s, "keys")
        v = _cuda_capsule(values, s, "values")
        native = self._c.open_device_get_stream(model, _key(key), k, v, q_heads=num_q_heads or 0,
                                                stream=s)
        return DeviceGetStream(native, int(keys.shape[0]), keys)

    def gpu_stats(self) -> Dict[str, Any]:
        """How device puts and gets travelled: nccl_puts, nccl_gets, ipc_puts, ipc_gets,
        fallback_puts, fallback_gets, channels_opened, channel_failures and
        last_fallback_reason."""
        return self._c.gpu_stats()

    def probe_gpu_channel(self, endpoint: str, device: int = 0) -> Optional[str]:
        """Negotiates the GPU channel to `endpoint` (a data address) for CUDA `device`: None when
        NCCL will carry payloads, else the reason device calls fall back."""
        why = self._c.probe_gpu_channel(endpoint, device)
        return why or None

    def put_stream(self, model: str, key: Key, *, layers: int, kv_heads: int, head_dim: int,
                   tokens: int, dtype: str = "bf16", q_heads: Optional[int] = None,
                   policy: Any = None, block_wise: bool = False) -> PutStream:
        """Opens a streamed put (see PutStream); block_wise compresses as blocks arrive."""
        native = self._c.open_put_stream(model, _key(key), layers, kv_heads, q_heads or 0,
                                         head_dim, tokens, dtype, policy=policy,
                                         block_wise=block_wise)
        return PutStream(native, dtype)

    def get(self, model: str, key: Key, *, decoded: bool = False,
            timeout: Optional[float] = None):
        """The cache as a kvcomp.CompressedCache; decoded=True asks the daemon to decode the
        kept tokens to the input dtype (raw codecs). TimeoutError when no daemon answered within
        `timeout` seconds (None: the client's get_timeout)."""
        return self._c.get(model, _key(key), decoded, timeout)

    def get_bytes(self, model: str, key: Key, *, timeout: Optional[float] = None) -> bytes:
        """The encoded cache as stored (docs/format.md); `timeout` as for get."""
        return self._c.get_bytes(model, _key(key), timeout)

    def lookup(self, model: str, key: Key, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Where the cache is and its sizes; KeyError when absent; `timeout` as for get."""
        return self._c.lookup(model, _key(key), timeout)

    def delete(self, model: str, key: Key) -> None:
        """Deletes every copy; KeyError when no endpoint had it."""
        self._c.delete(model, _key(key))

    def stats(self) -> List[Dict[str, Any]]:
        """Per-endpoint statistics of this tenant (needs the endpoints' control addresses)."""
        return self._c.stats()

    def calibrate(self, model: str, *, error_budget: float = 0.0, rank: int = 0,
                  value_codec: str = "orthogonal_int8", max_caches: int = 64,
                  key_bits: int = 3, value_bits: int = 2) -> List[Dict[str, Any]]:
        """Has every endpoint fit a KVSplice value projection for `model` from the caches it
        stores with raw values (up to `max_caches`): `rank` for every layer, or (rank 0) the
        smallest per-layer ranks whose relative value error meets `error_budget`. Later puts
        whose policy asks for an orthogonal value codec are encoded with it. Returns one dict per
        endpoint: endpoint, ok, error, projection_version, rank (the largest layer's),
        layer_ranks, achieved_error, caches_used. ValueError for bad arguments.

        value_codec="pq" fits the model's pq calibration instead (the calibrated basis codec:
        the keys' and values' bases from the caches it stores with raw keys and values, at
        key_bits and value_bits per element: 3 and 2 are the `codec` preset's), which later puts
        of pq policies at those bits encode with; rank and error_budget do not apply, and
        projection_version is the calibration's version."""
        return self._c.calibrate(model, value_codec, rank, error_budget, max_caches,
                                 int(key_bits), int(value_bits))

    # Prefix and chunk reuse (docs/protocol.md, "Prefix and chunk reuse"): a prompt's cache is
    # stored as one cache per chunk of tokens under keys the engine already computes (chained
    # block hashes: key i names the whole prefix up to chunk i). Each chunk is placed by its own
    # key; lookups and gets ask every daemon involved once, in parallel, over its control port.

    def lookup_prefix(self, model: str, keys: Sequence[Key], *,
                      timeout: Optional[float] = None) -> int:
        """How many leading `keys` this tenant has stored (one request per daemon involved).
        ValueError for an invalid key; RuntimeError (FailedPrecondition) when an endpoint has no
        control address or its control address is not a kvcompd control port; TimeoutError when
        no daemon answered within `timeout` seconds (None: the client's lookup_timeout);
        ConnectionError when none could be reached."""
        return self._c.lookup_prefix(model, [_key(k) for k in keys], timeout)

    def put_chunks(self, model: str, keys: Sequence[Key], k: Any, v: Any, chunk_tokens: int,
                   *, first: int = 0, policy: Any = None, num_q_heads: Optional[int] = None,
                   max_in_flight: int = 1) -> List[Dict[str, Any]]:
        """Stores keys/values [layers, kv_heads, tokens, head_dim] as one cache per chunk of
        `chunk_tokens` tokens, chunk i under keys[i], compressed on its own; chunks before
        `first` are skipped (already stored). Only whole chunks are stored: tokens must be
        len(keys) * chunk_tokens. Up to `max_in_flight` chunk puts are in flight at once (each
        is its own round trip to the daemon that holds it; 1 puts them one after another).
        CUDA arrays are read on torch's current stream of the calling thread. Returns each
        stored chunk's put result, in order; the first failure is raised once every put has
        ended (chunks before it may be stored)."""
        import numpy as np

        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        tokens = k.shape[2]
        if k.shape != v.shape or len(k.shape) != 4:
            raise ValueError("keys and values must both be [layers, kv_heads, tokens, head_dim]")
        if tokens != len(keys) * chunk_tokens:
            raise ValueError(f"{tokens} tokens are not {len(keys)} chunks of {chunk_tokens}")
        if not 0 <= first <= len(keys):
            raise ValueError(f"first {first} outside [0, {len(keys)}]")
        is_torch = type(k).__module__.startswith("torch")
        cuda = _is_cuda(k) or _is_cuda(v)
        # The calling thread's stream: every chunk's copy and put is ordered on it, whichever
        # thread runs them.
        tstream = None
        if cuda and is_torch:
            import torch
            tstream = torch.cuda.current_stream(k.device)

        def put_one(i: int) -> Dict[str, Any]:
            t0, t1 = i * chunk_tokens, (i + 1) * chunk_tokens
            ck, cv = k[:, :, t0:t1], v[:, :, t0:t1]
            if tstream is not None:
                import torch
                with torch.cuda.stream(tstream):
                    ck, cv = ck.contiguous(), cv.contiguous()
                return self.put_device(model, keys[i], ck, cv, policy=policy,
                                       num_q_heads=num_q_heads, stream=tstream)
            if is_torch:
                ck, cv = ck.contiguous(), cv.contiguous()
            elif not cuda:
                ck, cv = np.ascontiguousarray(ck), np.ascontiguousarray(cv)
            return self.put(model, keys[i], ck, cv, policy=policy, num_q_heads=num_q_heads)

        todo = range(first, len(keys))
        if max_in_flight == 1 or len(todo) <= 1:
            return [put_one(i) for i in todo]
        from concurrent.futures import ThreadPoolExecutor, wait

        # The SDK's calls release the GIL while they wait on the network and the device.
        with ThreadPoolExecutor(max_workers=min(max_in_flight, len(todo))) as pool:
            futures = [pool.submit(put_one, i) for i in todo]
            wait(futures)
        return [f.result() for f in futures]

    def get_chunks(self, model: str, keys: Sequence[Key], *, decoded: bool = False,
                   timeout: Optional[float] = None) -> List[Any]:
        """The caches (kvcomp.CompressedCache) of the leading `keys` stored, in order, with one
        request per daemon involved; decoded=True has the daemons decode int8 keys and KVSplice
        values to the input dtype. Fewer than len(keys) when one is missing. TimeoutError when
        no daemon answered within `timeout` seconds (None: the client's get_timeout)."""
        return self._c.get_chunks(model, [_key(k) for k in keys], decoded, timeout)

    def get_chunk_bytes(self, model: str, keys: Sequence[Key], *, decoded: bool = False,
                        timeout: Optional[float] = None) -> List[bytes]:
        """As get_chunks, the encoded bytes (docs/format.md)."""
        return self._c.get_chunk_bytes(model, [_key(k) for k in keys], decoded, timeout)

    def ranking(self, model: str, key: Key) -> List[str]:
        """The endpoints in the order this key's reads and writes try them."""
        return self._c.ranking(model, _key(key))

"""The kvcomp command line: put, get, lookup, delete, stats, calibrate and a load generator.

    kvcomp put   -m MODEL -k KEY --keys k.npy --values v.npy      # kvcompd on this machine
    kvcomp put   -e 10.0.0.7:7470,10.0.0.7:7471 -m MODEL -k KEY --safetensors cache.safetensors
    kvcomp get   -m MODEL -k KEY --out cache.kvc [--npz kept.npz] [--decoded]
    kvcomp lookup|delete -m MODEL -k KEY
    kvcomp stats
    kvcomp calibrate -m MODEL --error-budget 0.1
    kvcomp calibrate -m MODEL --value-codec pq
    kvcomp loadgen --requests 100 --concurrency 4 --tokens 2048
    kvcomp put-chunks -m MODEL --chunk-tokens 16 --chunk-keys h1,h2,h3 --keys ... --values ...
    kvcomp prefix     -m MODEL --chunk-keys h1,h2,h3     # how many leading chunks are stored
    kvcomp get-chunks -m MODEL --chunk-keys h1,h2,h3 --npz run.npz [--decoded]
    kvcomp --version            (python -m kvcomp works the same)

Endpoints: -e DATA[,CONTROL] (repeat for several daemons), else $KVCOMP_ENDPOINTS
(whitespace-separated), else 127.0.0.1:7470,127.0.0.1:7471 (kvcompd's default data and
control ports). The control address is needed by stats, calibrate, prefix and the chunk commands.

Chunk keys (chained block hashes, chunk i's key naming the prefix up to chunk i) come as a
comma-separated --chunk-keys list or --chunk-keys-file (one per line; "hex:..." for bytes).

Arrays: keys and values [layers, kv_heads, tokens, head_dim], float32/float16/bfloat16 (a
.safetensors file holds tensors named "keys" and "values", or "layers.<i>.keys" and
"layers.<i>.values" per layer). Credentials: --tenant/--token or KVCOMP_TENANT/KVCOMP_TOKEN.
Exit status: 0 on success, 1 on a failed request, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from typing import List, Optional

import numpy as np


class _NoProgress:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass


def _progress(total: int, desc: str, unit: str = "it"):
    """A tqdm bar on a terminal (or with KVCOMP_PROGRESS=1); nothing without tqdm (the [cli]
    extra installs it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit=unit, disable=not sys.stderr.isatty() and
                os.environ.get("KVCOMP_PROGRESS") != "1", file=sys.stderr)


DEFAULT_ENDPOINT = "127.0.0.1:7470,127.0.0.1:7471"


def _endpoints(args) -> List[str]:
    if args.endpoint:
        return args.endpoint
    return os.environ.get("KVCOMP_ENDPOINTS", "").split() or [DEFAULT_ENDPOINT]


def _client(args):
    from .client import Client
    return Client(_endpoints(args), tenant=args.tenant, token=args.token,
                  replicas=args.replicas, timeout=args.timeout,
                  connect_timeout=args.connect_timeout, lookup_timeout=args.lookup_timeout,
                  get_timeout=args.get_timeout)


def _policy(args):
    if not args.policy:
        return None
    from . import Policy
    fields = {}
    for item in args.policy.split(","):
        name, _, value = item.partition("=")
        if not _:
            raise SystemExit(f"--policy: expected name=value, got '{item}'")
        for conv in (int, float):
            try:
                value = conv(value)
                break
            except ValueError:
                continue
        if value in ("true", "false"):
            value = value == "true"
        fields[name.strip()] = value
    return Policy(**fields)


def _load_arrays(args):
    if args.safetensors:
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise SystemExit("--safetensors needs the safetensors package: "
                             "pip install 'kvcomp[cli]'")
        t = load_file(args.safetensors)
        if "keys" in t and "values" in t:
            return t["keys"], t["values"]
        layers = sorted({int(n.split(".")[1]) for n in t if n.startswith("layers.")})
        if not layers:
            raise SystemExit("--safetensors: no 'keys'/'values' or 'layers.<i>.keys' tensors")
        k = np.stack([t[f"layers.{i}.keys"] for i in layers])
        v = np.stack([t[f"layers.{i}.values"] for i in layers])
        return k, v
    if not (args.keys and args.values):
        raise SystemExit("put: give --keys and --values, or --safetensors")
    return np.load(args.keys), np.load(args.values)


def cmd_put(args) -> int:
    keys, values = _load_arrays(args)
    if keys.ndim != 4:
        raise SystemExit(f"keys: expected [layers, kv_heads, tokens, head_dim], got {keys.shape}")
    c = _client(args)
    layers, kv_heads, tokens, head_dim = keys.shape
    dtype = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "uint16": "bf16"}.get(
        keys.dtype.name)
    if dtype is None:
        raise SystemExit(f"keys: dtype {keys.dtype} unsupported (float32, float16, bfloat16)")
    t0 = time.perf_counter()
    with c.put_stream(args.model, args.key, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                      tokens=tokens, dtype=dtype, q_heads=args.q_heads, policy=_policy(args),
                      block_wise=args.block_wise) as s, _progress(layers, "put", "layer") as bar:
        for i in range(layers):
            s.append(i, np.ascontiguousarray(keys[i]), np.ascontiguousarray(values[i]))
            bar.update(1)
    r = dict(s.result, seconds=round(time.perf_counter() - t0, 4))
    r["ratio"] = r["original_bytes"] / max(1, r["stored_bytes"])
    print(json.dumps(r, indent=2))
    return 0


def cmd_get(args) -> int:
    c = _client(args)
    if args.out:
        data = c.get_bytes(args.model, args.key)
        with open(args.out, "wb") as f:
            f.write(data)
        print(f"wrote {len(data)} bytes to {args.out}", file=sys.stderr)
    if args.npz or not args.out:
        cache = c.get(args.model, args.key, decoded=args.decoded)
        if args.npz:
            arrays = {}
            for layer in range(cache.num_layers):
                for head in range(cache.num_kv_heads):
                    p = f"layer{layer}.head{head}"
                    arrays[f"{p}.positions"] = cache.kept_positions(layer, head)
                    if args.decoded or cache_is_raw(cache):
                        arrays[f"{p}.keys"] = cache.keys(layer, head)
                        arrays[f"{p}.values"] = cache.values(layer, head)
            np.savez(args.npz, **arrays)
            print(f"wrote {len(arrays)} arrays to {args.npz}", file=sys.stderr)
        else:
            print(json.dumps({"nbytes": cache.nbytes, "original_nbytes": cache.original_nbytes},
                             indent=2))
    return 0


def cache_is_raw(cache) -> bool:
    from . import cache_codecs
    codecs = cache_codecs(cache)
    return codecs.get("value_codec", "none") == "none" and codecs.get("key_codec", "raw") in (
        "raw", "fp16")


def cmd_lookup(args) -> int:
    print(json.dumps(_client(args).lookup(args.model, args.key), indent=2))
    return 0


def cmd_delete(args) -> int:
    _client(args).delete(args.model, args.key)
    print("deleted", file=sys.stderr)
    return 0


def cmd_stats(args) -> int:
    print(json.dumps(_client(args).stats(), indent=2))
    return 0


def cmd_calibrate(args) -> int:
    """Has every endpoint fit a KVSplice projection (or, with --value-codec pq, the pq
    calibration) for the model; one JSON result each. Exit 1 when an endpoint failed."""
    if args.value_codec != "pq" and args.error_budget is None and args.rank is None:
        print("calibrate: give --error-budget or --rank (a KVSplice projection), or "
              "--value-codec pq", file=sys.stderr)
        return 2  # a usage error, as argparse's
    results = _client(args).calibrate(args.model, error_budget=args.error_budget or 0.0,
                                      rank=args.rank or 0, value_codec=args.value_codec,
                                      max_caches=args.max_caches, key_bits=args.key_bits,
                                      value_bits=args.value_bits)
    print(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


def cmd_loadgen(args) -> int:
    """Puts (and optionally gets) random caches; prints throughput and latency percentiles."""
    c = _client(args)
    rng = np.random.default_rng(args.seed)
    shape = (args.layers, args.kv_heads, args.tokens, args.head_dim)
    keys = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    values = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    policy = _policy(args)
    lat_put: List[float] = []
    lat_get: List[float] = []
    errors: List[str] = []

    def one(i: int) -> None:
        key = f"loadgen-{args.seed}-{i}"
        t0 = time.perf_counter()
        c.put(args.model, key, keys, values, policy=policy)
        lat_put.append(time.perf_counter() - t0)
        if args.get:
            t0 = time.perf_counter()
            c.get(args.model, key)
            lat_get.append(time.perf_counter() - t0)
        if not args.keep:
            c.delete(args.model, key)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool, \
            _progress(args.requests, "loadgen", "req") as bar:
        futures = [pool.submit(one, i) for i in range(args.requests)]
        for f in concurrent.futures.as_completed(futures):
            if f.exception() is not None:
                errors.append(str(f.exception()))
            bar.update(1)
    wall = time.perf_counter() - t0
    nbytes = keys.nbytes * 2

    def pct(xs, q):
        return round(float(np.percentile(xs, q)) * 1e3, 3) if xs else None

    print(json.dumps({
        "requests": args.requests, "errors": len(errors), "first_error": errors[:1],
        "seconds": round(wall, 3), "put_per_second": round(len(lat_put) / wall, 2),
        "ingest_gb_per_second": round(len(lat_put) * nbytes / wall / 1e9, 4),
        "put_ms_p50": pct(lat_put, 50), "put_ms_p99": pct(lat_put, 99),
        "get_ms_p50": pct(lat_get, 50), "get_ms_p99": pct(lat_get, 99)}, indent=2))
    return 1 if errors else 0


def _chunk_keys(args) -> List[object]:
    if bool(args.chunk_keys) == bool(args.chunk_keys_file):
        raise SystemExit("give --chunk-keys or --chunk-keys-file")
    if args.chunk_keys:
        names = args.chunk_keys.split(",")
    else:
        with open(args.chunk_keys_file) as f:
            names = [line.strip() for line in f if line.strip()]
    return [bytes.fromhex(n[4:]) if n.startswith("hex:") else n for n in names]


def cmd_prefix(args) -> int:
    keys = _chunk_keys(args)
    held = _client(args).lookup_prefix(args.model, keys)
    print(json.dumps({"held": held, "asked": len(keys)}, indent=2))
    return 0


def cmd_put_chunks(args) -> int:
    keys, values = _load_arrays(args)
    if keys.ndim != 4:
        raise SystemExit(f"keys: expected [layers, kv_heads, tokens, head_dim], got {keys.shape}")
    names = _chunk_keys(args)
    t0 = time.perf_counter()
    results = _client(args).put_chunks(args.model, names, keys, values, args.chunk_tokens,
                                       first=args.first, policy=_policy(args),
                                       num_q_heads=args.q_heads)
    print(json.dumps({
        "chunks": len(results),
        "original_bytes": sum(r["original_bytes"] for r in results),
        "stored_bytes": sum(r["stored_bytes"] for r in results),
        "endpoints": sorted({e for r in results for e in r["endpoints"]}),
        "seconds": round(time.perf_counter() - t0, 4)}, indent=2))
    return 0


def cmd_get_chunks(args) -> int:
    names = _chunk_keys(args)
    chunks = _client(args).get_chunks(args.model, names, decoded=args.decoded)
    out = {"chunks": len(chunks), "asked": len(names),
           "nbytes": sum(c.nbytes for c in chunks),
           "tokens": sum(c.original_tokens for c in chunks)}
    if args.npz and chunks:
        from .chunks import assemble
        k, v = assemble(chunks)
        np.savez(args.npz, keys=k, values=v)
        out["npz"] = args.npz
    print(json.dumps(out, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__
    ap = argparse.ArgumentParser(prog="kvcomp", description=__doc__.split("\n")[0],
                                 epilog="kvcomp COMMAND --help describes a command's options.")
    ap.add_argument("--version", action="version", version=f"kvcomp {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-e", "--endpoint", action="append", metavar="DATA[,CONTROL]",
                        help="kvcompd data[,control] address, e.g. 10.0.0.7:7470,10.0.0.7:7471; "
                        "repeat for several (default: $KVCOMP_ENDPOINTS, else "
                        f"{DEFAULT_ENDPOINT})")
    common.add_argument("--tenant", default=os.environ.get("KVCOMP_TENANT", ""),
                        help="tenant name (default: $KVCOMP_TENANT, else the open daemon's "
                        "\"default\")")
    common.add_argument("--token", default=os.environ.get("KVCOMP_TOKEN", ""),
                        help="the tenant's token (default: $KVCOMP_TOKEN)")
    common.add_argument("--replicas", type=int, default=1,
                        help="copies of each cache on distinct daemons (default 1)")
    common.add_argument("--timeout", type=float, default=60.0,
                        help="one data-plane request, seconds (default 60)")
    common.add_argument("--connect-timeout", type=float, default=5.0,
                        help="connecting to a daemon, seconds (default 5)")
    common.add_argument("--lookup-timeout", type=float, default=1.0,
                        help="deadline of a prefix lookup, seconds (default 1)")
    common.add_argument("--get-timeout", type=float, default=10.0,
                        help="deadline of a chunk get, seconds (default 10)")
    keyed = argparse.ArgumentParser(add_help=False)
    keyed.add_argument("-m", "--model", required=True, help="model id the cache belongs to")
    keyed.add_argument("-k", "--key", required=True,
                       help="cache key (text)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("put", parents=[common, keyed], help="push a cache from files")
    _array_args(p)
    p.add_argument("--policy", help="comma-separated Policy fields, e.g. scorer=keydiff,ratio=0.7 "
                   "(default: the tenant's policy on the daemon)")
    p.add_argument("--block-wise", action="store_true",
                   help="compress layer by layer as the layers arrive")
    p.set_defaults(fn=cmd_put)

    p = sub.add_parser("get", parents=[common, keyed], help="fetch a cache to files")
    p.add_argument("--out", help="write the encoded cache bytes here")
    p.add_argument("--npz", help="write kept positions/keys/values per (layer, head) here")
    p.add_argument("--decoded", action="store_true", help="ask the daemon to decode the codecs")
    p.set_defaults(fn=cmd_get)

    sub.add_parser("lookup", parents=[common, keyed],
                   help="describe a stored cache (layout, tier, sizes)").set_defaults(fn=cmd_lookup)
    sub.add_parser("delete", parents=[common, keyed],
                   help="delete every copy of a cache").set_defaults(fn=cmd_delete)
    sub.add_parser("stats", parents=[common],
                   help="the tenant's caches and bytes on each daemon").set_defaults(fn=cmd_stats)

    p = sub.add_parser("calibrate", parents=[common],
                       help="fit KVSplice value projections (or the pq calibration) from the "
                            "caches the daemons store")
    p.add_argument("-m", "--model", required=True)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--error-budget", type=float, help="relative value error; per-layer ranks")
    g.add_argument("--rank", type=int, help="one rank for every layer")
    p.add_argument("--value-codec", default="orthogonal_int8",
                   choices=["orthogonal", "orthogonal_int8", "orthogonal_int4", "pq"],
                   help="pq: the calibrated basis codec's keys' and values' bases (the codec "
                        "preset's), at --key-bits / --value-bits")
    p.add_argument("--key-bits", type=int, default=3, help="pq: bits per key element (3)")
    p.add_argument("--value-bits", type=int, default=2, help="pq: bits per value element (2)")
    p.add_argument("--max-caches", type=int, default=64,
                   help="caches each daemon learns from (default 64)")
    p.set_defaults(fn=cmd_calibrate)

    chunked = argparse.ArgumentParser(add_help=False)
    chunked.add_argument("-m", "--model", required=True, help="model id the chunks belong to")
    chunked.add_argument("--chunk-keys", help="comma-separated chunk keys, in prompt order")
    chunked.add_argument("--chunk-keys-file", help="chunk keys, one per line")
    sub.add_parser("prefix", parents=[common, chunked],
                   help="how many leading chunk keys are stored").set_defaults(fn=cmd_prefix)
    p = sub.add_parser("put-chunks", parents=[common, chunked],
                       help="store a cache as one cache per chunk of tokens")
    p.add_argument("--chunk-tokens", type=int, required=True, help="tokens per chunk")
    p.add_argument("--first", type=int, default=0, help="skip chunks before this one")
    _array_args(p)
    p.add_argument("--policy", help="comma-separated Policy fields (default: the tenant's)")
    p.set_defaults(fn=cmd_put_chunks)
    p = sub.add_parser("get-chunks", parents=[common, chunked],
                       help="fetch the leading chunks stored, one request per daemon")
    p.add_argument("--npz", help="write the run's keys and values (chunks that kept every token)")
    p.add_argument("--decoded", action="store_true", help="ask the daemons to decode the codecs")
    p.set_defaults(fn=cmd_get_chunks)

    p = sub.add_parser("loadgen", parents=[common],
                       help="put (and get) random caches and report throughput")
    p.add_argument("-m", "--model", default="loadgen-model", help="model id (default %(default)s)")
    p.add_argument("--requests", type=int, default=20, help="caches to put (default 20)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight (default 2)")
    p.add_argument("--layers", type=int, default=4, help="layers per cache (default 4)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per cache (default 1024)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--policy", help="comma-separated Policy fields (default: the tenant's)")
    p.add_argument("--get", action="store_true", help="also fetch each cache")
    p.add_argument("--keep", action="store_true", help="do not delete the caches")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(fn=cmd_loadgen)
    return ap


def _array_args(p) -> None:
    p.add_argument("--keys", help=".npy of keys [layers, kv_heads, tokens, head_dim]")
    p.add_argument("--values", help=".npy of values, the same shape")
    p.add_argument("--safetensors", help="a .safetensors file instead of --keys/--values")
    p.add_argument("--q-heads", type=int, default=None,
                   help="query heads (GQA; default: as many as KV heads)")


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (KeyError, ValueError, PermissionError, ConnectionError, TimeoutError, MemoryError,
            RuntimeError, NotImplementedError, FileNotFoundError) as e:
        print(f"kvcomp {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1

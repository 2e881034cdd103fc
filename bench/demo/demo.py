"""`make demo`: kvcompd on its embedded defaults, a prefill client pushing a Llama-3.1-8B-shaped
cache block by block, a decode client fetching it and measuring attention with and without the
moment correction, then a clean stop.

Usage: python3 bench/demo/demo.py KVCOMPD [--tokens N] [--block B] [--ratio R]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "bench", "quality"))

import kvcomp  # noqa: E402
from generator import GeneratorParams, generate_layer  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
LAYERS, KV_HEADS, Q_PER_KV, HEAD_DIM = 32, 8, 4, 128


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvcompd exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("kvcompd did not become ready")


def metrics(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def full_attention(q, k, v):
    """Exact attention in float64: q [Hq, n, d], k/v [Hk, N, d] -> [Hq, n, d]."""
    g = q.shape[0] // k.shape[0]
    out = np.empty(q.shape, np.float64)
    t = 1.0 / np.sqrt(q.shape[-1])
    for h in range(q.shape[0]):
        kk, vv = k[h // g].astype(np.float64), v[h // g].astype(np.float64)
        logits = t * q[h].astype(np.float64) @ kk.T
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        out[h] = p @ vv
    return out


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kvcompd")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--ratio", type=float, default=0.5)
    args = ap.parse_args()

    data = tempfile.mkdtemp(prefix="kvcomp-demo-")
    log = open(os.path.join(data, "kvcompd.log"), "w")
    # Embedded defaults: no configuration file and no flags (CPU backend on a machine without a
    # GPU, host tier + RocksDB under ./.kvcomp-data, ports 7470/7471/7472 on 127.0.0.1). Run in a
    # scratch directory so the demo leaves nothing behind.
    proc = subprocess.Popen([os.path.abspath(args.kvcompd)], cwd=data, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_ready(7472, proc)
        return run(args)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
                print(f"\nkvcompd stopped cleanly (SIGTERM, exit code {code}); "
                      f"log: {log.name}")
            except subprocess.TimeoutExpired:
                proc.kill()
                print("kvcompd did not stop within 30 s; killed")


def run(args) -> int:
    p = GeneratorParams(head_dim=HEAD_DIM, num_kv_heads=KV_HEADS, q_per_kv=Q_PER_KV)
    n = args.tokens
    print(f"kvcomp demo: {MODEL}-shaped cache, {LAYERS} layers x {KV_HEADS} kv heads x "
          f"{n} tokens x head_dim {HEAD_DIM}, bf16; policy manifold ratio {args.ratio} + moments")

    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count()) as pool:
        layers = list(pool.map(generate_layer, [p] * LAYERS, [n] * LAYERS,
                               [1000 + i for i in range(LAYERS)]))
    t_gen = time.perf_counter() - t0

    # bf16 as the serving engine holds it (raw bits in uint16), and the float values it means.
    def bf16(x):
        u = x.astype(np.float32).view(np.uint32)
        u = u + 0x7FFF + ((u >> 16) & 1)
        return (u >> 16).astype(np.uint16)

    keys16 = [bf16(l.keys) for l in layers]
    vals16 = [bf16(l.values) for l in layers]

    policy = kvcomp.Policy(scorer="manifold", ratio=args.ratio, moments=True)
    prefill = kvcomp.Client("127.0.0.1:7470,127.0.0.1:7471")
    t0 = time.perf_counter()
    with prefill.put_stream(MODEL, "demo-request-1", layers=LAYERS, kv_heads=KV_HEADS,
                            q_heads=KV_HEADS * Q_PER_KV, head_dim=HEAD_DIM, tokens=n,
                            dtype="bf16", policy=policy) as s:
        for b0 in range(0, n, args.block):
            b1 = min(n, b0 + args.block)
            for i in range(LAYERS):
                s.append(i, np.ascontiguousarray(keys16[i][:, b0:b1]),
                         np.ascontiguousarray(vals16[i][:, b0:b1]), token_begin=b0)
    put = s.result
    t_put = time.perf_counter() - t0

    decode = kvcomp.Client("127.0.0.1:7470,127.0.0.1:7471")
    t0 = time.perf_counter()
    cache = decode.get(MODEL, "demo-request-1")
    t_get = time.perf_counter() - t0
    look = decode.lookup(MODEL, "demo-request-1")

    t0 = time.perf_counter()
    errs = {"retrieval": ([], []), "generic": ([], [])}
    for i in range(0, LAYERS, 4):
        l = layers[i]
        kf = (keys16[i].astype(np.uint32) << 16).view(np.float32)
        vf = (vals16[i].astype(np.uint32) << 16).view(np.float32)
        want = full_attention(l.queries, kf, vf)
        with_m = kvcomp.attention(l.queries, cache, i, correct=True)
        without = kvcomp.attention(l.queries, cache, i, correct=False)
        for kind in ("retrieval", "generic"):
            idx = [j for j, k in enumerate(l.kinds) if k == kind]
            errs[kind][0].append(rel_err(with_m[:, idx], want[:, idx]))
            errs[kind][1].append(rel_err(without[:, idx], want[:, idx]))
    t_att = time.perf_counter() - t0
    m = metrics(7472)

    def stage(name):
        return m.get(f'kvcomp_stage_duration_seconds_sum{{stage="{name}"}}', float("nan"))

    orig, stored = put["original_bytes"], put["stored_bytes"]
    print()
    print(f"{'':34}{'value':>16}")
    print(f"{'original bytes (K+V, bf16)':34}{orig:>16,}")
    print(f"{'stored bytes (compressed)':34}{stored:>16,}")
    print(f"{'ratio original/stored':34}{orig / stored:>15.2f}x")
    print(f"{'memory saved':34}{orig - stored:>16,}")
    print(f"{'kept tokens (all heads)':34}{put['total_kept']:>16,}")
    print(f"{'tier':34}{look['tier']:>16}")
    print()
    print(f"{'attention-output relative error':34}{'with moments':>14}{'without':>12}")
    for kind in ("retrieval", "generic"):
        a, b = errs[kind]
        print(f"{'  ' + kind + ' queries (mean)':34}{np.mean(a):>14.4f}{np.mean(b):>12.4f}")
    print()
    print(f"{'stage':34}{'seconds':>16}")
    print(f"{'generate (client)':34}{t_gen:>16.3f}")
    print(f"{'push, block by block (client)':34}{t_put:>16.3f}")
    print(f"{'  daemon: receive':34}{stage('receive'):>16.3f}")
    print(f"{'  daemon: compress':34}{stage('compress'):>16.3f}")
    print(f"{'  daemon: store':34}{stage('store'):>16.3f}")
    print(f"{'fetch (client)':34}{t_get:>16.3f}")
    print(f"{'  daemon: serve':34}{stage('serve'):>16.3f}")
    print(f"{'decode attention, 8 layers':34}{t_att:>16.3f}")
    decode.delete(MODEL, "demo-request-1")
    return 0


if __name__ == "__main__":
    sys.exit(main())

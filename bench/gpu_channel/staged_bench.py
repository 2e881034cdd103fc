"""The SDK's device calls without a GPU channel: a kvcompd with `--data_plane.gpu_channel=false`
on GPU 0 and a UCX without CUDA memory, so put_device / get_into / get_bytes_into go over the
data plane's `ucx` link, which stages the caller's device memory through pinned host memory of
its own, block by block (docs/protocol.md, "CUDA-aware UCX"). Measured beside, in the same run,
the same bytes by hand through host memory: one copy of K and V into pinned host tensors and a
host put; a get of the stored bytes and one copy up. The cache is Llama-3.1-8B shaped (32
layers, 8 kv heads, head_dim 128, bf16; --tokens, default 8192: 1 GiB of K and V), lossless.
Times are whole calls, the caller's stream waited for.

    python3 bench/gpu_channel/staged_bench.py --kvcompd PATH [--tokens N] [--reps N]
Prints RESULT lines."""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "integration"))
import kvcomp  # noqa: E402
from kvcompd_fixture import Kvcompd  # noqa: E402


def report(name, nbytes, secs):
    best, med = min(secs), statistics.median(secs)
    print(f"RESULT staged_ucx {name:<36} best {nbytes / best / 1e9:7.2f} GB/s  "
          f"median {nbytes / med / 1e9:7.2f} GB/s  ({len(secs)} runs, {best:.4f} s best)",
          flush=True)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvcompd", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    layers, kv, d = 32, 8, 128
    k = torch.randn((layers, kv, a.tokens, d), device="cuda:0").to(torch.bfloat16)
    v = torch.randn((layers, kv, a.tokens, d), device="cuda:0").to(torch.bfloat16)
    nbytes = 2 * k.numel() * k.element_size()
    print(f"# {a.tokens} tokens, {nbytes / 2**30:.2f} GiB of K and V on "
          f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    flags = ["--engine.backend=cuda", "--engine.cuda_device=0", "--engine.cpu_threads=0",
             "--storage.durability=memory", "--storage.rocksdb_enabled=false",
             "--storage.put_tier=device", "--storage.device_capacity_bytes=24Gi",
             "--storage.host_capacity_bytes=64Gi", "--data_plane.max_buffered_bytes=16Gi",
             "--data_plane.max_put_bytes=16Gi", "--data_plane.gpu_channel=false"]
    with Kvcompd(a.kvcompd, flags=flags) as dmn:
        c = kvcomp.Client(f"{dmn.data_endpoint},127.0.0.1:{dmn.control_port}", timeout=300.0)
        lossless = kvcomp.Policy(ratio=0.0, moments=False)
        # Pinned host tensors, as the SDK's own staging through host memory used before the
        # ucx link staged device memory itself.
        hk = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
        hv = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
        put, get, raw, hput, hget = [], [], [], [], []
        paths = set()
        stored = 0
        for r in range(a.reps + 1):
            key = f"staged-{r}"
            t, res = timed(lambda: c.put_device("llama-8b", key, k, v, policy=lossless))
            paths.add(("put", res["path"]))
            stored = int(res["stored_bytes"])
            k2.zero_()
            v2.zero_()
            tg, g = timed(lambda: c.get_into("llama-8b", key, k2, v2))
            paths.add(("get_into", g["path"]))
            out = torch.empty(stored + 4096, dtype=torch.uint8, device="cuda:0")
            tb, b = timed(lambda: c.get_bytes_into("llama-8b", key, out))
            paths.add(("get_bytes_into", b["path"]))
            # The same bytes by hand through host memory.
            hkey = f"host-{r}"

            def host_put():
                hk.copy_(k)
                hv.copy_(v)
                return c.put("llama-8b", hkey, hk, hv, policy=lossless)

            th, _ = timed(host_put)

            def host_get():
                data = c.get_bytes("llama-8b", hkey)
                return out[: len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))

            thg, _ = timed(host_get)
            if r > 0:
                put.append(t)
                get.append(tg)
                raw.append(tb)
                hput.append(th)
                hget.append(thg)
            c.delete("llama-8b", key)
            c.delete("llama-8b", hkey)
        same = torch.equal(k2, k) and torch.equal(v2, v)
        print(f"# paths {sorted(paths)}; dense round trip "
              f"{'bit-identical' if same else 'DIFFERS'}; stored {stored} bytes; "
              f"{c.gpu_stats()}", flush=True)
        report("put_device (staged, whole)", nbytes, put)
        report("put by hand (copy to host + put)", nbytes, hput)
        report("get_into (staged, dense)", nbytes, get)
        report("get_bytes_into (staged, stored)", stored, raw)
        report("get by hand (get_bytes + copy up)", stored, hget)


if __name__ == "__main__":
    main()

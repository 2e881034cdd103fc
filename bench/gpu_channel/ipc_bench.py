"""One GPU: a put from torch CUDA tensors into a kvcompd on the same GPU (the GPU channel in CUDA
IPC mode: the daemon maps the tensors' memory and copies on the device) against a device-to-
device copy of the same tensors on that GPU, measured in the same run. The cache is Llama-3.1-8B
shaped (32 layers, 8 kv heads, head_dim 128, bf16; --tokens, default 32768: 4 GiB of K and V).
"transfer" is the daemon's copy out of the caller's memory as its stream timed it; "put" and
"get" are the whole calls (with a lossless policy: the CUDA engine's pass and the store).

    python3 bench/gpu_channel/ipc_bench.py --kvcompd PATH [--tokens N] [--reps N]
        [--backend cuda|cpu] [--tier device|host]
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
    print(f"RESULT gpu_channel_ipc {name:<30} best {nbytes / best / 1e9:8.2f} GB/s  "
          f"median {nbytes / med / 1e9:8.2f} GB/s  ({len(secs)} runs, {best:.4f} s best)",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvcompd", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tier", default="device")
    a = ap.parse_args()
    layers, kv, d = 32, 8, 128
    k = torch.randn((layers, kv, a.tokens, d), device="cuda:0").to(torch.bfloat16)
    v = torch.randn((layers, kv, a.tokens, d), device="cuda:0").to(torch.bfloat16)
    nbytes = 2 * k.numel() * k.element_size()
    print(f"# {a.tokens} tokens, {nbytes / 2**30:.2f} GiB of K and V on "
          f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)

    # The reference: a device-to-device copy of the same tensors on the same GPU.
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    ref = []
    for r in range(a.reps + 1):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        k2.copy_(k)
        v2.copy_(v)
        e.record()
        e.synchronize()
        if r > 0:
            ref.append(s.elapsed_time(e) / 1e3)
    report("device-to-device copy", nbytes, ref)

    flags = ["--engine.backend=" + a.backend, "--engine.cuda_device=0", "--engine.cpu_threads=0",
             "--storage.durability=memory", "--storage.rocksdb_enabled=false",
             "--storage.put_tier=" + a.tier, "--storage.device_capacity_bytes=24Gi",
             "--storage.host_capacity_bytes=64Gi", "--data_plane.max_buffered_bytes=16Gi",
             "--data_plane.max_put_bytes=16Gi", "--data_plane.gpu_transfer_timeout_seconds=120"]
    with Kvcompd(a.kvcompd, flags=flags, env={"NCCL_NVLS_ENABLE": "0"}) as dmn:
        c = kvcomp.Client(f"{dmn.data_endpoint},127.0.0.1:{dmn.control_port}", timeout=300.0)
        lossless = kvcomp.Policy(ratio=0.0, moments=False)
        xfer, put, get, gxfer = [], [], [], []
        path = gpath = ""
        for r in range(a.reps + 1):
            key = f"ipc-{r}"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = c.put_device("llama-8b", key, k, v, policy=lossless)
            t1 = time.perf_counter()
            k2.zero_()
            v2.zero_()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            g = c.get_into("llama-8b", key, k2, v2)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            path, gpath = res["path"], g["path"]
            if r > 0:
                xfer.append(res["transfer_seconds"])
                put.append(t1 - t0)
                get.append(t3 - t2)
                gxfer.append(g.get("transfer_seconds", 0.0))
            c.delete("llama-8b", key)
        same = torch.equal(k2, k) and torch.equal(v2, v)
        print(f"# put path {path}, get path {gpath}, round trip "
              f"{'bit-identical' if same else 'DIFFERS'}; {c.gpu_stats()}", flush=True)
        if min(xfer) > 0:
            report("ipc put transfer (daemon copy)", nbytes, xfer)
        report("ipc put (lossless, whole)", nbytes, put)
        if min(gxfer) > 0:
            report("ipc get transfer (daemon copy)", nbytes, gxfer)
        report("ipc get (dense, whole)", nbytes, get)
        if min(xfer) > 0:
            print(f"RESULT gpu_channel_ipc put transfer / device-to-device copy = "
                  f"{100 * min(ref) / min(xfer):.0f}%; whole put = {100 * min(ref) / min(put):.0f}%",
                  flush=True)
        eng = [ln for ln in dmn.log().splitlines() if "engine" in ln][:2]
        print("# kvcompd: " + " | ".join(eng), flush=True)


if __name__ == "__main__":
    main()

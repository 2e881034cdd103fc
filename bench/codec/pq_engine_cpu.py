"""The calibrated basis codec through the engine on a CPU (kvcomp.compress / decompress with the
`codec` preset, pq k3v2) beside the Hadamard pair (hq4 / hq3) and the lossless preset: seconds
(median of 3), rows per second, stored bytes against bf16 and the relative error, on synthetic
rows with a steep spectrum (one random mixing per tensor, deviations falling 0.95 a component).

    PYTHONPATH=client/python python3 bench/codec/pq_engine_cpu.py [--tokens 4096]
"""

import argparse
import os
import time

import numpy as np

import kvcomp


def model(layers, heads, tokens, d, seed):
    mix = np.random.default_rng(0).standard_normal((d, d)).astype(np.float32) / np.sqrt(d)
    decay = (0.95 ** np.arange(d)).astype(np.float32)
    r = np.random.default_rng(seed)
    k = (r.standard_normal((layers, heads, tokens, d)).astype(np.float32) * decay) @ mix
    v = (r.standard_normal((layers, heads, tokens, d)).astype(np.float32) * decay) @ mix.T
    return k.astype(np.float32), v.astype(np.float32)


def median_seconds(f, n=3):
    times, out = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        out = f()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2], out


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calibration-tokens", type=int, default=2048)
    a = ap.parse_args()
    L, H, T, d = a.layers, a.kv_heads, a.tokens, a.head_dim
    t0 = time.perf_counter()
    cal = kvcomp.calibrate_pq(*model(L, H, a.calibration_tokens, d, 1))
    t_cal = time.perf_counter() - t0
    k, v = model(L, H, T, d, 2)
    pq = kvcomp.preset("codec")
    hq = kvcomp.preset("codec", key_codec="hq4", value_codec="hq3")
    t_raw, _ = median_seconds(lambda: kvcomp.compress(k, v, kvcomp.preset("lossless")))
    t_hq, c_hq = median_seconds(lambda: kvcomp.compress(k, v, hq))
    t_pq, c_pq = median_seconds(lambda: kvcomp.compress(k, v, pq, pq=cal))
    t_dhq, (hk, hv) = median_seconds(lambda: kvcomp.decompress(c_hq))
    t_dpq, (pk, pv) = median_seconds(lambda: kvcomp.decompress(c_pq, pq=cal))
    rows = 2 * L * H * T  # key rows and value rows
    bf16 = 2 * k.size * 2
    print(f"shape {L} layers x {H} kv heads x {T} tokens x {d}, f32 input; {os.cpu_count()} CPUs")
    print(f"calibrate_pq ({a.calibration_tokens} rows per head, keys and values): {t_cal:.2f} s")
    print("| codecs | compress s | encode Mrows/s | decompress s | decode Mrows/s | x of bf16 "
          "(stored) | rel. error keys / values |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| lossless | {t_raw:.3f} | | | | | |")
    for name, t_c, t_d, c, dk, dv in (("hq4 / hq3", t_hq, t_dhq, c_hq, hk, hv),
                                      ("pq k3v2 (`codec`)", t_pq, t_dpq, c_pq, pk, pv)):
        enc = rows / max(t_c - t_raw, 1e-9) / 1e6
        print(f"| {name} | {t_c:.3f} | {enc:.3f} | {t_d:.3f} | {rows / t_d / 1e6:.3f} | "
              f"{bf16 / c.nbytes:.2f} | {rel(dk, k):.4f} / {rel(dv, v):.4f} |")


if __name__ == "__main__":
    main()

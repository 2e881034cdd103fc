"""KVSplice quality table: bytes per token and reconstruction / attention-output error of every
value preset at ranks 32..128, on the quality harness's synthetic caches (bench/quality/
generator.py), calibrated on the first half of each sequence and measured on the second half
(held-out tokens of the same heads).

    PYTHONPATH=client/python python3 bench/codec/quality_table.py [--tokens 8192] [--layers 2]
        [--out bench/results/kvsplice_quality-<date>.md]

Errors are relative Frobenius norms over all (layer, kv head): value reconstruction
||V' - V|| / ||V||, attention output ||A V' - A V|| / ||A V|| with the generator's decode
queries (generic and retrieval, GQA) and A the exact softmax over the held-out keys.
bytes/token: per (layer, kv head) and kept token, the value part (latent + f16 group scales);
'V ratio' is bf16 values (2 * head_dim bytes) over it. Keys stay raw here (key codecs: see
docs/kvsplice.md).
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench", "quality"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import generator  # noqa: E402
import kvcomp  # noqa: E402


def attention_out(q, k, v):
    """q [Hq, nq, d], k/v [Hk, n, d] -> [Hq, nq, d], exact softmax, GQA."""
    hq, hk = q.shape[0], k.shape[0]
    g = hq // hk
    out = np.empty((hq, q.shape[1], v.shape[2]), np.float64)
    for h in range(hq):
        s = q[h].astype(np.float64) @ k[h // g].T.astype(np.float64) / np.sqrt(q.shape[2])
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[h] = p @ v[h // g].astype(np.float64)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--value-dim", type=int, nargs="+", default=[16, 48])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    d = 128
    ranks = [32, 48, 64, 96, 128]
    rows = []
    for value_dim in args.value_dim:
        params = generator.GeneratorParams(head_dim=d, value_dim=value_dim)
        layers = [generator.generate_layer(params, args.tokens, seed=100 + l)
                  for l in range(args.layers)]
        half = args.tokens // 2
        k = np.stack([L.keys for L in layers])        # [L, Hk, N, d]
        v = np.stack([L.values for L in layers])
        proj = kvcomp.calibrate(v[:, :, :half], model_id=f"synthetic-v{value_dim}",
                                max_samples=2048)
        k_eval, v_eval = np.ascontiguousarray(k[:, :, half:]), np.ascontiguousarray(v[:, :, half:])
        ref_att = [attention_out(L.queries, k_eval[i], v_eval[i]) for i, L in enumerate(layers)]
        configs = [("none", 0, True)]
        for codec in ("orthogonal", "orthogonal_int8", "orthogonal_int4"):
            for r in ranks:
                configs.append((codec, r, True))
                if codec != "orthogonal":
                    configs.append((codec, r, False))
        for codec, r, gamma in configs:
            policy = kvcomp.Policy(ratio=0.0, value_codec=codec, rank=r, gamma_aware=gamma,
                                   moments=False)
            cache = kvcomp.compress(k_eval, v_eval, policy, projection=proj)
            info = kvcomp.cache_codecs(cache)
            _, vv = kvcomp.decompress(cache, proj if codec != "none" else None)
            kept = vv.shape[2]
            # The scorer keeps everything at ratio 0, in position order.
            rec = float(np.linalg.norm(vv - v_eval) / np.linalg.norm(v_eval))
            num = den = 0.0
            for i, L in enumerate(layers):
                a = attention_out(L.queries, k_eval[i], vv[i])
                num += float(np.sum((a - ref_att[i]) ** 2))
                den += float(np.sum(ref_att[i] ** 2))
            att = (num / den) ** 0.5
            tokens_total = kept * args.layers * params.num_kv_heads
            vbytes = (info["bytes"]["values"] + info["bytes"]["value_scales"]) / tokens_total
            rows.append(dict(value_dim=value_dim, codec=codec, rank=r if codec != "none" else d,
                             gamma=("on" if gamma else "off") if codec not in ("none", "orthogonal")
                             else "-", vbytes=vbytes, vratio=2 * d / vbytes, rec=rec, att=att))
            print(rows[-1], flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    now = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# KVSplice quality: bytes per token and error per preset and rank",
        "",
        f"- date: {now}; commit: {commit}; machine: {platform.node()} ({os.cpu_count()} cores), "
        "CPU backend (the CUDA backend decodes the same latents to within 2e-3, "
        "tests/kernels/codec_cuda_test.cc)",
        f"- data: bench/quality/generator.py, head_dim {d}, {args.layers} layers x 2 kv heads "
        f"(4 q heads), {args.tokens} tokens per sequence: calibrated on the first "
        f"{args.tokens // 2}, measured on the last {args.tokens // 2} (held out); values of "
        "value_dim 16 (the generator's default) and 48, value_noise 0.2",
        "- bytes/token: value latent + f16 scales per (layer, kv head) token (group 32); "
        "V ratio = bf16 values (256 B) / that. The inputs are f32, so `none` keeps 512 B. "
        "Keys raw in every row.",
        "- errors: relative Frobenius, value reconstruction and attention output over the "
        "generator's decode queries (generic + retrieval)",
        "- command: `PYTHONPATH=client/python python3 bench/codec/quality_table.py`",
        "",
        "| value_dim | preset | rank | gamma | V bytes/token | V ratio | value rel. error | "
        "attention rel. error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['value_dim']} | {r['codec']} | {r['rank']} | {r['gamma']} | "
                     f"{r['vbytes']:.1f} | {r['vratio']:.2f}x | {r['rec']:.4f} | {r['att']:.4f} |")
    text = "\n".join(lines) + "\n"
    out = args.out or os.path.join(
        ROOT, "bench", "results",
        f"kvsplice_quality-{datetime.datetime.utcnow().strftime('%Y%m%d-%H%M')}.md")
    with open(out, "w") as f:
        f.write(text)
    print(text)
    print("wrote", out)


if __name__ == "__main__":
    main()

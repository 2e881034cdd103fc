"""How close zstd gets to the order-0 entropy of the Hadamard codec's codes (codecs_ref.py), on
one real cache of the code model (CPU).

    python3 bench/quality/codec_zstd.py --corpus corpus.tar.xz [--ctx 4096] --out PREFIX.md

Prefills one held-out code window, quantizes keys and values with hq{b} (codes one per byte, in
layer, head, token, channel order), compresses the code bytes with the zstd command line (-19,
and --ultra -22 with long matching) and with xz -9 for reference, and prints bits per value of
each beside the order-0 entropy and the plain b-bit packing. Scales and minima are not included
(2 fp16 per 128 values in every case).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "lm"))
import codecs_ref  # noqa: E402
import corpus as corpus_mod  # noqa: E402
import suite  # noqa: E402


def codes(spec, X):
    L, H, N, d = X.shape
    b = int(spec[2:])
    R = X @ codecs_ref.hadamard(d, X.device).T
    _, q, _ = codecs_ref._asym(R, b, d)
    return q.to(torch.uint8).cpu().numpy()


def squeeze(data: bytes, cmd):
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        out = subprocess.run(cmd + ["-c", f.name], capture_output=True, check=True).stdout
    return len(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(HERE, "lm", "model"))
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    parts = corpus_mod.load(args.corpus)
    code = np.frombuffer(parts["held_code.bin"], np.uint8)
    w = torch.from_numpy(code[len(code) // 2: len(code) // 2 + args.ctx].astype(np.int64))
    K, V, _ = suite.prefill(model, w)
    zv = subprocess.run(["zstd", "--version"], capture_output=True, text=True).stdout.strip()
    rows = []
    for spec in ("hq4", "hq3", "hq2"):
        for name, X in (("keys", K), ("values", V)):
            q = codes(spec, X)
            raw = q.tobytes()
            n = q.size
            ent = codecs_ref._entropy_bits(torch.from_numpy(q.astype(np.int64))) / n
            z19 = squeeze(raw, ["zstd", "-19", "-q"]) * 8 / n
            z22 = squeeze(raw, ["zstd", "--ultra", "-22", "--long=27", "-q"]) * 8 / n
            xz = squeeze(raw, ["xz", "-9"]) * 8 / n
            rows.append((spec, name, int(spec[2:]), ent, z19, z22, xz))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                            capture_output=True).stdout.strip()
    lines = [f"# zstd on the Hadamard codec's codes ({os.path.relpath(args.model, HERE)})", "",
             f"date {stamp}, commit {commit}, CPU ({os.uname().machine}), {zv}; one held-out "
             f"code window of {args.ctx} bytes; bits per value (codes only; the fp16 scale and "
             f"minimum add 0.25 bits per value in every column).", "",
             "| codec | tensor | packed | order-0 entropy | zstd -19 | zstd --ultra -22 --long "
             "| xz -9 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for spec, name, b, ent, z19, z22, xz in rows:
        lines.append(f"| {spec} | {name} | {b:.2f} | {ent:.2f} | {z19:.2f} | {z22:.2f} | "
                     f"{xz:.2f} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

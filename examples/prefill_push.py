"""Prefill side: push one sequence's KV cache to kvcompd layer by layer, as a serving engine
does while prefill produces it.

    python3 examples/prefill_push.py --endpoint 127.0.0.1:7470 --key req-1 [--tokens 2048]

The cache here is random bf16 data shaped like a small Llama layer stack; a serving engine
passes its own [kv_heads, tokens, head_dim] tensors (numpy, or torch on the host) instead.

kvcomp is the installed package (pip install ., docs/integrations.md); from a source build,
PYTHONPATH=client/python.
"""

import argparse
import json
import sys

import numpy as np

import kvcomp


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="127.0.0.1:7470")
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--key", default="req-1")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.5)
    args = ap.parse_args()

    kv_heads, q_heads, head_dim = 8, 32, 128
    rng = np.random.default_rng(0)
    client = kvcomp.Client(args.endpoint)
    policy = kvcomp.Policy(scorer="keydiff", ratio=args.ratio, moments=True)
    with client.put_stream(args.model, args.key, layers=args.layers, kv_heads=kv_heads,
                           q_heads=q_heads, head_dim=head_dim, tokens=args.tokens,
                           dtype="f16", policy=policy) as stream:
        for layer in range(args.layers):  # as each layer's prefill finishes
            k = rng.standard_normal((kv_heads, args.tokens, head_dim)).astype(np.float16)
            v = rng.standard_normal((kv_heads, args.tokens, head_dim)).astype(np.float16)
            stream.append(layer, k, v)
    r = stream.result
    print(json.dumps({"key": args.key, "original_bytes": r["original_bytes"],
                      "stored_bytes": r["stored_bytes"], "total_kept": r["total_kept"],
                      "ratio": round(r["original_bytes"] / r["stored_bytes"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

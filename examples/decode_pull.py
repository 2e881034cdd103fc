"""Decode side: fetch a compressed cache from kvcompd and run one decode step's attention over
it, with the MomentKV correction for the evicted tokens.

    python3 examples/decode_pull.py --endpoint 127.0.0.1:7470 --key req-1
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client",
                                "python"))
import kvcomp  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="127.0.0.1:7470")
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--key", default="req-1")
    args = ap.parse_args()

    client = kvcomp.Client(args.endpoint)
    info = client.lookup(args.model, args.key)
    cache = client.get(args.model, args.key)
    q_heads = info["q_heads"]
    q = np.random.default_rng(1).standard_normal((q_heads, 1, cache.head_dim)).astype(np.float32)
    out = kvcomp.attention(q, cache, 0, correct=True)          # [q_heads, 1, head_dim]
    plain = kvcomp.attention(q, cache, 0, correct=False)
    print(json.dumps({
        "key": args.key, "tier": info["tier"], "stored_bytes": cache.nbytes,
        "original_bytes": cache.original_nbytes,
        "kept_layer0_head0": int(len(cache.kept_positions(0, 0))),
        "attention_shape": list(out.shape),
        "correction_changed_output": float(np.abs(out - plain).max())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode side: fetch a compressed cache from kvcompd and run one decode step's attention over
it, with the MomentKV correction for the evicted tokens.

    python3 examples/decode_pull.py --endpoint 127.0.0.1:7470 --key req-1

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

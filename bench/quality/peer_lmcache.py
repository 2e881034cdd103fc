"""LMCache's own fp8 serde (the lmcache package's Fp8QuantizationSerializer / Deserializer, run
on CPU) on a real cache of the code model, against the suite's fp8 reference
(codecs_ref.encode("fp8")): whether the suite's "fp8 (LMCache fp8)" row is LMCache's serde.

    python3 bench/quality/peer_lmcache.py --corpus corpus.tar.xz [--tokens 1024] --out PREFIX

Runs where lmcache is installed (scripts/test_engine.sh lmcache makes such a virtualenv).
Writes PREFIX.md: bytes, whether the decoded K and V are bit-identical, the largest difference.
"""

import argparse
import datetime
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import codecs_ref  # noqa: E402
import corpus as corpus_mod  # noqa: E402


def memobj(t):
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
    raw = torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)
    meta = MemoryObjMetadata(shape=t.shape, dtype=t.dtype, address=0, phy_size=raw.numel(),
                             ref_count=1, fmt=MemoryFormat.KV_2LTD, shapes=[t.shape],
                             dtypes=[t.dtype])
    obj = TensorMemoryObj(raw, meta, None)
    obj.tensor.copy_(t)
    return obj


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import lmcache
    from importlib.metadata import version
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.serde.fp8 import (Fp8QuantizationDeserializer,
                                                  Fp8QuantizationSerializer)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.join(HERE, "lm", "model"),
                                                 dtype=torch.float32).eval()
    en = np.frombuffer(corpus_mod.load(args.corpus)["held_en.bin"], np.uint8)
    ids = torch.from_numpy(en[:args.tokens].astype(np.int64))[None]
    with torch.no_grad():
        pkv = model(ids, use_cache=True).past_key_values
    K = torch.stack([pkv.layers[l].keys[0] for l in range(len(pkv.layers))]).bfloat16()
    V = torch.stack([pkv.layers[l].values[0] for l in range(len(pkv.layers))]).bfloat16()
    L, H, N, d = K.shape
    # LMCache's KV_2LTD chunk: [2, layers, tokens, heads x head_dim]
    kv = torch.stack([K.permute(0, 2, 1, 3).reshape(L, N, H * d),
                      V.permute(0, 2, 1, 3).reshape(L, N, H * d)]).contiguous()
    src = memobj(kv)
    buf = memobj(torch.zeros(kv.numel(), dtype=torch.uint8))
    key = ObjectKey(chunk_hash=b"h" * 32, model_name="kvcomp/code", kv_rank=0)
    stored = Fp8QuantizationSerializer().serialize(src, buf, key)
    out = memobj(torch.zeros_like(kv))
    Fp8QuantizationDeserializer().deserialize(buf, out, key)
    got = out.tensor.reshape(2, L, N, H, d).permute(0, 1, 3, 2, 4).float()
    rows = []
    for i, (name, X) in enumerate((("keys", K), ("values", V))):
        ref, nbytes, _ = codecs_ref.encode("fp8", X.float(), i == 0)
        diff = float((got[i] - ref).abs().max())
        rows.append(f"| {name} | {int(nbytes)} | {stored // 2} | "
                    f"{'yes' if torch.equal(got[i], ref) else 'no'} | {diff:g} |")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "# LMCache's fp8 serde against the suite's fp8 reference", "",
        f"{date}; lmcache {version('lmcache')} ({os.path.dirname(lmcache.__file__)}), torch "
        f"{torch.__version__}, CPU; the code model's cache of the first {N} bytes of the held-out "
        f"English ({L} layers x {H} kv heads x {d}, bf16), as LMCache's KV_2LTD chunk through "
        "Fp8QuantizationSerializer.serialize and Fp8QuantizationDeserializer.deserialize.", "",
        "| part | bytes, suite's fp8 | bytes, LMCache (half of the chunk's) | decoded bit-identical | "
        "largest difference |", "| --- | --- | --- | --- | --- |", *rows, ""])
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()

"""LMCache's own fp8 serde (the lmcache package's Fp8QuantizationSerializer / Deserializer, run
on CPU) on a real cache of the code model, against the suite's fp8 reference
(codecs_ref.encode("fp8")): whether the suite's "fp8 (LMCache fp8)" row is LMCache's serde.

    python3 bench/quality/peer_lmcache.py --corpus corpus.tar.xz [--tokens 1024] --out PREFIX

Runs where lmcache is installed (scripts/test_engine.sh lmcache makes such a virtualenv).

    python3 bench/quality/peer_lmcache.py --corpus corpus.tar.xz --asym-k16-v8 code57=DIR \
        g16=DIR d8=DIR [--windows 6 --ctx 1024 --tail 128] --out PREFIX

runs LMCache's AsymK16V8Codec on each model's cache instead: bytes, bit-identity of K, V against
fp8 with a per-tensor scale, and the loss with the decoded cache.
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
sys.path.insert(0, os.path.join(HERE, "lm"))
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


def asym_k16_v8(models, corpus, windows, ctx, tail, out):
    """LMCache's AsymK16V8Codec (lmcache.v1.kv_codec, pure torch) per layer of each model's cache:
    stored bytes, decoded K bit-identical, V against fp8 e4m3 with one f32 scale per tensor (the
    codec's default scope), and next-byte loss with the decoded cache (frontier.py's protocol)."""
    import frontier
    from importlib.metadata import version
    from lmcache.v1.kv_codec import AsymK16V8Codec
    from transformers import AutoModelForCausalLM
    codec = AsymK16V8Codec()
    parts = corpus_mod.load(corpus)
    en = np.frombuffer(parts["held_en.bin"], np.uint8)
    code = np.frombuffer(parts["held_code.bin"], np.uint8)
    N = ctx - tail
    rows = []
    for spec in models:
        name, path = spec.split("=", 1)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        model.set_attn_implementation("sdpa")
        full, dec, stored, orig, kid, vdiff = [], [], 0, 0, True, 0.0
        for j in range(windows):
            t = en if j % 2 == 0 else code
            s = int(j * (len(t) - ctx - 2) / 49)
            w = torch.from_numpy(t[s:s + ctx].astype(np.int64))
            K, V = frontier.prefill(model, w[:N - 1])
            Kd, Vd = torch.empty_like(K), torch.empty_like(V)
            for l in range(K.shape[0]):
                k = K[l].transpose(0, 1).bfloat16().contiguous()  # [tokens, heads, d]
                v = V[l].transpose(0, 1).bfloat16().contiguous()
                blob = codec.to_bytes(codec.encode(k, v))
                stored += len(blob)
                orig += 2 * (k.numel() + v.numel())
                kk, vv, _ = codec.decode(codec.from_bytes(blob), out_v_dtype=torch.bfloat16)
                kk, vv = kk.reshape(k.shape), vv.reshape(v.shape)
                kid = kid and torch.equal(kk, k)
                sc = v.float().abs().amax() / 448.0
                ref = ((v.float() / sc).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sc)
                vdiff = max(vdiff, float((vv.float() - ref.bfloat16().float()).abs().max()))
                Kd[l], Vd[l] = kk.float().transpose(0, 1), vv.float().transpose(0, 1)
            built = {"full": (K, V, None), "lmcache asym_k16_v8": (Kd, Vd, None)}
            ls = frontier.losses(model, built, list(built), N, w, 2)
            full.append(ls["full"])
            dec.append(ls["lmcache asym_k16_v8"])
        f, d = np.array(full), np.array(dec)
        diff = 100 * (d - f) / f.mean()
        h = 1.96 * diff.std(ddof=1) / np.sqrt(len(diff))
        rows.append(f"| {name} | {orig / stored:.3f} | {'yes' if kid else 'no'} | {vdiff:g} | "
                    f"{diff.mean():+.3f}% [{diff.mean() - h:+.3f}, {diff.mean() + h:+.3f}] | "
                    f"{len(diff)} |")
        print(rows[-1], flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "# LMCache's asym_k16_v8 codec on the three models' caches", "",
        f"{date}; lmcache {version('lmcache')}, torch {torch.__version__}, CPU; "
        f"commit {frontier.git_commit()}. Each layer's cache through "
        "lmcache.v1.kv_codec.AsymK16V8Codec (the codec behind LMCache's asym_k16_v8 serde; "
        "default scope: one f32 V scale per tensor) encode, to_bytes, from_bytes, decode; "
        f"windows of {ctx} held-out bytes, the first {ctx - tail} compressed, loss over the last "
        f"{tail} (bench/quality/frontier.py's protocol, bf16 model). x: bf16 bytes over the "
        "codec's bytes (header included). V check: largest difference from fp8 e4m3 with the "
        "scale amax/448 computed here.", "",
        "| model | x | K bit-identical | V vs fp8 e4m3 per-tensor scale | loss vs full [95%] | n |",
        "| --- | --- | --- | --- | --- | --- |", *rows, "",
        "LMCache's TurboQuant serde (lmcache.v1.distributed.serde.turboquant) and CacheGen "
        "(storage_backend.naive_serde.cachegen_*) were not run: their encoders are Triton and "
        "CUDA kernels (triton_turboquant_store; torchac_cuda), which need a GPU.", ""])
    with open(out + ".md", "w") as fh:
        fh.write(text)
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", required=True)
    ap.add_argument("--asym-k16-v8", nargs="*", metavar="NAME=DIR",
                    help="run LMCache's AsymK16V8Codec on these models' caches instead")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=128)
    args = ap.parse_args()
    if args.asym_k16_v8:
        torch.set_num_threads(1)
        return asym_k16_v8(args.asym_k16_v8, args.corpus, args.windows, args.ctx, args.tail,
                           args.out)
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

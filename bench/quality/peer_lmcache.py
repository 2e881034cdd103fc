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
import json
import os
import platform
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


# kvcomp's hq codecs through the engine-exact mirror; ENGINE: the widths the engine has (hq4,
# hq3); the others (5 and 2 bits) are frontier candidates the mirror computes.
ENGINE = ("kvhq k4v4", "kvhq k4v3", "kvhq k3v3")
KVCOMP_POINTS = {"kvhq k5v5": ("kvhq5", "kvhq5", None, 0.0),
                 "kvhq k5v4": ("kvhq5", "kvhq4", None, 0.0),
                 "kvhq k4v4": ("kvhq4", "kvhq4", None, 0.0),
                 "kvhq k4v3": ("kvhq4", "kvhq3", None, 0.0),
                 "kvhq k3v3": ("kvhq3", "kvhq3", None, 0.0),
                 "kvhq k3v2": ("kvhq3", "kvhq2", None, 0.0)}
# The calibrated basis codec (codecs_ref pca, the pq library's arithmetic up to f32 order; bases
# from --calib's training split), with --calib only.
PCA_POINTS = {"pca k5v5": ("pca5", "pca5", None, 0.0), "pca k5v4": ("pca5", "pca4", None, 0.0),
              "pca k4v4": ("pca4", "pca4", None, 0.0), "pca k4v3": ("pca4", "pca3", None, 0.0),
              "pca k3v2": ("pca3", "pca2", None, 0.0)}


def cachegen(models, corpus, windows, ctx, tail, out, calib=None):
    """LMCache's CacheGen serde (lmcache.v1.storage_backend.naive_serde: CacheGenSerializer /
    CacheGenDeserializer; per-token quantization to the bins of its CacheGenConfig, then its
    arithmetic coder, on CPU through lmcache's torch kernels) on each model's cache, beside
    kvcomp's hq codecs on the same windows: stored bytes, next-byte loss with the decoded cache
    (frontier.py's protocol), and kvcomp's loss at CacheGen's bytes (linear in bytes per token
    between kvcomp's neighbouring points; the lossless preset is the point 1x, +0%)."""
    import types
    import frontier
    from importlib.metadata import version
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
    from lmcache.v1.storage_backend.naive_serde.cachegen_decoder import CacheGenDeserializer
    from lmcache.v1.storage_backend.naive_serde.cachegen_encoder import CacheGenSerializer
    from transformers import AutoModelForCausalLM
    parts = corpus_mod.load(corpus)
    en = np.frombuffer(parts["held_en.bin"], np.uint8)
    code = np.frombuffer(parts["held_code.bin"], np.uint8)
    N = ctx - tail
    n_cache = N - 1  # tokens in the compressed cache (the prefill of w[:N - 1])
    rows, per_model = [], {}
    for spec in models:
        name, path = spec.split("=", 1)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.set_attn_implementation("sdpa")
        nl = model.config.num_hidden_layers
        hk = model.config.num_key_value_heads
        d = getattr(model.config, "head_dim", None) or model.config.hidden_size // \
            model.config.num_attention_heads
        meta = types.SimpleNamespace(model_name=path, kv_dtype=torch.bfloat16,
                                     kv_shape=(nl, 2, n_cache, hk, d))
        conf = types.SimpleNamespace(chunk_size=n_cache)
        ser, des = CacheGenSerializer(conf, meta), CacheGenDeserializer(conf, meta)
        bins = (ser.key_bins.tolist(), ser.value_bins.tolist())
        points = dict(KVCOMP_POINTS)
        if calib:  # bases on the training split: 8 windows of ctx bytes, English and code in turn
            cp = corpus_mod.load(calib)
            Ks, Vs = [], []
            for j in range(8):
                t = np.frombuffer(cp["train_en.bin" if j % 2 == 0 else "train_code.bin"],
                                  np.uint8)
                cw = torch.from_numpy(t[(j // 2) * ctx:(j // 2 + 1) * ctx].astype(np.int64))
                with torch.no_grad():
                    Kc, Vc = frontier.prefill(model, cw)
                Ks.append(Kc.bfloat16().float())
                Vs.append(Vc.bfloat16().float())
            codecs_ref.pca_calibrate(Ks, Vs)
            points.update(PCA_POINTS)
        names = ["full", "lmcache cachegen", *points]
        loss = {x: [] for x in names}
        bpt = {x: [] for x in names}
        ent = {x: [] for x in names}  # kvcomp's codes through an order-0 entropy coder
        for j in range(windows):
            t = en if j % 2 == 0 else code
            s = int(j * (len(t) - ctx - 2) / 49)
            w = torch.from_numpy(t[s:s + ctx].astype(np.int64))
            with torch.no_grad():
                K, V = frontier.prefill(model, w[:N - 1])
            K, V = K.bfloat16().float(), V.bfloat16().float()  # the bf16 cache
            L, H, n, _ = K.shape
            kv = torch.stack([K.permute(0, 2, 1, 3).reshape(L, n, H * d),
                              V.permute(0, 2, 1, 3).reshape(L, n, H * d)]).bfloat16()
            obj = TensorMemoryObj(kv, MemoryObjMetadata(
                shape=kv.shape, dtype=kv.dtype, address=0, phy_size=kv.numel() * 2,
                ref_count=1, fmt=MemoryFormat.KV_2LTD), None)
            blob = ser.serialize(obj)
            got = des.deserialize(blob).tensor.float().reshape(2, L, n, H, d)
            built = frontier.build(points, K, V, None, zstd=False)
            built["full"] = (K, V, [2.0 * 2 * L * H * d, 0, 0])
            built["lmcache cachegen"] = (got[0].permute(0, 2, 1, 3).contiguous(),
                                         got[1].permute(0, 2, 1, 3).contiguous(),
                                         [len(blob.byte_array) / n, 0, 0])
            ls = frontier.losses(model, built, names, N, w, 2)
            for x in names:
                loss[x].append(ls[x])
                bpt[x].append(built[x][2][0])
                ent[x].append(built[x][2][1] or built[x][2][0])
            xw = 2 * 2 * L * H * d / bpt["lmcache cachegen"][-1]
            print(f"[{name} {j + 1}/{windows}] cachegen {xw:.2f}x", flush=True)
        f = np.array(loss["full"])
        full_b = float(np.mean(bpt["full"]))
        res = {}
        for x in names:
            dd = 100 * (np.array(loss[x]) - f) / f.mean()
            h = 1.96 * dd.std(ddof=1) / np.sqrt(len(dd)) if len(dd) > 1 else float("nan")
            res[x] = (full_b / float(np.mean(bpt[x])), float(dd.mean()), float(h),
                      full_b / float(np.mean(ent[x])))
        per_model[name] = {"summary": res, "loss": loss, "bytes_per_token": bpt}
        # paired over the same windows: CacheGen against kvcomp's hq4/hq4 (more compression)
        dp = 100 * (np.array(loss["lmcache cachegen"]) - np.array(loss["kvhq k4v4"])) / f.mean()
        hp = 1.96 * dp.std(ddof=1) / np.sqrt(len(dp)) if len(dp) > 1 else float("nan")
        # kvcomp at CacheGen's bytes: linear in bytes per token between kvcomp's points
        xc = res["lmcache cachegen"][0]

        def at_bytes(col, among):  # kvcomp's lower envelope, linear in bytes between points
            pts = sorted([(1.0, 0.0)] + [(res[x][col], res[x][1]) for x in among])
            env, best = [], float("inf")
            for xp, yp in sorted(pts, key=lambda t: -t[0]):  # keep points no worse at more x
                if yp < best:
                    env.append((xp, yp))
                    best = yp
            env.sort()
            if env and xc <= env[0][0]:  # a point with more compression and no more loss
                return env[0][1]
            for (x0, y0), (x1, y1) in zip(env, env[1:]):
                if x0 <= xc <= x1:
                    b0, b1, bc = 1 / x0, 1 / x1, 1 / xc
                    return y0 + (y1 - y0) * (b0 - bc) / (b0 - b1)
            return None
        at, at5, at_ent = at_bytes(0, ENGINE), at_bytes(0, KVCOMP_POINTS), \
            at_bytes(3, KVCOMP_POINTS)
        at_pca = at_bytes(0, [x for x in PCA_POINTS if x in res])
        for x in names[1:]:
            xr, m, h, xe = res[x]
            xe = f"{xe:.2f}" if x in points else "-"
            label = x if x in ENGINE or x not in points else f"{x} (mirror only)"
            rows.append(f"| {name} | {label} | {xr:.2f} | {xe} | {m:+.2f}% [{m - h:+.2f}, "
                        f"{m + h:+.2f}] | {len(f)} |")

        def pct(v):
            return f"{v:+.2f}%" if v is not None else "outside the points"
        rows.append(f"| {name} | kvcomp at CacheGen's bytes ({xc:.2f}x): the engine's codecs / "
                    "with 5-bit widths / with 5-bit widths and the codes entropy-coded | - | - | "
                    f"{pct(at)} / {pct(at5)} / {pct(at_ent)} | {len(f)} |")
        if calib:
            rows.append(f"| {name} | kvcomp at CacheGen's bytes ({xc:.2f}x) with the calibrated "
                        f"basis codec (pca points, mirror; the pq library not yet in the engine) "
                        f"| - | - | {pct(at_pca)} | {len(f)} |")
            dq = 100 * (np.array(loss["lmcache cachegen"]) - np.array(loss["pca k4v4"])) / \
                f.mean()
            hq_ = 1.96 * dq.std(ddof=1) / np.sqrt(len(dq)) if len(dq) > 1 else float("nan")
            rows.append(f"| {name} | CacheGen - pca k4v4 ({res['pca k4v4'][0]:.2f}x), paired | - "
                        f"| - | {dq.mean():+.2f} [{dq.mean() - hq_:+.2f}, {dq.mean() + hq_:+.2f}] "
                        f"points | {len(f)} |")
        rows.append(f"| {name} | CacheGen - kvhq k4v4 ({res['kvhq k4v4'][0]:.2f}x), paired | - | - "
                    f"| {dp.mean():+.2f} [{dp.mean() - hp:+.2f}, {dp.mean() + hp:+.2f}] points | "
                    f"{len(f)} |")
        print("\n".join(rows[-len(names) - 3:]), flush=True)
        print(f"{name}: CacheGen bins keys {sorted(set(bins[0]))} values {sorted(set(bins[1]))}",
              flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "# LMCache's CacheGen serde against kvcomp's codecs, three models", "",
        f"{date}; lmcache {version('lmcache')}, torch {torch.__version__}, CPU "
        f"({platform.machine()}, {os.cpu_count()} cores shared); commit {frontier.git_commit()}. "
        "Each window's cache (bf16) as LMCache's KV_2LTD chunk through "
        "CacheGenSerializer.serialize and CacheGenDeserializer.deserialize (LMCache's naive serde, "
        "its torch arithmetic coder on CPU; bins from its CacheGenConfig: 32 for keys and values "
        "in every layer of models under 10 layers); kvcomp's hq codecs (the engine's arithmetic, "
        "codecs_ref) on the same windows. Windows of "
        f"{ctx} held-out bytes (English and code alternately), the first {N - 1} cached and "
        f"compressed, loss over the last {tail} (frontier.py's protocol). x: bf16 bytes over "
        "stored bytes (CacheGen: its whole serialized chunk: CDFs, per-token maxima, bitstreams). "
        "x, codes entropy-coded: kvcomp's hq codes at their order-0 entropy (what an entropy "
        "coder of the codes, as CacheGen's, would store; kvcomp's cache format stores them as they "
        "are). Loss: vs the full cache, mean and 95% interval over windows. kvcomp at CacheGen's "
        "bytes: linear in bytes per token between the neighbouring points of kvcomp's lower "
        "envelope (the lossless preset at 1x, +0%), among the engine's codecs (hq4, hq3), then "
        "with the mirror's 5-bit widths (not in the engine), then with those codes at their "
        "entropy; with --calib also the calibrated basis codec's points (pca k{bits}v{bits}: "
        "bases fitted on 8 windows of the training split; bench/quality/codecs_ref.py, the pq "
        "library's arithmetic; not yet an engine codec).", "",
        "| model | config | x | x, codes entropy-coded | loss vs full [95%] | n |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows, ""])
    with open(out + ".md", "w") as fh:
        fh.write(text)
    with open(out + ".json", "w") as fh:
        json.dump({"date": date, "lmcache": version("lmcache"), "ctx": ctx, "tail": tail,
                   "per_model": per_model}, fh, indent=1)
    print(text)


TQ_PRESETS = {"turboquant_k8v4": ("fp8", "vtqv4"), "turboquant_4bit_nc": ("vtqk4n", "vtqv4"),
              "turboquant_k3v4_nc": ("vtqk3n", "vtqv4"), "turboquant_3bit_nc": ("vtqk3n", "vtqv3")}


def turboquant_check(model_dir, corpus, tokens, layers, presets, out):
    """LMCache's TurboQuant serde (its Triton store and decode kernels, run by Triton's
    interpreter on CPU: TRITON_INTERPRET=1, the serde's CUDA staging pointed at the CPU) against
    frontier.py's vLLM-layout TurboQuant mirror (vtqk / vtqv) on the same cache: stored bytes per
    token and head, and each one's relative error of the decoded keys and values."""
    os.environ["TRITON_INTERPRET"] = "1"
    import frontier
    from importlib.metadata import version
    import lmcache.v1.distributed.serde.turboquant.decode_kernel as dk
    import lmcache.v1.distributed.serde.turboquant.turboquant as tq
    from lmcache.v1.distributed.api import ObjectKey
    from transformers import AutoModelForCausalLM
    tq._select_cuda_device = lambda *a, **k: torch.device("cpu")  # no GPU: stage on the CPU
    dk._FP8_E4B15[0] = 0  # fp8 e4m3 (e4nv), what the serde uses on Hopper
    en = np.frombuffer(corpus_mod.load(corpus)["held_en.bin"], np.uint8)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        K, V = frontier.prefill(model, torch.from_numpy(en[:tokens].astype(np.int64)))
    K, V = K[layers].bfloat16().float(), V[layers].bfloat16().float()  # [L, H, n, d]
    L, H, n, d = K.shape
    kv = torch.stack([K.permute(0, 2, 1, 3).reshape(L, n, H * d),
                      V.permute(0, 2, 1, 3).reshape(L, n, H * d)]).bfloat16().contiguous()
    key = ObjectKey(chunk_hash=b"h" * 32, model_name="kvcomp/code", kv_rank=0)

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    rows = []
    for preset in presets:
        cfg = tq.TurboQuantSerdeConfig(preset=preset, head_dim=d, skip_first_layers=0,
                                       skip_last_layers=0)
        src = memobj(kv)
        dst = memobj(torch.zeros(kv.numel() * 2, dtype=torch.uint8))
        nbytes = tq.TurboQuantSerializer(cfg).serialize(src, dst, key)
        got = memobj(torch.zeros_like(kv))
        tq.TurboQuantDeserializer(cfg).deserialize(dst, got, key)
        g = got.tensor.float().reshape(2, L, n, H, d).permute(0, 1, 3, 2, 4)
        ks, vs = TQ_PRESETS[preset]
        mk, kb, _, _ = frontier.encode(ks, K, True, None, zstd=False)
        mv, vb, _, _ = frontier.encode(vs, V, False, None, zstd=False)
        rows.append(f"| {preset} | {nbytes / (L * n * H):.1f} | {(kb + vb) / (L * n * H):.1f} | "
                    f"{rel(g[0], K):.4f} | {rel(mk, K):.4f} | {rel(g[1], V):.4f} | "
                    f"{rel(mv, V):.4f} |")
        print(rows[-1], flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "# LMCache's TurboQuant serde against the frontier's vLLM-layout TurboQuant mirror", "",
        f"{date}; lmcache {version('lmcache')}, torch {torch.__version__}, Triton's interpreter "
        f"on CPU; commit {frontier.git_commit()}. The code model's bf16 cache of the first "
        f"{tokens} held-out English bytes, layers {layers} ({H} kv heads x {d}), as LMCache's "
        "KV_2LTD chunk through TurboQuantSerializer.serialize / TurboQuantDeserializer."
        "deserialize (every layer quantized: skip_first_layers = skip_last_layers = 0; the "
        "serde's default skips 2 + 2 layers, which on these 4-8-layer models leaves 0-4 layers "
        "quantized), beside frontier.py's vtqk (keys: WHT-rotated unit vector on the Lloyd-Max "
        "codebook, fp16 norm, norm correction) / vtqv (values: asymmetric per-vector uniform, "
        "fp16 scale and zero) and fp8 keys for k8v4. Bytes per token and kv head; relative L2 "
        "error of the decoded keys and values against the cache.", "",
        "| preset | bytes, LMCache | bytes, mirror | key error, LMCache | key error, mirror | "
        "value error, LMCache | value error, mirror |",
        "| --- | --- | --- | --- | --- | --- | --- |", *rows, ""])
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
    ap.add_argument("--cachegen", nargs="*", metavar="NAME=DIR",
                    help="run LMCache's CacheGen serde on these models' caches beside kvcomp's "
                         "hq codecs instead")
    ap.add_argument("--calib", default="", metavar="CORPUS",
                    help="with --cachegen: a corpus whose training split calibrates the pca "
                         "points (bench/quality/suite.py --calib)")
    ap.add_argument("--turboquant-check", metavar="DIR",
                    help="compare LMCache's TurboQuant serde (Triton interpreter, CPU) with "
                         "frontier.py's mirror on this model's cache instead")
    ap.add_argument("--tq-presets", nargs="*", default=list(TQ_PRESETS))
    ap.add_argument("--tq-layers", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=128)
    args = ap.parse_args()
    if args.turboquant_check:
        torch.set_num_threads(1)
        return turboquant_check(args.turboquant_check, args.corpus, args.tokens, args.tq_layers,
                                args.tq_presets, args.out)
    if args.cachegen:
        torch.set_num_threads(1)
        return cachegen(args.cachegen, args.corpus, args.windows, args.ctx, args.tail, args.out,
                        args.calib or None)
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

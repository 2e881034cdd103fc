"""The full-length codec frontier on a CPU: kvcomp's Hadamard codec (the engine's arithmetic,
codecs_ref "kvhq"), its variants (bit widths, per-channel key scales, per-layer bit allocation by
measured sensitivity, zstd on the codes) and the peers (fp8 = LMCache's fp8 serde, KIVI-2,
TurboQuant from the paper at vLLM's presets' widths and in vLLM's own layout), next-byte loss
with the decoded cache, on several models at once, sample by sample, until a wall-clock deadline.

    python3 bench/quality/frontier.py --models code57=bench/quality/lm/model g16=DIR d8=DIR \\
        --corpus corpus.tar.xz [--ctx 4096 --tail 256] [--n 50] [--deadline-seconds S] \\
        [--alloc ALLOC.json] --out PREFIX
    python3 bench/quality/frontier.py --calibrate --models ... --corpus ... --out ALLOC
    python3 bench/quality/frontier.py --render PREFIX.json

Protocol: a window of --ctx held-out bytes (English and code alternately, the suite's starts);
the first ctx - tail bytes are prefilled and their cache replaced by each configuration's
decoded cache; the loss is the mean next-byte NLL over the last `tail` bytes (teacher-forced over
the decoded prefix). Relative loss: mean over samples of the paired difference against the full
cache, over the full cache's mean, with a 95% normal interval. Bytes: every stored byte (codes,
per-row minimum and step, per-channel scales, per-layer sizes) against the bf16 cache; "zstd":
each (layer, tensor) code plane as one byte per code through libzstd (ctypes on the
system library, level 19, on the first two rounds) or packed where zstd does not shrink it,
the side data counted raw; "ent.": order-0 entropy of the codes.

--calibrate measures each (layer, tensor)'s sensitivity on windows disjoint from the evaluation
(starts offset by half a step): the loss when only that layer's keys (or values) are coded at 2
bits. The allocation for a mean width B gives each (layer, tensor) a width in {2, 3, 4}
minimising the sum of sensitivity x 4^-(width - 2) (quantization noise falls 4x per bit) under
the mean, greedily; `alloc{B}` configs use it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "lm"))
import codecs_ref  # noqa: E402
import corpus as corpus_mod  # noqa: E402

# name: (key spec, value spec, eviction policy, ratio). Specs: codecs_ref specs, "kvhq{b}c"
# (per-channel centring and scaling, then kvhq), "alloc{B}" (per-layer widths from --alloc).
CONFIGS = {
    "full": ("bf16", "bf16", None, 0.0),
    "fp8 (LMCache fp8)": ("fp8", "fp8", None, 0.0),
    "kivi2": ("kivi2", "kivi2", None, 0.0),
    "tq k8v4": ("tq8", "tq4", None, 0.0),
    "tq k4v4": ("tq4", "tq4", None, 0.0),
    "tq k3v4": ("tq3", "tq4", None, 0.0),
    "tq k3v3": ("tq3", "tq3", None, 0.0),
    "tq k3v2": ("tq3", "tq2", None, 0.0),
    # vLLM's / LMCache's turboquant presets' layout (keys fp8, or TurboQuant with the norm
    # corrected; values unrotated uniform int-b with fp16 scale and minimum), every layer
    # quantized (the presets' default leaves the first and last two layers unquantized)
    "vllm tq k8v4": ("fp8", "vtqv4", None, 0.0),
    "vllm tq 4bit_nc": ("vtqk4n", "vtqv4", None, 0.0),
    "vllm tq k3v4_nc": ("vtqk3n", "vtqv4", None, 0.0),
    "vllm tq 3bit_nc": ("vtqk3n", "vtqv3", None, 0.0),
    # TurboQuant keys (norm-corrected) with the engine's hq values: the next key codec's candidates
    "tqn k4 + kvhq v3": ("vtqk4n", "kvhq3", None, 0.0),
    "tqn k3 + kvhq v3": ("vtqk3n", "kvhq3", None, 0.0),
    "tqn k3 + kvhq v2": ("vtqk3n", "kvhq2", None, 0.0),
    "kvhq k4v4": ("kvhq4", "kvhq4", None, 0.0),
    "kvhq k4v3": ("kvhq4", "kvhq3", None, 0.0),
    "kvhq k3v3": ("kvhq3", "kvhq3", None, 0.0),
    "kvhq k3v2": ("kvhq3", "kvhq2", None, 0.0),
    "kvhq k2v2": ("kvhq2", "kvhq2", None, 0.0),
    "kvhq k3c v3": ("kvhq3c", "kvhq3", None, 0.0),
    "kvhq k2c v2": ("kvhq2c", "kvhq2", None, 0.0),  # (not in the default run: CPU time)
    "kvhq alloc 3.0": ("alloc3.0", "alloc3.0", None, 0.0),
    "kvhq alloc 2.5": ("alloc2.5", "alloc2.5", None, 0.0),
    "manifold_r50 0.5 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r50", 0.5),
    "manifold_r50 0.67 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r50", 0.67),
    "manifold_r50 0.55 + kvhq alloc 2.5": ("alloc2.5", "alloc2.5", "manifold_r50", 0.55),
}
DEFAULT = [c for c in CONFIGS if c != "kvhq k2c v2" and not c.startswith(("vllm", "tqn"))]

_ZSTD = None


ZSTD_LEVEL = 19  # zstd -1 and -3 stay above the codes' order-0 entropy on keys (measured)
ZSTD_ROUNDS = 2  # zstd at 19 is slow: its bytes come from the first rounds only


def zstd_len(buf: bytes, level: int = ZSTD_LEVEL) -> int:
    """Compressed size of buf through the system libzstd (ZSTD_compress)."""
    global _ZSTD
    if _ZSTD is None:
        lib = ctypes.CDLL(ctypes.util.find_library("zstd") or "libzstd.so.1")
        lib.ZSTD_compressBound.restype = ctypes.c_size_t
        lib.ZSTD_compressBound.argtypes = [ctypes.c_size_t]
        lib.ZSTD_compress.restype = ctypes.c_size_t
        lib.ZSTD_compress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                      ctypes.c_size_t, ctypes.c_int]
        lib.ZSTD_isError.restype = ctypes.c_uint
        lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
        _ZSTD = lib
    cap = _ZSTD.ZSTD_compressBound(len(buf))
    dst = ctypes.create_string_buffer(cap)
    n = _ZSTD.ZSTD_compress(dst, cap, buf, len(buf), level)
    if _ZSTD.ZSTD_isError(n):
        raise RuntimeError("ZSTD_compress failed")
    return int(n)


def kvhq(X, bits, centre=False, zstd=True):
    """The engine's hq codec on X [L', H, N, d] (optionally after per-channel centring and
    scaling over the sequence, fp16 mean and scale per channel): decoded, bytes, entropy
    bytes, zstd bytes (per layer plane)."""
    L, H, N, d = X.shape
    side = 0.0
    Z = X
    if centre:
        mu = X.mean(dim=2, keepdim=True).half().float()
        sd = X.std(dim=2, keepdim=True).clamp_min(1e-3).half().float()
        Z = (X - mu) / sd
        side = L * H * d * 4.0
    q, lo, step = codecs_ref.hq_engine_encode(Z, bits)
    y = codecs_ref.hq_engine_decode(q, lo, step)
    if centre:
        y = y * sd + mu
    rows = X.numel() // d
    b = X.numel() * bits / 8 + 4 * rows + side
    e = codecs_ref._entropy_bits(q) / 8 + 4 * rows + side
    z = None
    if zstd:  # a plane zstd does not shrink is stored packed (one flag per plane)
        qb = q.to(torch.uint8).numpy()
        z = sum(min(zstd_len(qb[l].tobytes()), qb[l].size * bits / 8) + 1 for l in range(L)) \
            + 4 * rows + side
    return y, b, e, z


def encode(spec, X, is_key, alloc, zstd=True):
    if spec.startswith("alloc"):
        widths = alloc[spec[5:]]["keys" if is_key else "values"]
        parts = [encode(f"kvhq{w}", X[l:l + 1], is_key, alloc, zstd)
                 for l, w in enumerate(widths)]
        return (torch.cat([p[0] for p in parts]), sum(p[1] for p in parts),
                sum(p[2] for p in parts), None if not zstd else sum(p[3] for p in parts))
    if spec.startswith("kvhq"):
        c = spec.endswith("c")
        return kvhq(X, int(spec[4:].rstrip("c")), c, zstd)
    if spec.startswith("vtqk"):  # keys: rotated unit vector on the Lloyd-Max codebook, fp16 norm
        b, nc = int(spec[4:].rstrip("n")), spec.endswith("n")
        d = X.shape[-1]
        Hm = codecs_ref.hadamard(d, X.device)
        nrm = X.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        u = (X / nrm) @ Hm.T * math.sqrt(d)
        c = torch.tensor(codecs_ref.lloyd_max(b), dtype=torch.float32)
        q = torch.bucketize(u, (c[1:] + c[:-1]) / 2)
        r = c[q] / math.sqrt(d)
        if nc:  # norm correction: the reconstructed unit vector renormalized
            r = r / r.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        y = (r @ Hm) * nrm.half().float()
        rows = X.numel() // d
        by = X.numel() * b / 8 + 2 * rows
        return y, by, codecs_ref._entropy_bits(q) / 8 + 2 * rows, by
    if spec.startswith("vtqv"):  # values: uniform asymmetric per vector, round half up
        b = int(spec[4:])
        d = X.shape[-1]
        mn, mx = X.amin(-1, keepdim=True), X.amax(-1, keepdim=True)
        sc = ((mx - mn) / (2 ** b - 1)).clamp_min(1e-8)
        q = ((X - mn) / sc + 0.5).floor().clamp(0, 2 ** b - 1)
        y = q * sc.half().float() + mn.half().float()
        rows = X.numel() // d
        by = X.numel() * b / 8 + 4 * rows
        return y, by, codecs_ref._entropy_bits(q.long()) / 8 + 4 * rows, by
    if spec.startswith("only"):  # only{l}:{spec}: one layer coded, the others as they are
        l, inner = spec[4:].split(":")
        l = int(l)
        y, b, e, z = encode(inner, X[l:l + 1], is_key, alloc, zstd)
        out = X.clone()
        out[l:l + 1] = y
        rest = 2.0 * (X.numel() - X[l:l + 1].numel())
        return out, b + rest, e + rest, None if z is None else z + rest
    y, b, e = codecs_ref.encode(spec, X, is_key)
    e = b if e is None else e
    return y, b, e, b


def build(cfgs, K, V, alloc, zstd=True):
    L, H, N, d = K.shape
    out, memo = {}, {}
    for name, (kc, vc, pol, ratio) in cfgs.items():
        for spec, X, isk in ((kc, K, True), (vc, V, False)):
            if (spec, isk) not in memo:
                memo[(spec, isk)] = encode(spec, X, isk, alloc, zstd)
        Kd, kb, ke, kz = memo[(kc, True)]
        Vd, vb, ve, vz = memo[(vc, False)]
        frac, pos = 1.0, 0.0
        if pol:
            import variants
            m = variants.policy_mask(pol, K, ratio)
            kept = int(m[0, 0].sum())
            idx = m.nonzero()[:, 2].reshape(L, H, kept)
            g = idx[..., None].expand(L, H, kept, d)
            Kd, Vd = Kd.gather(2, g), Vd.gather(2, g)
            frac, pos = kept / N, 4.0 * L * H * kept
        zb = None if kz is None or vz is None else (frac * (kz + vz) + pos) / N
        out[name] = (Kd, Vd, [(frac * (kb + vb) + pos) / N, (frac * (ke + ve) + pos) / N, zb])
    return out


@torch.no_grad()
def prefill(model, ids):
    pkv = model(ids[None], use_cache=True).past_key_values
    K = torch.stack([pkv.layers[l].keys[0] for l in range(len(pkv.layers))]).float()
    V = torch.stack([pkv.layers[l].values[0] for l in range(len(pkv.layers))]).float()
    return K, V


@torch.no_grad()
def losses(model, built, names, N, w, batch):
    """Mean NLL of w[N:] given each config's decoded cache of w[:N] (teacher forced from w[N-1])."""
    from transformers import DynamicCache
    tail_in = w[N - 1:-1]
    tgt = w[N:]
    out = {}
    groups = {}
    for x in names:
        groups.setdefault(built[x][0].shape[2], []).append(x)
    for n, grp in groups.items():
        for i in range(0, len(grp), batch):
            sub = grp[i:i + batch]
            c = DynamicCache()
            for l in range(built[sub[0]][0].shape[0]):
                # the cache is of w[:N-1]; w[N-1] is the first tail input
                k = torch.stack([built[x][0][l] for x in sub]).to(model.dtype)
                v = torch.stack([built[x][1][l] for x in sub]).to(model.dtype)
                c.update(k, v, l)
            B = len(sub)
            ids = tail_in[None].expand(B, -1)
            pos = torch.arange(N - 1, N - 1 + tail_in.numel())[None].expand(B, -1)
            lg = model(ids, past_key_values=c, position_ids=pos, use_cache=True).logits.float()
            for j, x in enumerate(sub):
                out[x] = float(torch.nn.functional.cross_entropy(lg[j], tgt))
    return out


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def allocate(sens_k, sens_v, mean_bits, widths=(2, 3, 4)):
    """Greedy widths per (tensor, layer) for a mean width: start at the lowest, raise the one
    with the largest predicted loss drop until the mean is reached."""
    items = [("keys", l, max(s, 1e-6)) for l, s in enumerate(sens_k)] + \
            [("values", l, max(s, 1e-6)) for l, s in enumerate(sens_v)]
    w = {(t, l): widths[0] for t, l, _ in items}
    budget = mean_bits * len(items)
    s = {(t, l): v for t, l, v in items}

    def cost(t, l, b):
        return s[(t, l)] * 4.0 ** -(b - widths[0])
    while sum(w.values()) < budget - 1e-9:
        best, gain = None, -1.0
        for key in w:
            if w[key] < widths[-1]:
                g = cost(*key, w[key]) - cost(*key, w[key] + 1)
                if g > gain:
                    best, gain = key, g
        if best is None:
            break
        w[best] += 1
    return {"keys": [w[("keys", l)] for l in range(len(sens_k))],
            "values": [w[("values", l)] for l in range(len(sens_v))]}


def load_models(specs, dtype):
    from transformers import AutoModelForCausalLM
    models = {}
    for s in specs:
        name, path = s.split("=", 1)
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        m.set_attn_implementation("sdpa")
        models[name] = (path, m)
    return models


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=[])
    ap.add_argument("--corpus")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--configs", nargs="*")
    ap.add_argument("--alloc")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--zstd-levels", type=int, nargs="*")
    ap.add_argument("--calib-n", type=int, default=4)
    ap.add_argument("--deadline-seconds", type=float, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--render")
    ap.add_argument("--pool", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.render:
        res = json.load(open(args.render))
        write_md(args.render[:-5] + ".md", res)
        return
    torch.set_num_threads(args.threads)
    t0 = time.time()
    parts = corpus_mod.load(args.corpus)
    en = np.frombuffer(parts["held_en.bin"], np.uint8)
    code = np.frombuffer(parts["held_code.bin"], np.uint8)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    models = load_models(args.models, dtype)
    alloc = {}
    N = args.ctx - args.tail
    step_en = (len(en) - args.ctx - 2) / 49
    step_code = (len(code) - args.ctx - 2) / 49

    def window(j, offset=0.0):
        t, st = (en, step_en) if j % 2 == 0 else (code, step_code)
        s = int((j + offset) * st)
        return torch.from_numpy(t[s:s + args.ctx].astype(np.int64))

    def log(m):
        print(f"[{time.time() - t0:7.1f}s] {m}", flush=True)

    if args.zstd_levels:  # bits per code of zstd at several levels against the order-0 entropy
        lines = []
        for name, (path, model) in models.items():
            w = window(1)  # a code window
            K, V = prefill(model, w[:N - 1])
            for tn, X in (("keys", K), ("values", V)):
                for b in (2, 3, 4):
                    q, _, _ = codecs_ref.hq_engine_encode(X, b)
                    qb = q.to(torch.uint8).numpy()
                    ent = codecs_ref._entropy_bits(q) / q.numel()
                    cells = []
                    for lv in args.zstd_levels:
                        t = time.process_time()
                        z = sum(zstd_len(qb[l].tobytes(), lv) for l in range(qb.shape[0]))
                        dt = time.process_time() - t
                        cells.append(f"{8 * z / q.numel():.2f} ({q.numel() / dt / 1e6:.1f})")
                    distinct = [len({r.tobytes() for r in qb[l].reshape(-1, qb.shape[-1])})
                                for l in range(qb.shape[0])]
                    lines.append(f"| {name} | {tn} | {b} | {ent:.2f} | " + " | ".join(cells) +
                                 f" | {' '.join(map(str, distinct))} of "
                                 f"{qb[0].size // qb.shape[-1]} |")
                    log(lines[-1])
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ")
        text = "\n".join([
            "# zstd on the engine's hq codes, by level", "",
            f"date {date}, commit {git_commit()}, {platform.machine()} ({os.cpu_count()} shared "
            f"cpus, one thread), libzstd through ctypes; per model one held-out code window of "
            f"{N - 1} bytes prefilled ({args.dtype}); codes of the engine's hq codec (the kvhq "
            "mirror), one byte per code, each layer's plane compressed alone. Cells: bits per "
            "code (and MB of codes per CPU second); the minimum and step (0.25 bits per code at "
            "d = 128) are not included. Distinct rows: how many of the plane's rows (token x kv "
            "head) differ, per layer.", "",
            "| model | tensor | bits | order-0 entropy | " + " | ".join(
                f"zstd -{lv}" for lv in args.zstd_levels) + " | distinct rows per layer |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in args.zstd_levels) + " | --- |",
            *lines, ""])
        with open(args.out + ".md", "w") as f:
            f.write(text)
        return
    if args.calibrate:
        res = {}
        for name, (path, model) in models.items():
            L = model.config.num_hidden_layers
            cfgs = {"full": ("bf16", "bf16", None, 0.0)}
            for l in range(L):
                cfgs[f"k{l}"] = (f"only{l}:kvhq2", "bf16", None, 0.0)
                cfgs[f"v{l}"] = ("bf16", f"only{l}:kvhq2", None, 0.0)
            acc = {c: [] for c in cfgs}
            for j in range(args.calib_n):
                w = window(j, 0.5)
                K, V = prefill(model, w[:N - 1])
                built = build(cfgs, K, V, alloc, zstd=False)
                ls = losses(model, built, list(cfgs), N, w, args.batch)
                for c in cfgs:
                    acc[c].append(ls[c])
                log(f"calibrate {name} {j + 1}/{args.calib_n}")
            fl = np.mean(acc["full"])
            sk = [float(np.mean(acc[f"k{l}"]) / fl - 1) for l in range(L)]
            sv = [float(np.mean(acc[f"v{l}"]) / fl - 1) for l in range(L)]
            res[name] = {"model": path, "sens_keys": sk, "sens_values": sv,
                         "alloc": {f"{b:.1f}": allocate(sk, sv, b) for b in (2.5, 3.0, 3.5)}}
            log(f"{name}: keys {np.round(np.array(sk) * 100, 3)} values "
                f"{np.round(np.array(sv) * 100, 3)} (% loss at 2 bits, one layer)")
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ"),
                "commit": git_commit(), "machine": platform.machine(), "ctx": args.ctx,
                "tail": args.tail, "calib_n": args.calib_n, "torch": torch.__version__}
        for name in res:
            with open(f"{args.out}-{name}.json", "w") as f:
                json.dump({"meta": meta, **res[name]}, f, indent=1)
        return

    names = args.configs or DEFAULT
    if not args.alloc:  # the per-layer widths come from a calibration
        names = [c for c in names if not any(s.startswith("alloc") for s in CONFIGS[c][:2])]

    def uses_alloc(c):
        return any(s.startswith("alloc") for s in CONFIGS[c][:2])

    def load_alloc(name):
        """The model's calibration once its file exists (a calibration may still be running:
        the alloc configs join from the round after it lands; rows pair by round)."""
        p = args.alloc.replace("{model}", name) if args.alloc else None
        if p and os.path.exists(p):
            return json.load(open(p))["alloc"]
        return {}
    per = {}
    for name, (path, model) in models.items():
        per[name] = {"path": path, "alloc": load_alloc(name), "zstd_level": ZSTD_LEVEL,
                     "zstd_rounds": ZSTD_ROUNDS, "loss": {c: [] for c in names},
                     "bytes": {c: [] for c in names}, "windows": [],
                     "layers": model.config.num_hidden_layers,
                     "kv_heads": model.config.num_key_value_heads,
                     "parameters": sum(p.numel() for p in model.parameters())}
    meta = {"commit": git_commit(), "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "threads": args.threads, "dtype": args.dtype, "ctx": args.ctx, "tail": args.tail,
            "configs": {c: CONFIGS[c] for c in names}, "torch": torch.__version__,
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ"),
            "corpus": json.loads(parts["manifest.json"])}
    for j in range(args.n):
        if args.deadline_seconds and time.time() - t0 > args.deadline_seconds:
            log(f"deadline reached after {j} rounds")
            break
        for name, (path, model) in models.items():
            r = per[name]
            if not r["alloc"]:
                r["alloc"] = load_alloc(name)
            now = [c for c in names if r["alloc"] or not uses_alloc(c)]
            w = window(j)
            K, V = prefill(model, w[:N - 1])
            built = build({c: CONFIGS[c] for c in now}, K, V, r["alloc"],
                          zstd=j < ZSTD_ROUNDS)
            ls = losses(model, built, now, N, w, args.batch)
            for c in names:  # None: not run this round (its calibration had not landed)
                r["loss"][c].append(ls.get(c))
                r["bytes"][c].append(built[c][2] if c in built else None)
            r["windows"].append("en" if j % 2 == 0 else "code")
        meta["seconds"] = time.time() - t0
        meta["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ")
        res = {"meta": meta, "models": per}
        with open(args.out + ".json", "w") as f:
            json.dump(res, f)
        write_md(args.out + ".md", res)
        log(f"round {j + 1} done")


def summarize(r):
    """Rows per config: x (stored, order-0, zstd), loss %, 95% interval, n."""
    fl = np.array(r["loss"]["full"], float)
    bf = np.array(r["bytes"]["full"])[:, 0].mean()
    rows = []
    for c in r["loss"]:
        have = [i for i, v in enumerate(r["loss"][c]) if v is not None]
        if not have:
            continue
        ls = np.array([r["loss"][c][i] for i in have])
        n = len(ls)
        d = ls - fl[have]
        m = fl[have].mean()
        pct = 100 * d.mean() / m
        h = 100 * 1.96 * d.std(ddof=1) / math.sqrt(n) / m if n > 1 else float("nan")
        b = np.array([r["bytes"][c][i][:2] for i in have]).mean(0)
        zs = [r["bytes"][c][i][2] for i in have if r["bytes"][c][i][2] is not None]
        if r.get("zstd_level", 3) == 3:  # an early run's zstd -3 figures: not shown
            zs = []
        rows.append({"config": c, "x": bf / b[0], "x_ent": bf / b[1],
                     "x_zstd": bf / np.mean(zs) if zs else float("nan"),
                     "pct": pct, "ci": (pct - h, pct + h), "n": n})
    return rows


PEERS = ("fp8", "kivi2", "tq", "vllm")


def kvcomp_at(rows, x):
    """kvcomp's full-length loss at compression x (see the table's note)."""
    pts = sorted((r["x"], r["pct"]) for r in rows if r["config"].startswith("kvhq"))
    if not pts:
        return None
    # the frontier: at each point, the lowest loss at that x or more
    front = [(px, min(q for qx, q in pts if qx >= px)) for px, _ in pts]
    lo = [p for p in front if p[0] <= x]
    hi = [p for p in front if p[0] >= x]
    if not hi:
        return None
    if not lo:
        return hi[0][1]
    (x0, y0), (x1, y1) = lo[-1], hi[0]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def write_md(path, res):
    m = res["meta"]
    out = ["# Full-length codec frontier on a CPU (next-byte loss with the decoded cache)", "",
           f"date {m['date']} (started {m['started']}), commit {m['commit']}, {m['machine']}, "
           f"{m['threads']} threads, torch {m['torch']}, model and cache in "
           f"{m.get('dtype', 'f32')} (codecs computed in f32 on the cache's values). Window "
           f"{m['ctx']} held-out bytes (English and code alternately); the first "
           f"{m['ctx'] - m['tail']} are compressed, loss = mean "
           f"next-byte NLL over the last {m['tail']}; relative to the full cache with the 95% "
           f"interval of the paired difference. x: bf16 bytes / stored bytes; x ent.: codes at "
           f"their order-0 entropy; x zstd: codes through zstd -{ZSTD_LEVEL} (one byte per "
           f"code, per "
           f"layer and tensor; packed where smaller), side data raw, over the first "
           f"{ZSTD_ROUNDS} rounds (nan: not measured). {m['seconds']:.0f} s.", ""]
    if m.get("note"):
        out += [m["note"], ""]
    allrows = {}
    for name, r in res["models"].items():
        rows = summarize(r)
        allrows[name] = rows
        out += [f"## {name} ({r['path']}; {r['parameters']} parameters, {r['layers']} layers, "
                f"{r['kv_heads']} kv heads)", ""]
        if r.get("alloc"):
            out.append("Per-layer widths (keys / values, layer 0 first): " + "; ".join(
                f"{b}: K {''.join(map(str, a['keys']))} V {''.join(map(str, a['values']))}"
                for b, a in r["alloc"].items()) + ".")
            out.append("")
        out += ["| config | x | x ent. | x zstd | loss vs full [95%] | n |",
                "| --- | --- | --- | --- | --- | --- |"]
        for x in rows:
            out.append(f"| {x['config']} | {x['x']:.2f} | {x['x_ent']:.2f} | {x['x_zstd']:.2f}"
                       f" | {x['pct']:+.2f}% [{x['ci'][0]:+.2f}, {x['ci'][1]:+.2f}] | {x['n']} |")
        out.append("")
    names = list(allrows)
    peers = [c for c in allrows[names[0]] if c["config"].split()[0] in PEERS]
    if peers:
        out += ["## kvcomp against each peer at the peer's bytes", "",
                "kvcomp's loss at a peer's x: linear between the two kvcomp full-length points "
                "(hq configs, packed bytes) around it on that model's frontier (the lowest loss "
                "at that x or more); below kvcomp's smallest x, its lowest loss at any larger x "
                "(fewer bytes). `<=`: kvcomp's loss is at or below the peer's.", "",
                "| peer | x | " + " | ".join(f"{n} peer / kvcomp" for n in names) + " |",
                "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
        for pr in peers:
            cells = []
            for n in names:
                rows = allrows[n]
                me = next((x for x in rows if x["config"] == pr["config"]), None)
                k = kvcomp_at(rows, me["x"]) if me else None
                if me is None or k is None:
                    cells.append("-")
                    continue
                ok = "<=" if k <= me["pct"] + 1e-9 else ">"
                cells.append(f"{me['pct']:+.2f}% / {k:+.2f}% {ok}")
            out.append(f"| {pr['config']} | {pr['x']:.2f} | " + " | ".join(cells) + " |")
        out.append("")
    if len(names) > 1:
        out += ["## Pooled over models", "",
                "Worst = the largest loss over the models; mean = their mean; x = the smallest "
                "over the models.", "",
                "| config | x | x ent. | x zstd | " + " | ".join(names) + " | mean | worst |",
                "| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- |"]
        for row in allrows[names[0]]:
            cells = [next((x for x in allrows[n] if x["config"] == row["config"]), None)
                     for n in names]
            if any(c is None for c in cells):
                continue
            out.append(f"| {row['config']} | {min(c['x'] for c in cells):.2f} | "
                       f"{min(c['x_ent'] for c in cells):.2f} | "
                       f"{min(c['x_zstd'] for c in cells):.2f} | "
                       + " | ".join(f"{c['pct']:+.2f}%" for c in cells)
                       + f" | {np.mean([c['pct'] for c in cells]):+.2f}% | "
                       f"{max(c['pct'] for c in cells):+.2f}% |")
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

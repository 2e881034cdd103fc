"""Real-model quality harness: kvcomp policies on a transformers model (kvcomp.hf).

    PYTHONPATH=client/python python3 bench/quality/lm/eval.py [--model DIR] [--backend cpu|cuda]
        [--ctx 4096] [--n-passkey 30] [--n-loss 8] [--grid full|reduced] [--out PREFIX]
    python3 bench/quality/lm/eval.py --variants full|quick [--device cuda] ...  (variants.py:
        float torch references of policy, correction and codec variants; no extension needed)

For the model (default: the project's byte-level model, bench/quality/lm/model) at a context of
--ctx bytes, for every policy cell:
  - pass-key, 1 key: n samples whose key sits at depths (i + 0.5)/n, a needle depth sweep
    read in five depth bins; 3 keys with colliding names: n samples. The context is compressed,
    the question "\\nthe key for NAME is " is not; correct = the greedy 5 digits.
  - loss: mean next-byte NLL (nats) over the last quarter of --n-loss windows of --ctx bytes
    after compressing the first three quarters.
  - bytes per token: the compressed cache's encoded size (every stored byte: header,
    positions, keys, values, scales, outliers, moments) per context token, and the bf16 cache's
    bytes per token over it (x).
Cells: every scorer (knorm, keydiff, manifold, windowed_manifold with window 1024, streaming,
snapkv, random) x ratio (0.5, 0.75, 0.9) x correction on/off; AdaKV (manifold scores,
head_budget adakv) per ratio; the KVSplice presets (manifold eviction, moments) at ratio 0 and
each ratio, values on a projection calibrated on held-out windows that are never evaluated;
and the full cache. SnapKV's observation window is the last 64 context tokens (the kvcompd path
carries no queries: SnapKV is an in-process policy). The cache is handed to kvcomp in bf16.

Text: the held-out files (tasks.heldout_files: the standard library's top-level modules; or
--heldout-dir), their digest recorded with the results. Outputs: PREFIX.json, PREFIX.md and
PREFIX.png (bytes per token against loss and pass-key accuracy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(REPO, "client", "python")):
    sys.path.append(os.path.join(REPO, "client", "python"))

try:
    import kvcomp  # noqa: E402
    import kvcomp.hf as hf  # noqa: E402
except ImportError as _e:  # --variants runs on torch alone (a machine without the extension)
    kvcomp = hf = None
    _KVCOMP_IMPORT_ERROR = _e
import tasks  # noqa: E402

SCORERS = ["knorm", "keydiff", "manifold", "windowed_manifold", "streaming", "snapkv", "random"]
RATIOS = [0.5, 0.75, 0.9]
SPLICE = {  # preset: (key codec, value codec); ranks are the codecs' defaults
    "kvsplice_fp16": ("fp16", "orthogonal"),
    "kvsplice_int8": ("int8", "orthogonal_int8"),
    "kvsplice_int4": ("int8", "orthogonal_int4"),
}


def cells(grid: str):
    """(name, policy, needs projection) for every cell of the grid."""
    out = [("full", kvcomp.Policy(scorer="manifold", ratio=0.0, moments=False), False)]
    if grid == "codecs":  # bytes against loss: manifold, half the budget recent, no moments
        out.append(("int4_keys", kvcomp.Policy(scorer="manifold", ratio=0.0, moments=False,
                                               key_codec="int4"), False))
        for kc in ("int8", "int4"):
            for r in (0.0, 0.4, 0.5, 0.6):
                out.append((f"manifold_r50_{kc}_oint4",
                            kvcomp.Policy(scorer="manifold", ratio=r, recent_fraction=0.5,
                                          moments=False, key_codec=kc,
                                          value_codec="orthogonal_int4"), True))
        out.append(("streaming_int4_oint4",
                    kvcomp.Policy(scorer="streaming", ratio=0.5, moments=False,
                                  key_codec="int4", value_codec="orthogonal_int4"), True))
        return out
    if grid == "moments":  # the moment correction under manifold alone and the default's window
        for rf in (0.0, 0.75):
            for r in RATIOS:
                out.append((f"manifold_r{int(rf * 100)}", kvcomp.Policy(
                    scorer="manifold", ratio=r, moments=True, recent_fraction=rf), False))
        return out
    scorers = SCORERS if grid == "full" else ["keydiff", "manifold", "streaming", "snapkv"]
    for sc in scorers:
        for r in RATIOS:
            extra = {"window": 1024} if sc == "windowed_manifold" else {}
            # the scorers alone (no recent window), as in the figures measured with them
            out.append((sc, kvcomp.Policy(scorer=sc, ratio=r, moments=True, recent_fraction=0.0,
                                          **extra), False))
    for r in RATIOS:
        out.append(("adakv", kvcomp.Policy(scorer="manifold", ratio=r, moments=True,
                                           head_budget="adakv", recent_fraction=0.0), False))
    for name, (kc, vc) in SPLICE.items():
        for r in [0.0] + RATIOS:
            out.append((name, kvcomp.Policy(scorer="manifold", ratio=r, moments=r > 0,
                                            key_codec=kc, value_codec=vc, recent_fraction=0.0),
                        True))
    return out


def git_commit():
    if os.environ.get("KVCOMP_COMMIT"):  # a copy of the tree whose git metadata is stale
        return os.environ["KVCOMP_COMMIT"]
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                           capture_output=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, text=True, capture_output=True).stdout.strip()
        return c + ("+dirty" if dirty else "") if c else "unknown"
    except OSError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(HERE, "model"))
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--device", default=None, help="torch device of the model (default: cuda "
                    "for --backend cuda, else cpu)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--n-passkey", type=int, default=30)
    ap.add_argument("--n-loss", type=int, default=8)
    ap.add_argument("--n-calib", type=int, default=4, help="held-out windows for KVSplice")
    ap.add_argument("--grid", default="full", choices=["full", "reduced", "codecs", "moments"],
                    help="codecs: int8/int4 keys with orthogonal_int4 values under manifold "
                         "with recent_fraction 0.5 at ratios 0-0.6 (bytes against loss); "
                         "moments: manifold alone and with recent_fraction 0.75 at each ratio, "
                         "with and without the moment correction")
    ap.add_argument("--heldout-dir", default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="output prefix (default bench/results/"
                    "lm_quality-<date>-<backend>)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--budget-seconds", type=float, default=0,
                    help="stop taking pass-key samples after this long (0 = no limit); the "
                         "results say how many were taken")
    ap.add_argument("--no-plot", action="store_true", help="write only PREFIX.json")
    ap.add_argument("--variants", choices=["full", "quick", "decisive", "recency"], default=None,
                    help="instead of kvcomp's cells, the float torch references of policy, "
                         "correction and codec variants (variants.py; no kvcomp extension "
                         "needed); quick: a small grid for a smoke run; decisive: every scorer "
                         "and the recent-window policies x ratio, far loss too, correction "
                         "variants at 0.75; recency: the recent window's share of the budget")
    ap.add_argument("--render", metavar="JSON", help="only write the .md and .png of a JSON "
                    "written before")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            d = json.load(f)
        base = args.render[:-5] if args.render.endswith(".json") else args.render
        write_md(base + ".md", d["meta"], d["rows"])
        plot(base + ".png", d["meta"], d["rows"])
        return

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variants:
        return run_variants(args)
    if kvcomp is None:
        raise SystemExit(f"eval.py: the kvcomp extension is needed ({_KVCOMP_IMPORT_ERROR}); "
                         f"only --variants runs without it")
    device = torch.device(args.device or ("cuda" if args.backend == "cuda" else "cpu"))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ")
    out = args.out or os.path.join(REPO, "bench", "results", f"lm_quality-{stamp}-{args.backend}")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    model.eval()
    hf.check_model(model)
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or \
        platform.machine()
    paths = tasks.heldout_files(args.heldout_dir)
    blobs = tasks.read_files(paths)
    text = tasks.concat(blobs)
    # disjoint regions: calibration windows | loss windows | pass-key windows
    n = len(text)
    calib_text, loss_text, pk_text = text[: n // 10], text[n // 10: n // 4], text[n // 4:]
    rng = np.random.default_rng(args.seed)
    bf16_tok = None
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    log(f"model {args.model} on {device} ({card}), backend {args.backend}, ctx {args.ctx}, "
        f"held-out {len(paths)} files digest {tasks.digest(blobs)}")

    # KVSplice projection from held-out windows that are never evaluated
    starts = np.linspace(0, len(calib_text) - args.ctx - 1, args.n_calib).astype(int)
    calib_ids = [torch.from_numpy(calib_text[s:s + args.ctx].astype(np.int64)) for s in starts]
    proj = hf.calibrate(model, calib_ids, cache_dtype=torch.bfloat16, backend="cpu")
    log(f"projection calibrated on {len(calib_ids)} windows of {args.ctx} bytes")

    grid = cells(args.grid)
    res = {i: {"passkey_1": [], "passkey_3": [], "depth": [], "loss": [], "bytes": []}
           for i in range(len(grid))}
    res_nc = {i: {"passkey_1": [], "passkey_3": [], "loss": []} for i in range(len(grid))}

    def run_sample(kind, ctx_ids, tail_ids, answer=None, depth=None):
        nonlocal bf16_tok
        pre = hf.prefill(model, ctx_ids)
        for i, (name, pol, needs_proj) in enumerate(grid):
            cache = hf.cache_from_prefill(model, pre, pol, backend=args.backend,
                                          projection=proj if needs_proj else None,
                                          cache_dtype=torch.bfloat16)
            bf16_tok = cache.bf16_bytes_per_token()
            res[i]["bytes"].append(cache.bytes_per_token)
            corrs = [True, False] if pol.moments else [True]
            for corr in corrs:
                c = cache.fork(correct=corr)
                if kind == "loss":
                    v = float(hf.continuation_nll(model, c, pre.last_logits, tail_ids).mean())
                else:
                    v = float(hf.greedy_matches(model, c, pre.last_logits, tail_ids,
                                                tasks.ids(answer)))
                (res if corr else res_nc)[i][kind].append(v)
                if corr and kind == "passkey_1":
                    res[i]["depth"].append((depth, v))

    q = args.ctx * 3 // 4
    lstarts = np.linspace(0, len(loss_text) - args.ctx - 1, args.n_loss).astype(int)
    for j, s in enumerate(lstarts):
        w = torch.from_numpy(loss_text[s:s + args.ctx].astype(np.int64))
        run_sample("loss", w[:q], w[q:])
        log(f"loss window {j + 1}/{len(lstarts)}")
    taken = 0
    order = rng.permutation(args.n_passkey)  # depths in random order: a cut-off run keeps all
    for j in range(args.n_passkey):
        if args.budget_seconds and time.time() - t0 > args.budget_seconds:
            log(f"time budget reached after {taken} pass-key samples of each kind")
            break
        taken += 1
        d = (order[j] + 0.5) / args.n_passkey
        smp = tasks.make_passkey(pk_text, rng, args.ctx, n_keys=1, depth=d)
        run_sample("passkey_1", tasks.ids(smp.context), tasks.ids(smp.question), smp.answer,
                   smp.target_depth)
        smp = tasks.make_passkey(pk_text, rng, args.ctx, n_keys=3, colliding=True)
        run_sample("passkey_3", tasks.ids(smp.context), tasks.ids(smp.question), smp.answer)
        if (j + 1) % 5 == 0:
            log(f"pass-key samples {j + 1}/{args.n_passkey}")

    rows = []
    full_loss = float(np.mean(res[0]["loss"]))
    for i, (name, pol, _) in enumerate(grid):
        for corr in ([True, False] if pol.moments else [True]):
            r = res[i] if corr else res_nc[i]
            depth_bins = [[] for _ in range(5)]
            for d, v in res[i]["depth"]:
                depth_bins[min(4, int(d * 5))].append(v)
            row = {
                "policy": name, "scorer": pol.scorer, "ratio": pol.ratio,
                "head_budget": pol.head_budget, "key_codec": pol.key_codec,
                "value_codec": pol.value_codec, "moments": pol.moments,
                "correct": corr and pol.moments,
                "bytes_per_token": float(np.mean(res[i]["bytes"])),
                "x_vs_bf16": bf16_tok / float(np.mean(res[i]["bytes"])),
                "passkey_1": float(np.mean(r["passkey_1"])) if r["passkey_1"] else None,
                "passkey_3": float(np.mean(r["passkey_3"])) if r["passkey_3"] else None,
                "n_passkey": len(r["passkey_1"]),
                "depth_bins": ([float(np.mean(b)) if b else None for b in depth_bins]
                               if corr else None),
                "loss": float(np.mean(r["loss"])),
                "loss_vs_full_pct": 100.0 * (float(np.mean(r["loss"])) / full_loss - 1.0),
            }
            rows.append(row)
    meta = {
        "date": stamp, "commit": git_commit(), "backend": args.backend, "device": str(device),
        "card": card, "model": os.path.relpath(args.model, REPO) if args.model.startswith(REPO)
        else args.model, "ctx": args.ctx, "n_passkey": taken, "n_loss": args.n_loss,
        "n_calib": args.n_calib, "grid": args.grid, "bf16_bytes_per_token": bf16_tok,
        "heldout_files": [os.path.basename(p) for p in paths],
        "heldout_digest": tasks.digest(blobs), "python": platform.python_version(),
        "torch": torch.__version__, "seconds": time.time() - t0,
    }
    import transformers
    meta["transformers"] = transformers.__version__
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if not args.no_plot:
        write_md(out + ".md", meta, rows)
        plot(out + ".png", meta, rows)
    log(f"wrote {out}.json/.md/.png")


def run_variants(args):
    """The --variants grid (variants.py) on the same text regions, windows and sample draws
    as the kvcomp cells; writes PREFIX.json and PREFIX.md."""
    import variants
    import transformers
    from transformers import AutoModelForCausalLM
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ")
    out = args.out or os.path.join(REPO, "bench", "results", f"policy-research-{stamp}")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    model.eval()
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or \
        platform.machine()
    paths = tasks.heldout_files(args.heldout_dir)
    blobs = tasks.read_files(paths)
    text = tasks.concat(blobs)
    n = len(text)
    calib_text, loss_text, pk_text = text[: n // 10], text[n // 10: n // 4], text[n // 4:]
    rng = np.random.default_rng(args.seed)
    args._t0 = t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    log(f"variants: model {args.model} on {device} ({card}), ctx {args.ctx}, held-out "
        f"{len(paths)} files digest {tasks.digest(blobs)}")
    starts = np.linspace(0, len(calib_text) - args.ctx - 1, args.n_calib).astype(int)
    calib_ids = [torch.from_numpy(calib_text[s:s + args.ctx].astype(np.int64)) for s in starts]
    q = args.ctx * 3 // 4
    lstarts = np.linspace(0, len(loss_text) - args.ctx - 1, args.n_loss).astype(int)
    loss_windows = []
    for s in lstarts:
        w = torch.from_numpy(loss_text[s:s + args.ctx].astype(np.int64))
        loss_windows.append((w[:q], w[q:]))
    pk = []
    order = rng.permutation(args.n_passkey)
    for j in range(args.n_passkey):
        d = (order[j] + 0.5) / args.n_passkey
        smp = tasks.make_passkey(pk_text, rng, args.ctx, n_keys=1, depth=d)
        pk.append(("passkey_1", tasks.ids(smp.context), tasks.ids(smp.question),
                   tasks.ids(smp.answer)))
        smp = tasks.make_passkey(pk_text, rng, args.ctx, n_keys=3, colliding=True)
        pk.append(("passkey_3", tasks.ids(smp.context), tasks.ids(smp.question),
                   tasks.ids(smp.answer)))
    rows, taken = variants.run(model, args, loss_windows, pk, calib_ids, log,
                               N_bytes=len(pk[0][1]) if pk else args.ctx)
    meta = {
        "date": stamp, "commit": git_commit(), "device": str(device), "card": card,
        "model": os.path.relpath(args.model, REPO) if args.model.startswith(REPO)
        else args.model, "ctx": args.ctx, "n_passkey": taken // 2, "n_loss": args.n_loss,
        "n_calib": args.n_calib, "grid": args.variants,
        "bytes_ctx": len(pk[0][1]) if pk else args.ctx,
        "heldout_files": [os.path.basename(p) for p in paths],
        "heldout_digest": tasks.digest(blobs), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "seconds": time.time() - t0,
    }
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    variants.write_md(out + ".md", meta, rows)
    log(f"wrote {out}.json/.md")


def fmt(v, f=".2f"):
    return "-" if v is None else format(v, f)


def write_md(path, meta, rows):
    lines = [
        f"# Real-model quality: {meta['model']} ({meta['backend']} backend)",
        "",
        f"date {meta['date']}, commit {meta['commit']}, card/CPU {meta['card']}, torch "
        f"{meta['torch']}, transformers {meta.get('transformers')}, python {meta['python']}; "
        f"context {meta['ctx']} bytes; pass-key n = {meta['n_passkey']} per cell (1 key at "
        f"stratified depths; 3 keys with colliding names); loss = mean NLL (nats/byte) over the "
        f"last quarter of {meta['n_loss']} windows after compressing the first three quarters; "
        f"held-out text: {len(meta['heldout_files'])} standard-library files, digest "
        f"{meta['heldout_digest']}; bf16 cache = {meta['bf16_bytes_per_token']} bytes/token; "
        f"{meta['seconds']:.0f} s.",
        "",
        "| policy | ratio | correction | bytes/token | x vs bf16 | pass-key 1 | pass-key 3 "
        "(colliding) | 1-key by depth (0-20-40-60-80-100%) | loss | loss vs full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        db = " ".join(fmt(x, ".1f") for x in r["depth_bins"]) if r["depth_bins"] else ""
        corr = "on" if r["correct"] else ("off" if r["moments"] else "-")
        lines.append(
            f"| {r['policy']} | {r['ratio']} | {corr} | {r['bytes_per_token']:.0f} | "
            f"{r['x_vs_bf16']:.2f} | {fmt(r['passkey_1'])} | {fmt(r['passkey_3'])} | {db} | "
            f"{r['loss']:.4f} | {r['loss_vs_full_pct']:+.1f}% |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(path, meta, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    names = sorted({r["policy"] for r in rows})
    cmap = plt.get_cmap("tab20")
    for k, name in enumerate(names):
        for corr, mk in ((True, "o"), (False, "x")):
            rs = [r for r in rows if r["policy"] == name and (r["correct"] == corr or
                                                              (not r["moments"] and corr))]
            if not rs:
                continue
            rs.sort(key=lambda r: r["x_vs_bf16"])
            lab = name + ("" if corr else " (no corr.)")
            for ax, key in zip(axes, ("loss", "passkey_1", "passkey_3")):
                ax.plot([r["x_vs_bf16"] for r in rs], [r[key] for r in rs], marker=mk,
                        linestyle="-" if corr else ":", color=cmap(k), label=lab)
    for ax, t in zip(axes, ("held-out loss (nats/byte), lower is better",
                            "pass-key accuracy, 1 key", "pass-key accuracy, 3 colliding keys")):
        ax.set_xscale("log")
        ax.set_xlabel("compression vs the bf16 cache (x, every stored byte)")
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{meta['model']} at {meta['ctx']} bytes, {meta['backend']} backend, "
                 f"commit {meta['commit']}, {meta['card']}, {meta['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The quality harness: eviction quality per scorer x ratio x context on synthetic
caches (generator.py), with and without the MomentKV correction and the moment-aware rule.

Metrics, per (scorer, moment_aware, ratio, context), averaged over layers, heads and queries:
  needle_retention  fraction of planted needles (single and grouped) the eviction kept
  err_*_plain       relative L2 error of attention over the kept tokens only, against full
                    attention, for retrieval queries (retr) and generic queries (gen)
  err_*_corr        the same with the evicted set's virtual token (the correction)
Outputs: a CSV of every row, a Markdown table and a PNG plot of error against ratio per scorer.

Engine: the kvcomp Python module (kvcomp.compress, kvcomp.attention) when it imports, else the
NumPy reference (reference.py); --engine picks one. Usage:
  python3 bench/quality/run_quality.py                  # full run (minutes)
  python3 bench/quality/run_quality.py --smoke          # seconds: one small context
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import generator  # noqa: E402
import reference  # noqa: E402

RATIOS = (0.2, 0.3, 0.5, 0.7, 0.8, 0.9)
# context -> (layers, kv heads): long contexts use few heads to keep the run short.
CONTEXTS = {4096: (2, 4), 8192: (2, 4), 16384: (2, 2), 32768: (1, 2), 65536: (1, 2)}


class NumpyEngine:
    name = "numpy-reference"

    def compress(self, keys, values, scorer, ratio, moment_aware, layer):
        return reference.compress_layer(keys, values, scorer, ratio, moment_aware, layer=layer)

    def attention(self, queries, keys, values, comp, correct):
        return reference.layer_attention(queries, keys, values, comp, correct)


class KvcompEngine:
    """The real engine through the Python module: one layer per call (a 1-layer cache)."""

    name = "kvcomp"

    def __init__(self, backend: str = "cpu"):
        import kvcomp
        if not hasattr(kvcomp, "attention"):
            raise ImportError("this kvcomp build has no attention()")
        self.kv = kvcomp
        self.backend = backend

    def compress(self, keys, values, scorer, ratio, moment_aware, layer):
        hk = keys.shape[0]
        policy = self.kv.Policy(scorer=scorer, ratio=ratio, moments=True,
                                moment_aware=moment_aware, seed=layer,
                                recent_fraction=0.0)  # the scorer alone, as the reference
        return self.kv.compress(keys, values, policy, backend=self.backend,
                                num_q_heads=hk * generator.GeneratorParams().q_per_kv)

    def attention(self, queries, keys, values, comp, correct):
        if comp is None:
            return reference.layer_attention(queries, keys, values, None, False)
        out = self.kv.attention(queries, comp, 0, correct=correct, backend=self.backend)
        return np.asarray(out, np.float64)

    def kept(self, comp, h):
        return np.asarray(comp.kept_positions(0, h))


def rel_err(got, want):
    num = np.linalg.norm(got - want, axis=-1)
    den = np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
    return num / den


def run(args) -> List[Dict]:
    engine = pick_engine(args.engine)
    print(f"engine: {engine.name}", flush=True)
    params = generator.GeneratorParams()
    rows = []
    for ctx in args.contexts:
        layers, heads = CONTEXTS.get(ctx, (1, 2))
        params.num_kv_heads = heads
        data = [generator.generate_layer(params, ctx, seed=1000 * ctx + l) for l in range(layers)]
        full = [reference.layer_attention(L.queries, L.keys, L.values, None, False) for L in data]
        kinds = np.array(data[0].kinds)
        t0 = time.time()
        for scorer in args.scorers:
            for aware in args.moment_aware:
                for ratio in args.ratios:
                    acc = {"kept": 0, "needles": 0, "retr_plain": [], "retr_corr": [],
                           "gen_plain": [], "gen_corr": []}
                    for li, L in enumerate(data):
                        comp = engine.compress(L.keys, L.values, scorer, ratio, aware, li)
                        for nd in L.needles:
                            kept = engine.kept(comp, nd.head) if hasattr(engine, "kept") \
                                else comp.kept[nd.head]
                            acc["needles"] += 1
                            acc["kept"] += int(np.isin(nd.position, kept))
                        for correct, tag in ((False, "plain"), (True, "corr")):
                            out = engine.attention(L.queries, L.keys, L.values, comp, correct)
                            e = rel_err(out, full[li])  # [Hq, nq]
                            acc["retr_" + tag].append(e[:, kinds == "retrieval"].ravel())
                            acc["gen_" + tag].append(e[:, kinds == "generic"].ravel())
                    row = {"context": ctx, "scorer": scorer, "moment_aware": int(aware),
                           "ratio": ratio,
                           "needle_retention": acc["kept"] / max(acc["needles"], 1)}
                    for key in ("retr_plain", "retr_corr", "gen_plain", "gen_corr"):
                        row["err_" + key] = float(np.mean(np.concatenate(acc[key])))
                    # Fraction of queries the correction made worse.
                    for kind in ("retr", "gen"):
                        plain = np.concatenate(acc[kind + "_plain"])
                        corr = np.concatenate(acc[kind + "_corr"])
                        row["worse_" + kind] = float(np.mean(corr > plain * (1 + 1e-6)))
                    rows.append(row)
        print(f"context {ctx}: {layers} layers x {heads} kv heads, {time.time() - t0:.1f} s",
              flush=True)
    return rows


def pick_engine(name):
    if name in ("auto", "kvcomp"):
        try:
            return KvcompEngine()
        except Exception as e:  # ImportError, or a module without compress/attention yet
            if name == "kvcomp":
                raise
            print(f"kvcomp module unavailable ({e}); using the NumPy reference", flush=True)
    return NumpyEngine()


def git_commit():
    try:
        return subprocess.check_output(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                                       text=True).strip()
    except Exception:
        return "unknown"


def write_outputs(rows, args, engine_name):
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    base = os.path.splitext(args.out)[0]
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.5f}" if isinstance(v, float) else v) for k, v in r.items()})
    date = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Quality harness: {date}", "",
             f"commit {git_commit()}, engine {engine_name}, machine {platform.node()} "
             f"({os.cpu_count()} CPUs), contexts {list(args.contexts)}, "
             f"`{' '.join(sys.argv[1:]) or '(defaults)'}`", "",
             "Relative L2 error of attention against full attention, mean over queries; "
             "plain = kept tokens only, corr = with the MomentKV virtual token. "
             "ma = moment-aware eviction (docs/moment_aware.md). Averaged over contexts.", "",
             "worse = fraction of queries whose error the correction increased.", "",
             "| scorer | ma | ratio | needles kept | retr plain | retr corr | gen plain | "
             "gen corr | worse retr | worse gen |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["scorer"], r["moment_aware"], r["ratio"]) for r in rows},
                  key=lambda k: (args.scorers.index(k[0]), k[1], k[2]))
    for s, ma, ratio in keys:
        sel = [r for r in rows if (r["scorer"], r["moment_aware"], r["ratio"]) == (s, ma, ratio)]
        m = {k: np.mean([r[k] for r in sel]) for k in sel[0]
             if k.startswith(("err", "needle", "worse"))}
        lines.append(f"| {s} | {ma} | {ratio:.1f} | {m['needle_retention']:.3f} | "
                     f"{m['err_retr_plain']:.4f} | {m['err_retr_corr']:.4f} | "
                     f"{m['err_gen_plain']:.4f} | {m['err_gen_corr']:.4f} | "
                     f"{m['worse_retr']:.3f} | {m['worse_gen']:.3f} |")
    lines += ["", "Per context: see the CSV next to this file.", ""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))
    plot(rows, args, base + ".png")
    print("\n".join(lines))
    print(f"wrote {base}.md, {base}.csv, {base}.png")


def plot(rows, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, kind, title in ((axes[0], "gen", "generic queries"),
                            (axes[1], "retr", "retrieval queries")):
        for i, s in enumerate(args.scorers):
            for tag, style in (("plain", ":"), ("corr", "-")):
                sel = [r for r in rows if r["scorer"] == s and r["moment_aware"] == 0]
                ratios = sorted({r["ratio"] for r in sel})
                ys = [np.mean([r[f"err_{kind}_{tag}"] for r in sel if r["ratio"] == x])
                      for x in ratios]
                ax.plot(ratios, ys, style, color=colors[i % len(colors)], marker="o",
                        markersize=3, label=f"{s} ({'corrected' if tag == 'corr' else 'plain'})")
        ax.set_yscale("log")
        ax.set_xlabel("eviction ratio")
        ax.set_ylabel("relative error vs full attention")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle("MomentKV quality harness: error vs ratio per scorer (mean over contexts)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--scorers", default=",".join(reference.SCORERS))
    ap.add_argument("--moment-aware", default="0,1", help="0, 1 or 0,1")
    ap.add_argument("--engine", default="auto", choices=("auto", "kvcomp", "numpy"))
    ap.add_argument("--out", default=os.path.join(HERE, "..", "results", "quality.md"))
    ap.add_argument("--smoke", action="store_true", help="one 2K context, two ratios, no outputs")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.ratios = [float(x) for x in args.ratios.split(",")]
    args.scorers = args.scorers.split(",")
    args.moment_aware = [bool(int(x)) for x in args.moment_aware.split(",")]
    if args.smoke:
        args.contexts, args.ratios = [2048], [0.5, 0.9]
    rows = run(args)
    if args.smoke:
        for r in rows:
            print(r)
        return 0
    write_outputs(rows, args, pick_engine(args.engine).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

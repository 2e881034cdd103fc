"""Tables and pictures of a serve.py run: PREFIX.json, PREFIX.md, PREFIX.png.

    python3 bench/serving/report.py PREFIX.json     # writes PREFIX.md and PREFIX.png again
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional

import numpy as np


def _ms(x):
    return "-" if x is None or x != x else f"{x * 1e3:.0f}"


REPLAYS = (("rates", "put blocking the worker"), ("rates_overlapped", "put overlapped"))


def knee_rate(d: Dict, table: str = "rates") -> Optional[float]:
    """The lowest rate at which the raw store serves < 90% of requests within SLO."""
    raw = d["arms"].get("raw", {})
    for row in raw.get(table, []):
        if row["within"] < 0.9 * row["total"]:
            return row["rate"]
    return None


def summary(d: Dict) -> List[str]:
    """The issue's targets read off the run."""
    out = []
    arms = d["arms"]
    for table, name in REPLAYS:
        k = knee_rate(d, table)
        if k is None:
            out.append(f"- {name}: the raw store stays at >= 90% within SLO at every rate run")
            continue

        def within(arm):
            for row in arms.get(arm, {}).get(table, []):
                if row["rate"] == k:
                    return row["within"]
            return None
        raw = within("raw")
        for arm, target in (("evict", 1.5), ("codec", 1.2)):
            v = within(arm)
            if v is None:
                continue
            x = v / raw if raw else float("inf")
            out.append(f"- {name}, at {k:.3g} req/s (the lowest rate where the raw store is "
                       f"below 90% within SLO): {arm} {v} vs raw {raw} within SLO = {x:.2f}x "
                       f"(target {target}x: {'met' if x >= target else 'missed'})")
    for arm, info in arms.items():
        for p in info.get("probes", []):
            h = p["hit"]
            frac = h["ttft_s"] / p["recompute_s"]
            if h["hit"] != "full":
                out.append(f"- {arm}, probe at {p['tokens']} tokens: not a full hit when asked "
                           f"again ({h['fetched']} of {h['chunks']} chunks held): no figure")
                continue
            out.append(f"- {arm}, full hit at {p['tokens']} tokens: first token in "
                       f"{h['ttft_s'] * 1e3:.0f} ms = {frac * 100:.0f}% of recompute "
                       f"({p['recompute_s'] * 1e3:.0f} ms; target <= 20%: "
                       f"{'met' if frac <= 0.2 else 'missed'}); lookup {_ms(h['lookup_s'])}, "
                       f"transfer {_ms(h['transfer_s'])}, decode/expand {_ms(h['expand_s'])}, "
                       f"first token {_ms(h['prefill_s'])} ms")
    return out


def markdown(d: Dict) -> str:
    m = d["meta"]
    L = [f"# Serving replay: {m['model']} on {m['card']}, {m['date']}, commit {m['commit']}", "",
         *([f"**Partial record** (written after an arm; {m['partial']}).", ""]
           if m.get("partial") else []),
         f"- trace: seed {m['trace'].get('seed')}, {m['requests']} requests, "
         f"{m['trace'].get('min_tokens')}-{m['trace'].get('max_tokens')} tokens "
         f"(workload.py; multi-turn chats and agent loops, Zipf {m['trace'].get('zipf')} "
         f"documents); chunk {m['chunk']} tokens",
         f"- stored-cache memory, every store arm: "
         + ("unbounded" if not m["capacity_bytes"] else
            f"{m['capacity_bytes'] / 2**30:.2f} GiB (GPU tier {m['device_tier_bytes'] / 2**30:.2f}"
            f" GiB + host tier {m['host_tier_bytes'] / 2**30:.2f} GiB + RocksDB tier "
            f"{m.get('disk_tier_bytes', 0) / 2**20:.0f} MiB)")
         + f" against a raw working set of {m['working_set_bytes'] / 2**30:.2f} GiB "
         f"({m['working_set_tokens']} tokens)",
         f"- SLO: TTFT <= {m['slo_factor']} x unloaded prefill of the same length; unloaded "
         "prefill " + ", ".join(f"{n}: {s * 1e3:.0f} ms" for n, s in
                               zip(m["slo_grid"], m["unloaded_prefill_s"])),
         f"- rates replayed on a virtual clock over each arm's measured service times "
         f"(serve.py's docstring); torch {m['torch']}; wall {m['wall_s']:.0f} s", ""]
    L += ["## Targets", ""] + summary(d) + [""]
    L += ["## Per arm", "",
          "| arm | requests | full / partial / miss | bytes stored by puts | held at end | "
          "service TTFT p50 ms | busy mean ms | put mean ms | decode step ms | "
          "device cache MiB (hits) | error |",
          "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for arm, info in d["arms"].items():
        svc = info.get("service", [])
        hits = [s["hit"] for s in svc]
        steps = [t for s in svc for t in s["decode_steps_s"]]
        dcb = [s["device_cache_bytes"] for s in svc if s["fetched"]]
        held = info.get("held", {})
        L.append(
            f"| {info['label']} | {len(svc)} | {hits.count('full')} / {hits.count('partial')} / "
            f"{hits.count('miss')} | {sum(s['stored_bytes'] for s in svc) / 2**30:.2f} GiB | "
            f"{held.get('stored_bytes', 0) / 2**30:.2f} GiB, {held.get('caches', 0)} caches | "
            f"{_ms(np.median([s['ttft_s'] for s in svc]) if svc else None)} | "
            f"{_ms(np.mean([s['busy_s'] for s in svc]) if svc else None)} | "
            f"{_ms(np.mean([s['put_s'] for s in svc]) if svc else None)} | "
            f"{np.median(steps) * 1e3:.1f} | " if steps else
            f"| {info['label']} | {len(svc)} | - | - | - | - | - | - | - | ")
        if not steps:
            L[-1] += "- | "
        L[-1] += f"{np.mean(dcb) / 2**20:.0f} | " if dcb else "- | "
        L[-1] += f"{info.get('error', '')} |"
    for table, name in REPLAYS:
        L += ["", f"## TTFT and requests within SLO per arrival rate ({name})", "",
              "| arm | rate req/s | TTFT p50 ms | p90 ms | p99 ms | within SLO | outside |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for arm, info in d["arms"].items():
            if table == "rates_overlapped" and arm == "recompute":
                continue  # nothing to put: the same as above
            for row in info.get(table, []):
                L.append(f"| {arm} | {row['rate']:.3g} | {_ms(row['p50'])} | {_ms(row['p90'])} | "
                         f"{_ms(row['p99'])} | {row['within']}/{row['total']} "
                         f"({100 * row['within'] / max(1, row['total']):.0f}%) | "
                         f"{row['outside']} |")
    L += ["", "## A hit's time (mean over the trace's hits)", "",
          "| arm | hits | lookup ms | transfer ms | decode/expand ms | prefill of the rest + first "
          "token ms | TTFT ms | put of new chunks ms |", "| --- | ---: | ---: | ---: | ---: | "
          "---: | ---: | ---: |"]
    for arm, info in d["arms"].items():
        hs = [s for s in info.get("service", []) if s["fetched"]]
        if not hs:
            continue
        f = lambda k: np.mean([s[k] for s in hs])  # noqa: E731
        L.append(f"| {arm} | {len(hs)} | {_ms(f('lookup_s'))} | {_ms(f('transfer_s'))} | "
                 f"{_ms(f('expand_s'))} | {_ms(f('prefill_s'))} | {_ms(f('ttft_s'))} | "
                 f"{_ms(f('put_s'))} |")
    probes = [(arm, p) for arm, info in d["arms"].items() for p in info.get("probes", [])]
    if probes:
        L += ["", "## Full-hit probes (one prompt put, then asked again twice: the warm hit is "
              "the second)", "",
              "| arm | tokens | recompute ms | miss: TTFT / put ms | first hit TTFT ms | "
              "warm hit: chunks held | lookup | transfer | decode/expand | first token | TTFT ms "
              "| / recompute |",
              "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for arm, p in probes:
            h, mi = p["hit"], p["miss"]
            fh = p.get("first_hit")
            L.append(f"| {arm} | {p['tokens']} | {_ms(p['recompute_s'])} | {_ms(mi['ttft_s'])} / "
                     f"{_ms(mi['put_s'])} | {_ms(fh['ttft_s']) if fh else '-'} | "
                     f"{h['fetched']} of {h['chunks']} | {_ms(h['lookup_s'])} | "
                     f"{_ms(h['transfer_s'])} | {_ms(h['expand_s'])} | {_ms(h['prefill_s'])} | "
                     f"{_ms(h['ttft_s'])} | {100 * h['ttft_s'] / p['recompute_s']:.0f}% |")
    if d.get("quality"):
        L += ["", "## Quality (the trained model, docs/model-card.md; kvcomp.hf, same policies)",
              "", "| arm | pass-key | n | loss nats/byte | n windows | bytes/token |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for arm, q in d["quality"].items():
            L.append(f"| {arm} | {q['passkey']:.2f} | {q['n_passkey']} | {q['loss']:.3f} | "
                     f"{q['n_loss']} | {q['bytes_per_token']:.0f} |")
    if m.get("note"):
        L.append(f"\nNote: {m['note']}")
    for arm, info in d["arms"].items():
        if info.get("calibration"):
            L.append(f"\n{arm}: KVSplice calibration on the daemon "
                     f"{info['calibration']['seconds']:.1f} s: {info['calibration']['result']}")
    return "\n".join(L) + "\n"


def plot(path: str, d: Dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = d["meta"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
    k = knee_rate(d) or (m["rates"][len(m["rates"]) // 2] if m["rates"] else None)
    colors = {a: f"C{i}" for i, a in enumerate(d["arms"])}
    for arm, info in d["arms"].items():
        for row in info.get("rates", []):
            if row["rate"] == k:
                x = np.sort(row["ttft"])
                a1.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=arm,
                        color=colors.get(arm))
        for table, style in (("rates", "-"), ("rates_overlapped", "--")):
            rs = info.get(table, [])
            if not rs or (table == "rates_overlapped" and arm == "recompute"):
                continue
            a2.plot([r["rate"] for r in rs], [100 * r["within"] / max(1, r["total"]) for r in rs],
                    marker="o", ls=style, color=colors.get(arm),
                    label=arm + (" (put overlapped)" if style == "--" else ""))
    a1.set_xscale("log")
    a1.set_xlabel("TTFT (s)")
    a1.set_ylabel("fraction of requests")
    a1.set_title(f"TTFT CDF at {k:.3g} req/s (put blocking)" if k else "TTFT CDF")
    a1.grid(alpha=0.3)
    if a1.get_legend_handles_labels()[0]:
        a1.legend()
    a2.set_xlabel("arrival rate (req/s)")
    a2.set_ylabel(f"% requests with TTFT <= {m['slo_factor']}x unloaded prefill")
    a2.set_title("requests within SLO")
    a2.axhline(90, color="grey", lw=0.8, ls="--")
    a2.set_ylim(0, 102)
    a2.grid(alpha=0.3)
    if a2.get_legend_handles_labels()[0]:
        a2.legend(fontsize=7)
    fig.suptitle(f"{m['model']} on {m['card']}, {m['date']}, {m['commit']}; stored-cache memory "
                 f"{m['capacity_bytes'] / 2**30:.1f} GiB", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(prefix: str, d: Dict) -> None:
    with open(prefix + ".json", "w") as f:
        json.dump(d, f, indent=1, default=float)
    with open(prefix + ".md", "w") as f:
        f.write(markdown(d))
    try:
        plot(prefix + ".png", d)
    except ImportError as e:  # matplotlib missing: tables only
        print(f"report: no picture ({e})", file=sys.stderr)


if __name__ == "__main__":
    src = sys.argv[1]
    base = src[:-5] if src.endswith(".json") else src
    with open(src) as f:
        data = json.load(f)
    with open(base + ".md", "w") as f:
        f.write(markdown(data))
    plot(base + ".png", data)

#!/usr/bin/env python3
"""Pools several bench/storage/run.sh result files (.jsonl) and prints, per case, the median of
every repetition of the RocksDB tier and of db_bench, and their ratio. On a loaded machine single
runs scatter by up to 2x; the pooled median is the steadier figure.
   python3 bench/storage/summarize.py bench/results/storage-*.jsonl"""
import json
import statistics
import sys

rows = [json.loads(l) for f in sys.argv[1:] for l in open(f) if l.strip()]
print("| WAL | value | tier put | db_bench put | ratio | tier get | db_bench get | ratio | runs |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for sync in (0, 1):
    for size, name in ((65536, "64 KiB"), (1048576, "1 MiB"), (16777216, "16 MiB")):
        cells, n = [], 0
        for op in ("put", "get"):
            pick = lambda b: [r["gb_per_s"] for r in rows
                              if r["bench"] == b and r["value_size"] == size and r["sync"] == sync]
            t, d = pick(f"rocksdb_tier_{op}"), pick(f"db_bench_{op}")
            if not t or not d:
                cells += ["-", "-", "-"]
                continue
            mt, md = statistics.median(t), statistics.median(d)
            cells += [f"{mt:.3f}", f"{md:.3f}", f"{100 * mt / md:.0f}%"]
            n = len(t)
        print(f"| {'synced' if sync else 'not synced'} | {name} | " + " | ".join(cells) + f" | {n} |")

"""`make demo`: kvcompd on its embedded defaults, a prefill client pushing a Llama-3.1-8B-shaped
cache block by block, a decode client fetching it and measuring attention with and without the
moment correction, then a clean stop. Twice: A evicts (manifold + MomentKV); B also encodes what
it keeps with KVSplice, on a projection the daemon calibrated (through the SDK) from an earlier
request of the same model.

Usage: python3 bench/demo/demo.py KVCOMPD [--tokens N] [--block B] [--ratio R]
           [--calibration-tokens N] [--error-budget E]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The package `make demo` built in its own build directory (scripts/demo.sh), else the source
# tree's (where `make build` puts the extension).
sys.path.insert(0, os.environ.get("KVCOMP_DEMO_PYTHONPATH")
                or os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "bench", "quality"))

import kvcomp  # noqa: E402
from generator import GeneratorParams, generate_layer  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
T_START = time.perf_counter()


def step(text: str) -> None:
    """One line per step of the demo, with the seconds since it started."""
    print(f"-- [{time.perf_counter() - T_START:6.1f} s] {text}", flush=True)
LAYERS, KV_HEADS, Q_PER_KV, HEAD_DIM = 32, 8, 4, 128


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvcompd exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("kvcompd did not become ready")


def metrics(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def full_attention(q, k, v):
    """Exact attention in float64: q [Hq, n, d], k/v [Hk, N, d] -> [Hq, n, d]."""
    g = q.shape[0] // k.shape[0]
    out = np.empty(q.shape, np.float64)
    t = 1.0 / np.sqrt(q.shape[-1])
    for h in range(q.shape[0]):
        kk, vv = k[h // g].astype(np.float64), v[h // g].astype(np.float64)
        logits = t * q[h].astype(np.float64) @ kk.T
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        out[h] = p @ vv
    return out


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kvcompd")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--calibration-tokens", type=int, default=1024)
    ap.add_argument("--error-budget", type=float, default=0.1)
    args = ap.parse_args()

    data = tempfile.mkdtemp(prefix="kvcomp-demo-")
    # The log outlives the data directory (removed at the end): a small file beside it.
    log = open(data + ".kvcompd.log", "w")
    # Embedded defaults: no configuration file and no flags (CPU backend on a machine without a
    # GPU, host tier + RocksDB under ./.kvcomp-data, ports 7470/7471/7472 on 127.0.0.1). Run in a
    # scratch directory so the demo leaves nothing behind.
    step(f"starting kvcompd on its embedded defaults (data in {data})")
    proc = subprocess.Popen([os.path.abspath(args.kvcompd)], cwd=data, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_ready(7472, proc)
        step("kvcompd ready on 127.0.0.1:7470 (data), 7471 (control), 7472 (metrics)")
        return run(args)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
                print(f"\nkvcompd stopped cleanly (SIGTERM, exit code {code}); "
                      f"log: {log.name}")
            except subprocess.TimeoutExpired:
                proc.kill()
                print("kvcompd did not stop within 30 s; killed")
        shutil.rmtree(data, ignore_errors=True)
        step(f"demo data removed ({data})")


def bf16(x):
    """bf16 as the serving engine holds it (raw bits in uint16), rounded to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def from_bf16(x):
    return (x.astype(np.uint32) << 16).view(np.float32)


def generate(p, tokens, seed0, layers=LAYERS):
    """One request's cache: per layer (keys bf16, values bf16, the generator's Layer). Layer i's
    subspaces come from basis seed 5000 + i, so every request shares the "model's" subspaces."""
    params = [dataclasses.replace(p, basis_seed=5000 + i) for i in range(layers)]
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count()) as pool:
        out = list(pool.map(generate_layer, params, [tokens] * layers,
                            [seed0 + i for i in range(layers)]))
    return [bf16(l.keys) for l in out], [bf16(l.values) for l in out], out


def push(client, key, keys16, vals16, tokens, block, policy):
    with client.put_stream(MODEL, key, layers=LAYERS, kv_heads=KV_HEADS,
                           q_heads=KV_HEADS * Q_PER_KV, head_dim=HEAD_DIM, tokens=tokens,
                           dtype="bf16", policy=policy) as s:
        for b0 in range(0, tokens, block):
            b1 = min(tokens, b0 + block)
            for i in range(LAYERS):
                s.append(i, np.ascontiguousarray(keys16[i][:, b0:b1]),
                         np.ascontiguousarray(vals16[i][:, b0:b1]), token_begin=b0)
    return s.result


def attention_errors(cache, layers, keys16, vals16):
    """Mean relative attention-output error against exact attention over the full cache, for
    retrieval and generic queries, with and without the moment correction (every 4th layer)."""
    errs = {"retrieval": ([], []), "generic": ([], [])}
    for i in range(0, LAYERS, 4):
        l = layers[i]
        want = full_attention(l.queries, from_bf16(keys16[i]), from_bf16(vals16[i]))
        with_m = kvcomp.attention(l.queries, cache, i, correct=True)
        without = kvcomp.attention(l.queries, cache, i, correct=False)
        for kind in ("retrieval", "generic"):
            idx = [j for j, k in enumerate(l.kinds) if k == kind]
            errs[kind][0].append(rel_err(with_m[:, idx], want[:, idx]))
            errs[kind][1].append(rel_err(without[:, idx], want[:, idx]))
    return {k: (float(np.mean(a)), float(np.mean(b))) for k, (a, b) in errs.items()}


class Stages:
    """Daemon stage seconds between two points (the metrics are cumulative)."""

    NAMES = ("receive", "compress", "encode", "store", "serve")

    def __init__(self):
        self.last = self._read()

    @staticmethod
    def _read():
        m = metrics(7472)
        return {n: m.get(f'kvcomp_stage_duration_seconds_sum{{stage="{n}"}}', float("nan"))
                for n in Stages.NAMES}

    def delta(self):
        now = self._read()
        d = {n: now[n] - self.last[n] for n in self.NAMES}
        self.last = now
        return d


def run(args) -> int:
    p = GeneratorParams(head_dim=HEAD_DIM, num_kv_heads=KV_HEADS, q_per_kv=Q_PER_KV)
    n = args.tokens
    # manifold alone (no recent window): the selection the demo's figures were measured with
    evict = kvcomp.Policy(scorer="manifold", ratio=args.ratio, moments=True, recent_fraction=0.0)
    splice = kvcomp.Policy(scorer="manifold", ratio=args.ratio, moments=True, recent_fraction=0.0,
                           key_codec="int8", value_codec="orthogonal_int8")
    print(f"kvcomp demo: {MODEL}-shaped cache, {LAYERS} layers x {KV_HEADS} kv heads x "
          f"{n} tokens x head_dim {HEAD_DIM}, bf16")
    print(f"  A: manifold eviction, ratio {args.ratio}, + MomentKV moments")
    print(f"  B: A + KVSplice (int8 keys; values on a projection calibrated on an earlier "
          f"request, int8 latents, per-layer ranks at relative value error "
          f"{args.error_budget})")

    step("generating both requests' caches")
    t0 = time.perf_counter()
    keys16, vals16, layers = generate(p, n, 1000)
    cal_k, cal_v, _ = generate(p, args.calibration_tokens, 2000)
    t_gen = time.perf_counter() - t0

    # The demo fetches whole 4096-token caches, which the daemon decodes on the CPU: on a busy
    # 2-core machine one get takes longer than the client's serving default of 10 s.
    prefill = kvcomp.Client("127.0.0.1:7470,127.0.0.1:7471", get_timeout=300.0)
    decode = kvcomp.Client("127.0.0.1:7470,127.0.0.1:7471", get_timeout=300.0)
    stages = Stages()

    # An earlier request of the same model, stored with raw values, is what the daemon
    # calibrates on; the demo request is new data.
    step("an earlier request of the model, then calibration (KVSplice) on it")
    t0 = time.perf_counter()
    push(prefill, "earlier-request", cal_k, cal_v, args.calibration_tokens, args.block, evict)
    cal = prefill.calibrate(MODEL, error_budget=args.error_budget)[0]
    t_cal = time.perf_counter() - t0
    if not cal["ok"]:
        raise RuntimeError(f"calibration failed: {cal['error']}")
    stages.delta()

    col = {}
    for name, key, policy in (("A", "demo-request-A", evict), ("B", "demo-request-B", splice)):
        step(f"request {name}: put block by block, get, attention against the full cache")
        t0 = time.perf_counter()
        put = push(prefill, key, keys16, vals16, n, args.block, policy)
        t_put = time.perf_counter() - t0
        t0 = time.perf_counter()
        decode.get(MODEL, key)  # as stored: what a decode node transfers
        t_get = time.perf_counter() - t0
        cache = decode.get(MODEL, key, decoded=True)  # the daemon decodes KVSplice
        look = decode.lookup(MODEL, key)
        codecs = kvcomp.cache_codecs(decode.get(MODEL, key))
        t0 = time.perf_counter()
        errs = attention_errors(cache, layers, keys16, vals16)
        t_att = time.perf_counter() - t0
        col[name] = dict(put=put, look=look, codecs=codecs, errs=errs, t_put=t_put,
                         t_get=t_get, t_att=t_att, stages=stages.delta())
        decode.delete(MODEL, key)
    decode.delete(MODEL, "earlier-request")

    def row(label, f, fmt):
        print(f"{label:36}" + "".join(f"{format(f(col[c]), fmt):>16}" for c in ("A", "B")))

    print()
    print(f"{'':36}{'A: evict':>16}{'B: + KVSplice':>16}")
    row("original bytes (K+V, bf16)", lambda c: c["put"]["original_bytes"], ",")
    row("stored bytes (compressed)", lambda c: c["put"]["stored_bytes"], ",")
    row("ratio original/stored", lambda c: c["put"]["original_bytes"] / c["put"]["stored_bytes"],
        ".2f")
    row("memory saved",
        lambda c: c["put"]["original_bytes"] - c["put"]["stored_bytes"], ",")
    row("kept tokens (all heads)", lambda c: c["put"]["total_kept"], ",")
    row("  bytes: keys", lambda c: c["codecs"]["bytes"]["keys"] + c["codecs"]["bytes"]["key_scales"],
        ",")
    row("  bytes: values",
        lambda c: c["codecs"]["bytes"]["values"] + c["codecs"]["bytes"]["value_scales"], ",")
    row("  bytes: values kept raw (outliers)", lambda c: c["codecs"]["bytes"]["raw_values"], ",")
    row("  bytes: moments", lambda c: c["codecs"]["bytes"]["moments"], ",")
    row("  bytes: positions + header",
        lambda c: c["codecs"]["bytes"]["positions"] + c["codecs"]["bytes"]["header"], ",")
    print(f"{'tier':36}" + "".join(f"{col[c]['look']['tier']:>16}" for c in ("A", "B")))
    ranks = col["B"]["codecs"]["layer_rank"]
    print(f"{'value ranks per layer (B)':36}{min(ranks):>8} to {max(ranks):<6} "
          f"(calibrated on {cal['caches_used']} earlier request, value error "
          f"{cal['achieved_error']:.3f})")
    print()
    print("attention-output relative error (mean over 8 layers, against the full bf16 cache)")
    for kind in ("retrieval", "generic"):
        for i, corr in ((0, "with moments"), (1, "without moments")):
            row(f"  {kind} queries, {corr}", lambda c: c["errs"][kind][i], ".4f")
    print()
    print(f"{'seconds':36}{'A':>16}{'B':>16}")
    print(f"{'generate both requests (client)':36}{t_gen:>16.3f}")
    print(f"{'earlier request + calibrate':36}{t_cal:>16.3f}")
    row("push, block by block (client)", lambda c: c["t_put"], ".3f")
    for st in ("receive", "compress", "encode", "store"):
        row(f"  daemon: {st}", lambda c: c["stages"][st], ".3f")
    row("fetch as stored (client)", lambda c: c["t_get"], ".3f")
    row("  daemon: serve (all fetches)", lambda c: c["stages"]["serve"], ".3f")
    row("decode attention, 8 layers", lambda c: c["t_att"], ".3f")
    real_model_line(decode, evict)
    return 0


def real_model_line(client, policy, ctx=2048, n_passkey=6, n_loss=2):
    """The project's trained byte-level Llama (bench/quality/lm/model) through kvcomp.hf, its
    prompt cache making a round trip through this kvcompd under the demo's policy A: pass-key
    accuracy and held-out loss (last quarter after compressing three quarters), full cache
    beside it."""
    step("real model: the project's byte-level Llama through kvcomp.hf")
    # transformers' progress bars and notices stay out of the results.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import torch
        import kvcomp.hf as hf
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError as e:  # torch/transformers come with scripts/bootstrap.sh
        print(f"\nreal model: skipped ({e})")
        return
    sys.path.insert(0, os.path.join(REPO, "bench", "quality", "lm"))
    import tasks
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(os.path.join(REPO, "bench", "quality", "lm", "model"),
                                             dtype=torch.float32).eval()
    text = tasks.concat(tasks.read_files(tasks.heldout_files()))
    rng = np.random.default_rng(0)
    full = kvcomp.Policy(ratio=0.0, moments=False)
    hits = {"full": 0, "A": 0}
    loss = {"full": [], "A": []}
    for i in range(n_passkey):
        s = tasks.make_passkey(text, rng, ctx, depth=(i + 0.5) / n_passkey)
        pre = hf.prefill(model, tasks.ids(s.context))
        for name, pol in (("full", full), ("A", policy)):
            cache = hf.cache_from_prefill(model, pre, pol, client=client, model_id="demo/lm",
                                          cache_dtype=torch.bfloat16)
            got = hf.greedy(model, cache, pre.last_logits, tasks.ids(s.question), tasks.DIGITS)
            hits[name] += bytes(got.tolist()) == s.answer
    for o in np.linspace(0, len(text) - ctx - 1, n_loss).astype(int):
        w = torch.from_numpy(text[o:o + ctx].astype(np.int64))
        pre = hf.prefill(model, w[:ctx * 3 // 4])
        for name, pol in (("full", full), ("A", policy)):
            cache = hf.cache_from_prefill(model, pre, pol, client=client, model_id="demo/lm",
                                          cache_dtype=torch.bfloat16)
            loss[name].append(float(hf.continuation_nll(model, cache, pre.last_logits,
                                                        w[ctx * 3 // 4:]).mean()))
    print(f"\nreal model (bench/quality/lm/model, {ctx}-byte contexts, cache through kvcompd, "
          f"{time.perf_counter() - t0:.0f} s): policy A pass-key {hits['A']}/{n_passkey} "
          f"(full cache {hits['full']}/{n_passkey}), held-out loss {np.mean(loss['A']):.3f} "
          f"nats/byte (full cache {np.mean(loss['full']):.3f})")


if __name__ == "__main__":
    sys.exit(main())

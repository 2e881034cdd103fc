"""Trace replay of prefill and decode workers over kvcompd, per arm at equal stored-cache memory.

    python3 bench/serving/serve.py --trace trace.jsonl --model timing|trained --device cuda \
        --kvcompd build/service/kvcompd [--arms recompute,raw,codec,evict] \
        [--capacity-frac 0.35] [--chunk 512] [--rates auto] [--out PREFIX]

Only kvcomp's public interfaces are used: kvcompd is started from its command line (one fresh
daemon per arm), the Python SDK (kvcomp.Client) puts, looks up and fetches the prompt caches,
and kvcomp.hf measures the trained model's quality under each arm's policy.

Per request (one at a time, in trace order):
1. lookup: `lookup_prefix` over the prompt's chained chunk keys (workload.chunk_keys) says how
   many leading chunks the store holds (the recompute arm holds none);
2. fetch: the held chunks into device memory: on a GPU, a cache that kept every token by
   `get_into` (the dense get into the caller's CUDA memory, one call per chunk; the daemon
   densifies a lossless cache on the device and decodes a Hadamard-coded one there), a cache with
   evictions by its stored bytes: Hadamard-coded chunks one `get_bytes_into` each (the stored
   bytes into device memory over the GPU channel, parsed on the host), the others (and every
   cache on the CPU) by `get_chunks` (one request for the run, decoded by the daemon where the
   values are KVSplice-encoded or the keys int8 / int4); then decoded by `kvcomp.decompress` on
   the worker's device, into tensors of the model's dtype there (out=);
3. prefill the rest: the model runs over the tokens after the held chunks with the fetched
   keys and values as its past (positions continue from the original prompt's), giving the
   first token: TTFT's service part ends here;
4. put: the prompt's new whole chunks, from the model's cache in device memory
   (`put_chunks`: one put per chunk from device memory over the GPU channel where kvcompd
   offers it), under the arm's policy;
5. decode: N tokens attend over the fetched (kept) and new keys and values (every
   --decode-every'th request), each step timed.
The prefill worker is busy for 1-4 (the put included); decode runs on the decode side.

Rates: the store's state after each request depends only on the order of requests, not on
their timing, and the worker runs one request at a time, so each arm's trace is served once and
every arrival rate is replayed on a virtual clock over the measured service times: request i
arrives at workload.arrivals(rate)[i], starts when it has arrived and request i-1 has finished,
and its TTFT is its wait plus steps 1-3.

Two replays of the same service times: the put blocking the prefill worker (what put_chunks
does: the call returns once the chunks are stored) and the put overlapped with the next
requests (an engine's asynchronous store; the daemon's work is then off the worker).

SLO: TTFT <= --slo-factor (1.5) x the unloaded prefill of the same length on the same machine
(measured first over a grid of lengths, interpolated).

Probes: per store arm, on a daemon of its own whose tiers hold them, a prompt of each
--probe-lengths length is served three times (a miss that puts it, then two full hits: the
first meets the shapes for the first time, the second is the warm figure).

Arms at the same stored-cache memory (device tier + host tier capacities, no disk tier):
- recompute: no store;
- raw: ratio 0, raw keys, no value codec, no moments (an uncompressed offload store);
- codec: every token, the codecs only, the form an unmodified engine loads: the `codec`
  preset's shape with its codecs pinned to what a GPU engine encodes, Hadamard keys at 4 bits and
  values at 3 (hq4 / hq3, 4.27x). The preset itself is now the calibrated basis codec (pq k3v2,
  6.4x), which needs the model's pq calibration (a step the replay does not take): the arm stays
  the one the runs before measured (docs/research.md, "Presets");
- evict: the `balanced` preset (kvcomp.preset("balanced")): eviction paired with the codecs.
--rank sets the KVSplice rank of both where their values are KVSplice-coded (0: auto-tuned).
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
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
sys.path.insert(0, os.path.join(REPO, "bench", "quality", "lm"))

import kvcomp  # noqa: E402
import workload  # noqa: E402

ARMS = ("recompute", "raw", "codec", "evict")
ARM_LABEL = {"recompute": "recompute (no store)", "raw": "raw store (ratio 0, raw codecs)",
             "codec": "codec only (hq4 / hq3, the device codec)",
             "evict": "eviction + codec (preset balanced)"}
TRAINED = os.path.join(REPO, "bench", "quality", "lm", "model")


def arm_policy(arm: str, rank: int) -> Optional[kvcomp.Policy]:
    if arm == "recompute":
        return None
    if arm == "raw":
        return kvcomp.Policy(ratio=0.0, moments=False)
    if arm == "codec":
        # pinned to the Hadamard pair (the `codec` preset, pq, needs a calibration the replay
        # does not fit; the runs before measured this pair)
        return kvcomp.preset("codec", key_codec="hq4", value_codec="hq3")
    if arm == "evict":
        name = "balanced"
        p = kvcomp.preset(name)
        # --rank applies to KVSplice values only (the Hadamard codec keeps every dimension)
        return kvcomp.preset(name, rank=rank) if p.value_codec.startswith("orthogonal") else p
    raise ValueError(f"unknown arm {arm!r} (one of {', '.join(ARMS)})")


def lossless(p: Optional[kvcomp.Policy]) -> bool:
    return p is not None and p.ratio == 0 and p.key_codec == "raw" and p.value_codec == "none"


# --- models ---

def timing_model(device: str):
    """A random-weight model of Llama-3.1-8B's shape in bf16 (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval(), "llama-3.1-8b-shape-random-bf16"


def trained_model(device: str, dtype=torch.float32):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(TRAINED, dtype=dtype).to(device)
    model.set_attn_implementation("sdpa")
    return model.eval(), "kvcomp-byte-llama"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Worker:
    """The model side: prefill over a fetched past, first token, decode steps."""

    def __init__(self, model, device):
        from transformers import DynamicCache
        self.DynamicCache = DynamicCache
        self.model = model
        self.device = device
        c = model.config
        self.layers = c.num_hidden_layers
        self.kv_heads = c.num_key_value_heads
        self.q_heads = c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.vocab = c.vocab_size
        self.cache_dtype = torch.bfloat16
        self.raw_bytes_per_token = self.layers * self.kv_heads * self.head_dim * 2 * 2

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, past_k: Optional[List[torch.Tensor]],
                past_v: Optional[List[torch.Tensor]], pos0: int):
        """Runs the model over `ids` (1-D, on the device) after a past of per-layer keys/values
        [kv_heads, n, d] whose tokens stood at positions < pos0. Returns (cache, past length,
        first token id)."""
        m = ids.numel()
        if past_k is not None:
            cache = self.DynamicCache([(k[None].to(self.model.dtype), v[None].to(self.model.dtype))
                                       for k, v in zip(past_k, past_v)])
            plen = past_k[0].shape[1]
        else:
            cache = self.DynamicCache()
            plen = 0
        pos = torch.arange(pos0, pos0 + m, device=self.device)[None]
        cpos = torch.arange(plen, plen + m, device=self.device)
        out = self.model(input_ids=ids[None], past_key_values=cache, position_ids=pos,
                         cache_position=cpos, use_cache=True, logits_to_keep=1)
        tok = int(out.logits[0, -1].argmax())  # the host read waits for the device
        return cache, plen, tok

    @torch.no_grad()
    def decode(self, cache, first: int, pos: int, steps: int) -> List[float]:
        """`steps` greedy tokens after `first` at positions pos.., each step timed (s)."""
        times, tok = [], first
        for i in range(steps):
            t0 = time.perf_counter()
            plen = cache.get_seq_length()
            out = self.model(input_ids=torch.tensor([[tok]], device=self.device),
                             past_key_values=cache,
                             position_ids=torch.tensor([[pos + i]], device=self.device),
                             cache_position=torch.tensor([plen], device=self.device),
                             use_cache=True)
            tok = int(out.logits[0, -1].argmax())
            times.append(time.perf_counter() - t0)
        return times

    def kv_of(self, cache, begin: int, n: int):
        """Keys/values [layers, kv_heads, n, d] (contiguous, cache dtype) of positions
        begin..begin+n of a DynamicCache."""
        ks = torch.stack([cache.layers[l].keys[0, :, begin:begin + n] for l in range(self.layers)])
        vs = torch.stack([cache.layers[l].values[0, :, begin:begin + n]
                          for l in range(self.layers)])
        return ks.to(self.cache_dtype).contiguous(), vs.to(self.cache_dtype).contiguous()


# --- the daemon ---

def start_daemon(binary: str, device: torch.device, device_bytes: int, host_bytes: int,
                 disk_bytes: int):
    """A fresh kvcompd: memory-durable puts into the GPU tier (the host tier on a CPU), demoted
    to the host tier, then to a small RocksDB tier (KVSplice projections live there), evicted
    from it."""
    from kvcompd_fixture import Kvcompd
    gpu = device.type == "cuda"
    flags = ["--storage.durability=memory", "--storage.rocksdb_enabled=true",
             f"--storage.rocksdb_capacity_bytes={disk_bytes}",
             "--storage.verify_checksums_on_open=false",
             f"--storage.host_capacity_bytes={host_bytes}",
             f"--storage.device_capacity_bytes={device_bytes if gpu else 0}",
             f"--storage.put_tier={'device' if gpu and device_bytes else 'host'}",
             f"--engine.backend={'cuda' if gpu else 'cpu'}",
             "--data_plane.max_put_bytes=16Gi", "--data_plane.max_buffered_bytes=16Gi",
             "--storage.sweep_interval_seconds=0"]
    if gpu:
        flags += [f"--engine.cuda_device={device.index or 0}",
                  "--data_plane.gpu_transfer_timeout_seconds=120"]
    d = Kvcompd(binary, flags=flags, env={"NCCL_NVLS_ENABLE": "0"})
    d.__enter__()
    client = kvcomp.Client(f"{d.data_endpoint},127.0.0.1:{d.control_port}", timeout=300.0)
    return d, client


def held_bytes(client) -> Dict[str, float]:
    """Bytes and caches the daemon holds (its per-tenant statistics)."""
    out = {"stored_bytes": 0, "caches": 0}
    try:
        for s in client.stats():
            for k in ("stored_bytes", "bytes", "caches", "entries"):
                if k in s and isinstance(s[k], (int, float)):
                    out["stored_bytes" if k in ("stored_bytes", "bytes") else "caches"] += s[k]
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["error"] = str(e)
    return out


# --- one arm ---

class Arm:
    def __init__(self, name, worker: Worker, model_id, client, policy, chunk, decode_every,
                 new_tokens, vocab):
        self.name, self.w, self.model_id, self.c, self.policy = name, worker, model_id, client, \
            policy
        self.chunk, self.decode_every, self.new_tokens, self.vocab = chunk, decode_every, \
            new_tokens, vocab
        self.memo = {}
        self.put_results = []
        self.put_in_flight = 1
        self.bytes_buf = None  # device memory for stored chunks (fetch on a GPU)

    def keys_of(self, tokens: np.ndarray) -> List[str]:
        n = (len(tokens) - 1) // self.chunk  # the last token is always computed
        return workload.chunk_keys(tokens[: n * self.chunk], self.chunk, self.model_id)

    def fetch(self, keys: Sequence[str]):
        """The leading held chunks' keys/values on the device: per-layer lists [kv_heads, n, d],
        the chunks fetched, and (transfer s, expand s, bytes on the device)."""
        dev, w = self.w.device, self.w
        t0 = time.perf_counter()
        if dev.type == "cuda" and self.policy.ratio == 0:
            bufs = []
            for key in keys:
                k = torch.empty((w.layers, w.kv_heads, self.chunk, w.head_dim),
                                dtype=w.cache_dtype, device=dev)
                v = torch.empty_like(k)
                try:
                    self.c.get_into(self.model_id, key, k, v, num_q_heads=w.q_heads)
                except KeyError:  # evicted since the lookup: the run ends here
                    break
                bufs.append((k, v))
            sync(dev)
            t1 = time.perf_counter()
            if not bufs:
                return None, None, 0, (t1 - t0, 0.0, 0)
            K = torch.cat([b[0] for b in bufs], dim=2)
            V = torch.cat([b[1] for b in bufs], dim=2)
            sync(dev)
            t2 = time.perf_counter()
            return list(K.unbind(0)), list(V.unbind(0)), len(bufs), \
                (t1 - t0, t2 - t1, 2 * K.numel() * K.element_size())
        # KVSplice values (and int8 / int4 keys) are decoded by the daemon, which holds the
        # projection; the Hadamard codecs need none and are fetched as stored (a quarter of the
        # bytes) and decoded on the worker's device (kvcomp.decompress into device tensors).
        decoded = self.policy.value_codec.startswith("orthogonal") or \
            self.policy.key_codec in ("int8", "int4")
        got = []
        if dev.type == "cuda" and not decoded:
            # On a GPU the stored bytes come into device memory (get_bytes_into: over the GPU
            # channel), their header and records to the host for the parse.
            if self.bytes_buf is None:
                raw_chunk = 2 * w.layers * w.kv_heads * self.chunk * w.head_dim * \
                    torch.finfo(w.cache_dtype).bits // 8
                self.bytes_buf = torch.empty(raw_chunk + (1 << 20), dtype=torch.uint8,
                                             device=dev)
            for key in keys:
                try:
                    r = self.c.get_bytes_into(self.model_id, key, self.bytes_buf)
                except KeyError:  # evicted since the lookup: the run ends here
                    break
                blob = self.bytes_buf[: r["bytes"]].cpu().numpy().tobytes()
                got.append(kvcomp.CompressedCache.from_bytes(blob))
        else:
            while len(got) < len(keys):
                part = self.c.get_chunks(self.model_id, list(keys[len(got):]), decoded=decoded)
                if not part:
                    break
                got += part
        t1 = time.perf_counter()
        if not got:
            return None, None, 0, (t1 - t0, 0.0, 0)
        ks, vs = [], []
        for cc in got:
            if len(set(cc.kept)) > 1:
                raise RuntimeError("chunk with per-head kept counts (AdaKV) not supported here")
            if dev.type == "cuda":  # decoded in place in the model's dtype, on the device
                shape = (w.layers, w.kv_heads, cc.kept[0], w.head_dim)
                k = torch.empty(shape, dtype=w.cache_dtype, device=dev)
                v = torch.empty_like(k)
                kvcomp.decompress(cc, backend="cuda", out=(k, v))
            else:
                k, v = (torch.from_numpy(np.asarray(a)) for a in kvcomp.decompress(cc))
            ks.append(k)
            vs.append(v)
        K = torch.cat(ks, dim=2).to(dev, w.cache_dtype)
        V = torch.cat(vs, dim=2).to(dev, w.cache_dtype)
        sync(dev)
        t2 = time.perf_counter()
        return list(K.unbind(0)), list(V.unbind(0)), len(got), \
            (t1 - t0, t2 - t1, 2 * K.numel() * K.element_size())

    def serve(self, req: Dict) -> Dict:
        w, dev = self.w, self.w.device
        tokens = workload.prompt_tokens(req["segments"], self.vocab, self.memo)
        T = len(tokens)
        keys = self.keys_of(tokens)
        ids = torch.from_numpy(tokens).to(dev)
        sync(dev)
        t0 = time.perf_counter()
        held = 0
        if self.policy is not None and keys:
            held = self.c.lookup_prefix(self.model_id, keys)
        t_lookup = time.perf_counter() - t0
        pk = pv = None
        fetched, xfer, expand, dev_bytes = 0, 0.0, 0.0, 0
        if held:
            pk, pv, fetched, (xfer, expand, dev_bytes) = self.fetch(keys[:held])
        pos0 = fetched * self.chunk
        t1 = time.perf_counter()
        cache, plen, first = w.prefill(ids[pos0:], pk, pv, pos0)
        t2 = time.perf_counter()
        ttft = t2 - t0
        # put the new whole chunks (prefill worker), from the device cache
        t_put = 0.0
        stored = 0
        if self.policy is not None and len(keys) > fetched:
            n_new = (len(keys) - fetched) * self.chunk
            k, v = w.kv_of(cache, plen, n_new)
            sync(dev)
            tp = time.perf_counter()
            res = self.c.put_chunks(self.model_id, keys[fetched:], k, v, self.chunk,
                                    policy=self.policy, num_q_heads=w.q_heads,
                                    max_in_flight=self.put_in_flight)
            t_put = time.perf_counter() - tp
            stored = sum(r.get("stored_bytes", 0) for r in res)
            self.put_results.append(res[0] if res else {})
            del k, v
        busy = time.perf_counter() - t0
        steps = []
        if self.decode_every and req["i"] % self.decode_every == 0 and self.new_tokens > 1:
            steps = w.decode(cache, first, T, self.new_tokens - 1)
        kind = "miss" if fetched == 0 else ("full" if fetched == len(keys) else "partial")
        return dict(i=req["i"], tokens=T, chunks=len(keys), held=held, fetched=fetched,
                    hit=kind, lookup_s=t_lookup, transfer_s=xfer, expand_s=expand,
                    prefill_s=t2 - t1, prefill_tokens=T - pos0, ttft_s=ttft, put_s=t_put,
                    busy_s=busy, stored_bytes=stored, past_tokens=plen,
                    device_cache_bytes=dev_bytes, decode_steps_s=steps, first_token=first)


# --- replay on a virtual clock ---

def replay(service: Sequence[Dict], requests: Sequence[Dict], rate: float,
           busy: str = "busy_s") -> Dict:
    """TTFTs of the arm's requests at `rate` (FIFO, one at a time): wait + service TTFT. The
    worker is held for `busy` of each request: "busy_s" (the put of its new chunks blocks the
    worker, as put_chunks does) or "ttft_s" (the put overlaps the next requests, as an engine's
    asynchronous store would)."""
    arr = workload.arrivals(requests, rate)
    free, ttfts = 0.0, []
    for a, s in zip(arr, service):
        start = max(a, free)
        ttfts.append(start - a + s["ttft_s"])
        free = start + s[busy]
    return dict(rate=rate, ttft=ttfts)


def pct(x, q):
    return float(np.percentile(x, q)) if len(x) else float("nan")


def slo_table(service, requests, rates, slo_of, busy="busy_s") -> List[Dict]:
    rows = []
    for r in rates:
        rp = replay(service, requests, r, busy)
        slo = [slo_of(s["tokens"]) for s in service]
        within = sum(1 for t, b in zip(rp["ttft"], slo) if t <= b)
        rows.append(dict(rate=r, p50=pct(rp["ttft"], 50), p90=pct(rp["ttft"], 90),
                         p99=pct(rp["ttft"], 99), within=within, outside=len(service) - within,
                         total=len(service), ttft=rp["ttft"]))
    return rows


def expected_held(requests, vocab, chunk, model_id) -> List[int]:
    """Leading chunks held per request by a store that keeps everything (no capacity bound)."""
    seen, out = set(), []
    for r in requests:
        t = workload.prompt_tokens(r["segments"], vocab)
        n = (len(t) - 1) // chunk
        keys = workload.chunk_keys(t[: n * chunk], chunk, model_id)
        h = 0
        while h < len(keys) and keys[h] in seen:
            h += 1
        out.append(h)
        seen.update(keys)
    return out


def working_set_tokens(requests, vocab, chunk, model_id) -> int:
    keys = set()
    for r in requests:
        t = workload.prompt_tokens(r["segments"], vocab)
        n = (len(t) - 1) // chunk
        keys.update(workload.chunk_keys(t[: n * chunk], chunk, model_id))
    return len(keys) * chunk


# --- quality (the trained model, kvcomp.hf) ---

def quality(arms: Sequence[str], device: str, n_passkey: int, n_loss: int, ctx: int,
            rank: int, seed: int = 7) -> Dict[str, Dict]:
    """Pass-key accuracy and held-out loss of the trained model under each arm's policy
    (kvcomp.hf, kvcomp's decode path with the MomentKV correction); recompute and raw read the
    full cache. The KVSplice projection is calibrated on held-out windows never evaluated."""
    import kvcomp.hf as hf
    import tasks
    dev = torch.device(device)
    model, _ = trained_model(dev)
    blobs = tasks.read_files(tasks.heldout_files())
    text = tasks.concat(blobs)
    n = len(text)
    calib, loss_text, pk_text = text[: n // 10], text[n // 10: n // 4], text[n // 4:]
    rng = np.random.default_rng(seed)
    backend = "cuda" if dev.type == "cuda" and kvcomp.cuda_available() else "cpu"
    starts = np.linspace(0, len(calib) - ctx - 1, 2).astype(int)
    proj = hf.calibrate(model, [torch.from_numpy(calib[s:s + ctx].astype(np.int64))
                                for s in starts], cache_dtype=torch.bfloat16, rank=rank)
    samples = [tasks.make_passkey(pk_text, rng, ctx) for _ in range(n_passkey)]
    lstarts = np.linspace(0, len(loss_text) - ctx - 1, n_loss).astype(int)
    out = {}
    for arm in arms:
        pol = arm_policy(arm, rank) or kvcomp.Policy(ratio=0.0, moments=False)
        needs = pol.value_codec.startswith("orthogonal")  # KVSplice needs the projection
        ok, nll, bpt = 0, [], []
        for s in samples:
            pre = hf.prefill(model, tasks.ids(s.context))
            cache = hf.cache_from_prefill(model, pre, pol, backend=backend,
                                          projection=proj if needs else None,
                                          cache_dtype=torch.bfloat16)
            ok += hf.greedy_matches(model, cache, pre.last_logits, tasks.ids(s.question),
                                    tasks.ids(s.answer))
            bpt.append(cache.bytes_per_token)
        for st in lstarts:
            w = torch.from_numpy(loss_text[st:st + ctx].astype(np.int64))
            cut = 3 * ctx // 4
            pre = hf.prefill(model, w[:cut])
            cache = hf.cache_from_prefill(model, pre, pol, backend=backend,
                                          projection=proj if needs else None,
                                          cache_dtype=torch.bfloat16)
            nll.append(float(hf.continuation_nll(model, cache, pre.last_logits, w[cut:]).mean()))
        out[arm] = dict(passkey=ok / max(1, len(samples)), n_passkey=len(samples),
                        loss=float(np.mean(nll)) if nll else float("nan"), n_loss=len(nll),
                        bytes_per_token=float(np.mean(bpt)) if bpt else float("nan"))
    return out


# --- main ---

def git_commit() -> str:
    if os.environ.get("KVCOMP_COMMIT"):
        return os.environ["KVCOMP_COMMIT"]
    try:
        c = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return (c or "unknown") + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--model", default="timing", choices=["timing", "trained"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kvcompd", default=None, help="kvcompd binary (default: the fixture's "
                    "search: $KVCOMPD, $KVCOMP_BUILD_DIR, build*/)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--chunk", type=int, default=512, help="tokens per stored chunk")
    ap.add_argument("--capacity-frac", type=float, default=0.35,
                    help="stored-cache memory (device + host tier) as a fraction of the raw "
                         "working set; 0 = unbounded")
    ap.add_argument("--device-share", type=float, default=0.5,
                    help="share of that memory in the GPU tier (the rest in the host tier)")
    ap.add_argument("--rank", type=int, default=64, help="KVSplice latent rank")
    ap.add_argument("--rates", default="auto", help="req/s, comma-separated, or auto: "
                    "multiples of the recompute arm's service rate")
    ap.add_argument("--slo-factor", type=float, default=1.5)
    ap.add_argument("--slo-lengths", default="auto")
    ap.add_argument("--decode-every", type=int, default=4)
    ap.add_argument("--probe-lengths", default="", help="full-hit probe lengths, e.g. 8192,32768")
    ap.add_argument("--quality", default="", help="n_passkey,n_loss,ctx for the trained "
                    "model's quality column (empty: none)")
    ap.add_argument("--requests", type=int, default=0, help="first N requests of the trace")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    ap.add_argument("--put-in-flight", type=int, default=1, help="put_chunks' max_in_flight "
                    "(chunk puts in flight at once; 1: one after another)")
    ap.add_argument("--deadline-s", type=float, default=0, help="start no arm (and no quality "
                    "column) after this long since the start; the tables are written whatever "
                    "ran (0: none)")
    ap.add_argument("--budget-s", type=float, default=0, help="stop an arm's trace after this "
                    "long (0: none); every arm is cut to the shortest arm's count")
    a = ap.parse_args(argv)
    T0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)

    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    meta, requests = workload.read_trace(a.trace)
    if a.requests:
        requests = requests[: a.requests]
    arms = [x for x in a.arms.split(",") if x]
    for x in arms:
        arm_policy(x, a.rank)
    from kvcompd_fixture import find_kvcompd
    binary = a.kvcompd or find_kvcompd()
    if a.model == "timing":
        model, model_id = timing_model(str(dev))
    else:
        model, model_id = trained_model(dev)
    w = Worker(model, dev)
    vocab = min(w.vocab, meta.get("vocab", w.vocab))
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else \
        (platform.processor() or platform.machine())
    log(f"model {model_id} on {dev} ({card}); {len(requests)} requests, arms {arms}")

    # unloaded prefill over a grid of lengths: the SLO's reference
    lens = [r["tokens"] for r in requests]
    if a.slo_lengths == "auto":
        lo, hi = min(lens), max(lens + [int(x) for x in a.probe_lengths.split(",") if x])
        grid = sorted({int(x) for x in np.geomspace(lo, hi, 5).round()})
    else:
        grid = [int(x) for x in a.slo_lengths.split(",")]
    warm = torch.randint(1, vocab, (min(grid),), device=dev)
    w.prefill(warm, None, None, 0)
    prefill_s = []
    for n in grid:
        ts = []
        for _ in range(3):
            ids = torch.randint(1, vocab, (n,), device=dev)
            sync(dev)
            t = time.perf_counter()
            cache, _, _ = w.prefill(ids, None, None, 0)
            ts.append(time.perf_counter() - t)
            del cache
        prefill_s.append(float(np.median(ts)))
    log("unloaded prefill: " + ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in zip(grid, prefill_s)))

    def unloaded(n):
        return float(np.interp(n, grid, prefill_s)) if n <= grid[-1] else \
            prefill_s[-1] * n / grid[-1]

    def slo_of(n):
        return a.slo_factor * unloaded(n)

    ws_tokens = working_set_tokens(requests, vocab, a.chunk, model_id)
    ws_bytes = ws_tokens * w.raw_bytes_per_token
    # RocksDB holds the daemon's KVSplice projections; as a cache tier it is kept smaller than
    # a chunk (demoted chunks are evicted), and its bytes are counted in the stored-cache memory
    disk_bytes = 1 << 20
    if a.capacity_frac > 0:
        cap = int(a.capacity_frac * ws_bytes)
        dev_bytes = int((cap - disk_bytes) * a.device_share) if dev.type == "cuda" else 0
        host_bytes = cap - disk_bytes - dev_bytes
        if host_bytes <= 0:
            raise SystemExit(f"--capacity-frac {a.capacity_frac}: {cap} bytes leave no host tier")
    else:
        cap = 0
        dev_bytes, host_bytes = (1 << 40, 1 << 40) if dev.type == "cuda" else (0, 1 << 40)
    log(f"working set {ws_tokens} tokens = {ws_bytes / 2**30:.2f} GiB raw; stored-cache memory "
        f"{'unbounded' if not cap else f'{cap / 2**30:.2f} GiB'} (device {dev_bytes / 2**30:.2f}"
        f" GiB, host {host_bytes / 2**30:.2f} GiB, RocksDB {disk_bytes / 2**20:.0f} MiB)")
    expect = expected_held(requests, vocab, a.chunk, model_id)

    def past_deadline() -> bool:
        return bool(a.deadline_s) and time.perf_counter() - T0 > a.deadline_s

    def finish(results: Dict[str, Dict], final: bool) -> Dict:
        """Cuts every arm to the fewest requests served, replays the rates, (at the end) runs the
        quality column, and writes the record."""
        # equal request counts across arms (a budget may have cut one short)
        results = {x: dict(info) for x, info in results.items()}  # the arms' records stay whole
        ok = [x for x in results if "service" in results[x]]
        nmin = min((len(results[x]["service"]) for x in ok), default=0)
        reqs = requests[:nmin]
        for x in ok:
            results[x]["service"] = results[x]["service"][:nmin]
        if a.rates == "auto":
            base = "recompute" if "recompute" in ok else (ok[0] if ok else None)
            mean_busy = np.mean([s["busy_s"] for s in results[base]["service"]]) if base and nmin \
                else 1.0
            rates = [round(f / mean_busy, 4) for f in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)]
        else:
            rates = [float(x) for x in a.rates.split(",")]
        for x in ok:
            results[x]["rates"] = slo_table(results[x]["service"], reqs, rates, slo_of)
            results[x]["rates_overlapped"] = slo_table(results[x]["service"], reqs, rates, slo_of,
                                                       "ttft_s")
        qual = {}
        if final and a.quality and past_deadline():
            log(f"quality: not run, past --deadline-s {a.deadline_s:g}")
        elif final and a.quality:
            npk, nl, ctx = (int(v) for v in a.quality.split(","))
            tq = time.perf_counter()
            qual = quality(arms, str(dev), npk, nl, ctx, a.rank)
            log(f"quality ({time.perf_counter() - tq:.1f} s): " +
                "; ".join(f"{k}: pass-key {v['passkey']:.2f} loss {v['loss']:.3f}"
                          for k, v in qual.items()))
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ")
        out = dict(meta=dict(date=stamp, card=card, commit=git_commit(), model=model_id,
                             device=str(dev), trace=meta, requests=nmin, chunk=a.chunk,
                             put_in_flight=a.put_in_flight,
                             capacity_bytes=cap, device_tier_bytes=dev_bytes,
                             host_tier_bytes=host_bytes, disk_tier_bytes=disk_bytes,
                             working_set_tokens=ws_tokens,
                             working_set_bytes=ws_bytes, slo_factor=a.slo_factor,
                             slo_grid=grid, unloaded_prefill_s=prefill_s, rates=rates,
                             torch=torch.__version__, wall_s=time.perf_counter() - T0,
                             argv=sys.argv[1:] if argv is None else list(argv)),
                   expected_held=expect[:nmin], arms=results, quality=qual)
        if not final:  # written after each arm: a run cut short by its time limit keeps these
            left = ", ".join(x for x in arms if x not in results) or "none"
            out["meta"]["partial"] = f"arms not yet run: {left}; no quality column"
        if a.out:
            import report
            report.write(a.out, out)
            log(f"wrote {a.out}.json, .md, .png" + ("" if final else " (partial)"))
        return out

    results: Dict[str, Dict] = {}
    for arm in arms:
        pol = arm_policy(arm, a.rank)
        d = client = None
        info: Dict = dict(label=ARM_LABEL[arm], policy=None if pol is None else {
            f: getattr(pol, f) for f in ("scorer", "ratio", "moments", "key_codec",
                                         "value_codec", "rank")})
        if past_deadline():
            info["error"] = f"not run: past --deadline-s {a.deadline_s:g}"
            log(f"{arm}: {info['error']}")
            results[arm] = info
            continue
        try:
            def calibrate(client):
                """The daemon fits the KVSplice projection from raw caches of this model."""
                tc = time.perf_counter()
                ck = []
                for j, r in enumerate(requests[:2]):
                    t = workload.prompt_tokens(r["segments"], vocab)[: 4 * a.chunk]
                    cache, _, _ = w.prefill(torch.from_numpy(t).to(dev), None, None, 0)
                    k, v = w.kv_of(cache, 0, len(t))
                    key = f"calibration-{j}"
                    client.put(model_id, key, k, v, policy=kvcomp.Policy(ratio=0.0, moments=False),
                               num_q_heads=w.q_heads)
                    ck.append(key)
                    del cache, k, v
                cal = client.calibrate(model_id, rank=a.rank)
                for key in ck:
                    client.delete(model_id, key)
                if not all(c.get("ok") for c in cal):
                    raise RuntimeError(f"calibration failed: {cal}")
                return dict(seconds=time.perf_counter() - tc,
                            result=[{k: v for k, v in c.items() if k != "layer_ranks"}
                                    for c in cal])

            new_tokens = requests[0]["new_tokens"] if requests else 1
            # probes: a full hit at each probe length against its recompute, on a daemon of
            # their own whose tiers hold the longest probe (a hit's cost, not the capacity's)
            probes = []
            plens = [int(x) for x in a.probe_lengths.split(",") if x] if pol is not None else []
            if plens:
                big = 4 * max(plens) * w.raw_bytes_per_token
                pd, pc = start_daemon(binary, dev, big, big, disk_bytes)
                try:
                    if pol.value_codec.startswith("orthogonal"):  # KVSplice needs a projection
                        calibrate(pc)
                    po = Arm(arm, w, model_id, pc, pol, a.chunk, a.decode_every, new_tokens, vocab)
                    po.put_in_flight = a.put_in_flight
                    for n in plens:
                        req = dict(i=-1, segments=[[f"probe-{n}", n + 1]], new_tokens=1)
                        miss = po.serve(req)
                        # The first hit of a length meets new shapes (the model's kernels for a
                        # short prefill over a long past, the allocator's first blocks of that
                        # size); the second is what a warm server sees. Both are recorded.
                        first_hit = po.serve(req)
                        hit = po.serve(req)
                        probes.append(dict(tokens=n + 1, recompute_s=unloaded(n + 1), miss=miss,
                                           first_hit=first_hit, hit=hit))
                finally:
                    pd.__exit__(None, None, None)
                log(f"{arm}: probes " + ", ".join(
                    f"{p['tokens']}: hit {p['hit']['ttft_s'] * 1e3:.0f} ms ({p['hit']['hit']}) "
                    f"vs {p['recompute_s'] * 1e3:.0f} ms" for p in probes))
            if pol is not None:
                d, client = start_daemon(binary, dev, dev_bytes, host_bytes, disk_bytes)
                if pol.value_codec.startswith("orthogonal"):  # KVSplice needs a projection
                    info["calibration"] = calibrate(client)
            arm_o = Arm(arm, w, model_id, client, pol, a.chunk, a.decode_every, new_tokens,
                        vocab)
            arm_o.put_in_flight = a.put_in_flight
            # the trace (a warm-up request first, then its keys deleted)
            svc = []
            ta = time.perf_counter()
            for r in requests:
                svc.append(arm_o.serve(r))
                if a.budget_s and time.perf_counter() - ta > a.budget_s:
                    log(f"{arm}: budget reached after {len(svc)} requests")
                    break
            info.update(service=svc, probes=probes, seconds=time.perf_counter() - ta)
            if client is not None:
                info["held"] = held_bytes(client)
                info["gpu_stats"] = client.gpu_stats()
            hits = [s["hit"] for s in svc]
            log(f"{arm}: {len(svc)} requests in {info['seconds']:.1f} s; full {hits.count('full')}"
                f", partial {hits.count('partial')}, miss {hits.count('miss')}; "
                f"TTFT service p50 {pct([s['ttft_s'] for s in svc], 50) * 1e3:.0f} ms; busy mean "
                f"{np.mean([s['busy_s'] for s in svc]) * 1e3:.0f} ms; held {info.get('held')}")
        except Exception as e:  # noqa: BLE001 - the other arms still run; the error is reported
            import traceback
            traceback.print_exc()
            info["error"] = f"{type(e).__name__}: {e}"
            log(f"{arm}: FAILED {info['error']}")
        finally:
            if d is not None:
                try:
                    info["daemon_log_tail"] = d.log()[-2000:]
                except Exception:  # noqa: BLE001
                    pass
                d.__exit__(None, None, None)
        results[arm] = info
        if a.out and arm != arms[-1]:
            try:
                finish(results, final=False)
            except Exception as e:  # noqa: BLE001 - a partial record never stops the run
                log(f"partial record not written: {type(e).__name__}: {e}")

    out = finish(results, final=True)
    log(f"wall {time.perf_counter() - T0:.1f} s")
    return out


if __name__ == "__main__":
    main()

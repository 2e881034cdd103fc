"""Seeded serving workload: multi-turn chats and agent loops over shared prefixes.

    python3 bench/serving/workload.py --out trace.jsonl [--preset h200|cpu] [--seed 1] ...

A trace is a JSON-lines file: a header object ("meta": the generator's parameters and seed) and
one object per request, in arrival order:

    {"i": 17, "gap": 0.83, "conversation": 4, "kind": "chat", "turn": 2,
     "segments": [["sys1", 1024], ["doc7", 6144], ["s4u0", 180], ["s4a0", 320], ...],
     "tokens": 9021, "new_tokens": 16}

What a request is. Every prompt is a concatenation of segments, each a named run of token ids
(segment_tokens(name, length, vocab): the same name always gives the same ids, so prompts that
share leading segments share a token prefix, as a serving engine's prefix cache sees them):
- a system prompt, one of `systems` (chat and agent prompts differ), shared by every conversation;
- a document (chats: an attached file; agents: the repository or tool manual the loop works on),
  drawn by Zipf popularity (exponent `zipf`) over `docs` documents of `doc_min`..`doc_max`
  tokens: a few documents are read by many conversations;
- the history: a chat turn appends the user's message and the assistant's reply (the reply is
  part of the next turn's prompt, as a chat template renders it); an agent step appends a tool
  call and its output (longer). Turn t's prompt is turn t-1's prompt plus the new segments, so a
  conversation's prompts grow and each is a prefix-extension of the one before.
Sessions run until `max_turns` or until the next prompt would pass `max_tokens`; `active`
conversations are open at once and each request picks one of them at random (interleaving), a
finished conversation is replaced by a new one. Prompts are `min_tokens`..`max_tokens` long.

Arrivals are open-loop: `gap` is an exponential variate of mean 1 (seeded), and at arrival rate
R requests/s request i arrives at sum(gap[0..i]) / R, so one trace serves every rate with the
same requests in the same order (a Poisson process at each rate).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np

PRESETS: Dict[str, Dict] = {
    # The GPU run: contexts 2K-32K tokens of an 8B-shaped model.
    "h200": dict(requests=64, systems=2, system_tokens=1024, docs=24, doc_min=1024,
                 doc_max=14336, zipf=1.1, active=6, max_turns=5, chat_user=(64, 384),
                 chat_reply=(128, 512), agent_call=(64, 192), agent_output=(512, 3072),
                 agent_share=0.4, min_tokens=2048, max_tokens=32768, new_tokens=16,
                 vocab=128256),
    # make test: the byte model (vocab 256) and a short trace.
    "cpu": dict(requests=16, systems=2, system_tokens=64, docs=6, doc_min=64, doc_max=320,
                zipf=1.1, active=3, max_turns=4, chat_user=(8, 32), chat_reply=(16, 48),
                agent_call=(8, 16), agent_output=(48, 128), agent_share=0.4, min_tokens=128,
                max_tokens=768, new_tokens=4, vocab=256),
}


def segment_tokens(name: str, length: int, vocab: int) -> np.ndarray:
    """The token ids of segment `name` (int64, `length` of them, in [1, vocab)): a pure function
    of the name, so shared segments give shared prefixes."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(1, vocab, size=length, dtype=np.int64)


def prompt_tokens(segments: Sequence[Sequence], vocab: int,
                  memo: Dict[Tuple[str, int], np.ndarray] = None) -> np.ndarray:
    """The prompt's token ids: its segments' ids concatenated."""
    parts = []
    for name, n in segments:
        key = (name, int(n))
        if memo is not None and key in memo:
            parts.append(memo[key])
            continue
        t = segment_tokens(name, int(n), vocab)
        if memo is not None:
            memo[key] = t
        parts.append(t)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def chunk_keys(tokens: np.ndarray, chunk: int, model: str) -> List[str]:
    """Chained block hashes of the whole chunks of `tokens`: key i names chunk 0..i (a serving
    engine's prefix-cache keys); the trailing partial chunk has none."""
    keys, h = [], hashlib.sha256(model.encode()).digest()
    for i in range(len(tokens) // chunk):
        h = hashlib.sha256(h + tokens[i * chunk:(i + 1) * chunk].astype("<i8").tobytes()).digest()
        keys.append(h[:16].hex())
    return keys


def _zipf_probs(n: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    return p / p.sum()


def generate(seed: int = 1, **params) -> Iterator[Dict]:
    """The requests of a trace (dicts, in arrival order) under `params` (PRESETS' keys)."""
    p = dict(PRESETS["h200"])
    p.update(params)
    rng = np.random.default_rng(seed)
    doc_len = rng.integers(p["doc_min"], p["doc_max"] + 1, size=p["docs"])
    doc_p = _zipf_probs(p["docs"], p["zipf"])
    conversations: List[Dict] = []
    next_id = [0]

    def new_conversation() -> Dict:
        sid = next_id[0]
        next_id[0] += 1
        kind = "agent" if rng.random() < p["agent_share"] else "chat"
        sysname = f"{kind}-sys{int(rng.integers(p['systems']))}"
        doc = int(rng.choice(p["docs"], p=doc_p))
        segs = [[sysname, p["system_tokens"]], [f"doc{doc}", int(doc_len[doc])]]
        return dict(id=sid, kind=kind, turn=0, segments=segs, doc=doc)

    def extend(s: Dict) -> List:
        t = s["turn"]
        if s["kind"] == "chat":
            u = int(rng.integers(*p["chat_user"]))
            return [[f"s{s['id']}u{t}", u]]
        c = int(rng.integers(*p["agent_call"]))
        o = int(rng.integers(*p["agent_output"]))
        return [[f"s{s['id']}c{t}", c], [f"s{s['id']}o{t}", o]]

    def reply(s: Dict) -> List:
        if s["kind"] != "chat":
            return []
        return [[f"s{s['id']}a{s['turn']}", int(rng.integers(*p["chat_reply"]))]]

    while len(conversations) < p["active"]:
        conversations.append(new_conversation())
    emitted = 0
    while emitted < p["requests"]:
        j = int(rng.integers(len(conversations)))
        s = conversations[j]
        segs = s["segments"] + extend(s)
        total = sum(n for _, n in segs)
        if total > p["max_tokens"] or s["turn"] >= p["max_turns"]:
            conversations[j] = new_conversation()
            continue
        if total >= p["min_tokens"]:
            yield dict(i=emitted, gap=float(rng.exponential(1.0)), conversation=s["id"],
                       kind=s["kind"], turn=s["turn"], doc=s["doc"],
                       segments=[list(x) for x in segs], tokens=total,
                       new_tokens=p["new_tokens"])
            emitted += 1
        s["segments"] = segs + reply(s)
        s["turn"] += 1


def write_trace(path: str, seed: int, params: Dict) -> List[Dict]:
    reqs = list(generate(seed, **params))
    with open(path, "w") as f:
        f.write(json.dumps({"meta": dict(seed=seed, **params)}) + "\n")
        for r in reqs:
            f.write(json.dumps(r) + "\n")
    return reqs


def read_trace(path: str) -> Tuple[Dict, List[Dict]]:
    """(meta, requests) of a trace file."""
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    if not lines or "meta" not in lines[0]:
        raise ValueError(f"{path}: not a trace (the first line must be the meta header)")
    return lines[0]["meta"], lines[1:]


def arrivals(requests: Sequence[Dict], rate: float) -> np.ndarray:
    """Arrival times (s) of the requests at `rate` requests/s."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    return np.cumsum([r["gap"] for r in requests]) / rate


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    a = ap.parse_args()
    params = dict(PRESETS[a.preset])
    if a.requests:
        params["requests"] = a.requests
    if a.max_tokens:
        params["max_tokens"] = a.max_tokens
    reqs = write_trace(a.out, a.seed, params)
    lens = [r["tokens"] for r in reqs]
    print(f"{a.out}: {len(reqs)} requests, {len({r['conversation'] for r in reqs})} conversations, "
          f"tokens {min(lens)}-{max(lens)} (mean {np.mean(lens):.0f})")


if __name__ == "__main__":
    main()

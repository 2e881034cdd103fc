"""RULER-style retrieval and aggregation tasks over a byte haystack (training and evaluation).

Bytes are tokens. Every sample is a context (what gets compressed), a question (kept
uncompressed) and an answer made of items; a sample's score is the fraction of its items whose
bytes the model predicts exactly (greedy, one byte at a time, teacher-forced: an item counts only
if every byte of it is the argmax), so single-item tasks score 0 or 1.

Tasks (RULER's categories, on a haystack cut from the text given):
  niah_single      one line "the key for NAME is DDDDD." at a random depth; asked by NAME.
  niah_multikey    four key lines whose names collide (blue_fox, blue_owl, red_owl, ...): three
                   distractors; one is asked.
  niah_multivalue  four key lines for the same NAME; "the keys for NAME are " -> all four values
                   in the order they appear.
  niah_multiquery  four key lines, two asked together: "the keys for A and B are " -> both.
  vt               variable tracking: "VAR XXXXX = DDDDD." then three hops "VAR YYYYY = VAR
                   XXXXX." scattered, and a distractor chain; "variables equal to DDDDD: " -> the
                   four names in the order they appear.
  cwe              common words: a list of words (no haystack) where three words occur 24 times
                   per 4K bytes and the rest at most twice; "the 3 most common words are " ->
                   the three in alphabetical order.
  fwe              frequent words: synthetic words with counts falling as a power law; "the 3 most
                   frequent words are " -> the three most frequent, most frequent first.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm"))
from tasks import _names  # noqa: E402  (the training tasks' needle names)

TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe",
         "fwe"]
UPPER = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", np.uint8)
CONS = "bcdfghklmnprstvz"
VOW = "aeiou"


@dataclass
class Sample:
    task: str
    context: bytes
    question: bytes
    items: List[bytes]           # answer items
    sep: bytes = b" "            # between items; the answer is sep.join(items)
    meta: dict = field(default_factory=dict)

    @property
    def answer(self) -> bytes:
        return self.sep.join(self.items)

    def item_spans(self):
        """(start, end) of each item in the answer bytes."""
        out, p = [], 0
        for it in self.items:
            out.append((p, p + len(it)))
            p += len(it) + len(self.sep)
        return out


def _digits(rng) -> str:
    return str(int(rng.integers(10000, 100000)))


def _insert(hay: bytes, lines: List[bytes], depths: List[float]):
    """Inserts lines at line starts nearest the depths; returns (context, order of lines)."""
    cuts = []
    for i, f in enumerate(depths):
        p = int(f * len(hay))
        nl = hay.rfind(b"\n", 0, p)
        cuts.append((nl + 1 if nl >= 0 else 0, i))
    cuts.sort()
    parts, last = [], 0
    for p, i in cuts:
        parts.append(hay[last:p])
        parts.append(lines[i])
        last = p
    parts.append(hay[last:])
    return b"".join(parts), [i for _, i in cuts]


def _hay(text: np.ndarray, rng, n: int) -> bytes:
    s = int(rng.integers(0, len(text) - n - 1))
    return bytes(text[s:s + n])


def _key_line(name, d):
    return f"the key for {name} is {d}.\n".encode()


def _needles(text, rng, length, lines, question, items, task, depths=None, sep=b" ",
             order_items=False):
    n_hay = length - len(question) - len(sep.join(items)) - sum(len(x) for x in lines)
    hay = _hay(text, rng, max(16, n_hay))
    depths = depths if depths is not None else [float(rng.random()) for _ in lines]
    ctx, order = _insert(hay, lines, depths)
    if order_items:  # items follow the lines' order in the context
        items = [items[i] for i in order]
    return Sample(task, ctx, question, items, sep, {"depths": depths})


_WORD = re.compile(rb"\b[a-z]{4,9}\b")


def word_list(text: np.ndarray, n: int = 2000, seed: int = 0) -> List[bytes]:
    """Distinct lowercase words of the text (4-9 letters), the n most frequent."""
    b = bytes(text[: min(len(text), 8_000_000)])
    cnt = {}
    for w in _WORD.findall(b):
        cnt[w] = cnt.get(w, 0) + 1
    ws = sorted(cnt, key=lambda w: (-cnt[w], w))[:n]
    return ws


def pseudo_words(rng, n: int) -> List[bytes]:
    out = set()
    while len(out) < n:
        k = int(rng.integers(2, 4))
        w = "".join(CONS[rng.integers(len(CONS))] + VOW[rng.integers(len(VOW))]
                    for _ in range(k))
        out.add(w.encode())
    return sorted(out)


def make(task: str, text: np.ndarray, rng: np.random.Generator, length: int,
         words: Optional[List[bytes]] = None, depth: Optional[float] = None) -> Sample:
    """One sample of `length` bytes (context + question + answer)."""
    if task == "niah_single":
        nm, d = _names(rng, 1, False)[0], _digits(rng)
        return _needles(text, rng, length, [_key_line(nm, d)],
                        f"\nthe key for {nm} is ".encode(), [d.encode()], task,
                        None if depth is None else [depth])
    if task == "niah_multikey":
        nms = _names(rng, 4, True)
        ds = [_digits(rng) for _ in nms]
        a = int(rng.integers(4))
        return _needles(text, rng, length, [_key_line(n, d) for n, d in zip(nms, ds)],
                        f"\nthe key for {nms[a]} is ".encode(), [ds[a].encode()], task)
    if task == "niah_multivalue":
        nm = _names(rng, 1, False)[0]
        ds = [_digits(rng) for _ in range(4)]
        return _needles(text, rng, length, [_key_line(nm, d) for d in ds],
                        f"\nthe keys for {nm} are ".encode(), [d.encode() for d in ds], task,
                        order_items=True)
    if task == "niah_multiquery":
        nms = _names(rng, 4, False)
        ds = [_digits(rng) for _ in nms]
        a, b = rng.choice(4, size=2, replace=False)
        return _needles(text, rng, length, [_key_line(n, d) for n, d in zip(nms, ds)],
                        f"\nthe keys for {nms[a]} and {nms[b]} are ".encode(),
                        [ds[a].encode(), ds[b].encode()], task)
    if task == "vt":
        def nm():
            return bytes(UPPER[rng.integers(0, 26, 5)]).decode()
        val, dval = _digits(rng), _digits(rng)
        chain = [nm() for _ in range(4)]
        dchain = [nm() for _ in range(3)]
        lines = [f"VAR {chain[0]} = {val}.\n".encode()]
        lines += [f"VAR {chain[i]} = VAR {chain[i - 1]}.\n".encode() for i in range(1, 4)]
        dl = [f"VAR {dchain[0]} = {dval}.\n".encode()]
        dl += [f"VAR {dchain[i]} = VAR {dchain[i - 1]}.\n".encode() for i in range(1, 3)]
        # the chain's hops in order of depth, so each assignment follows the one it copies
        dep = sorted(float(x) for x in rng.random(4))
        ddep = sorted(float(x) for x in rng.random(3))
        q = f"\nvariables equal to {val}: ".encode()
        items = [c.encode() for c in chain]
        n_hay = length - len(q) - len(b" ".join(items)) - sum(len(x) for x in lines + dl)
        hay = _hay(text, rng, max(16, n_hay))
        ctx, _ = _insert(hay, lines + dl, dep + ddep)
        return Sample(task, ctx, q, items, b" ", {"depths": dep})
    if task in ("cwe", "fwe"):
        q = (b"\nthe 3 most common words are " if task == "cwe"
             else b"\nthe 3 most frequent words are ")
        pool = words if (task == "cwe" and words) else pseudo_words(rng, 600)
        idx = rng.permutation(len(pool))
        top = [pool[i] for i in idx[:3]]
        rest = [pool[i] for i in idx[3:]]
        scale = length / 4096
        if task == "cwe":
            counts = [int(24 * scale)] * 3
        else:
            counts = [int(30 * scale), int(22 * scale), int(16 * scale)]
        seq: List[bytes] = []
        for w, c in zip(top, counts):
            seq += [w] * c
        items = sorted(top) if task == "cwe" else top
        ans = b" ".join(items)
        budget = length - len(q) - len(ans)
        used = sum(len(w) + 1 for w in seq)
        fill: List[bytes] = []
        full = False
        for k in range(10 ** 6):
            w = rest[k % len(rest)]
            if k < len(rest):  # cwe: twice each; fwe: a power law below the top three
                rep = 2 if task == "cwe" else max(1, min(int(12 * scale),
                                                         int(10 * scale / (1 + k // 20))))
            else:
                rep = 1
            for _ in range(rep):
                if used + len(w) + 1 > budget - 12:
                    full = True
                    break
                fill.append(w)
                used += len(w) + 1
            if full:
                break
        seq += fill
        rng.shuffle(seq)
        ctx = b" ".join(seq)
        ctx = ctx[: max(0, budget)]
        ctx = ctx + b" " * (budget - len(ctx))
        return Sample(task, ctx, q, items, b" ", {})
    raise ValueError(f"unknown task {task}")


def score(pred: np.ndarray, s: Sample) -> float:
    """pred: the argmax byte at each answer position (teacher-forced)."""
    a = np.frombuffer(s.answer, np.uint8)
    ok = pred[: len(a)] == a
    spans = s.item_spans()
    return float(np.mean([ok[i:j].all() for i, j in spans]))

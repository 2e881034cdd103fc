"""Text and retrieval tasks of the byte-level model (training and evaluation share them).

Bytes are tokens (vocabulary 256). A pass-key sample is a window of source code with key lines
"the key for NAME is DIGITS.\n" inserted at line starts, then the question "\nthe key for NAME
is " whose answer is the DIGITS. Names are two words joined by "_"; in a colliding sample every
name shares a word with another (blue_fox, blue_owl, red_fox), so the model has to match the
whole name, not one word of it.

Held-out text: the Python standard library's top-level modules of the interpreter that runs the
harness (`heldout_files()`), never read by training (train.py reads site-packages only).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

ADJ = ["red", "blue", "green", "amber", "silver", "golden", "dark", "bright", "quiet", "rapid",
       "frozen", "hidden", "lunar", "solar", "crimson", "violet", "ancient", "modern", "wild",
       "gentle", "bitter", "sweet", "hollow", "iron", "copper", "velvet", "misty", "sharp"]
NOUN = ["fox", "owl", "river", "stone", "tower", "garden", "falcon", "harbor", "lantern",
        "meadow", "comet", "engine", "forest", "island", "mirror", "canyon", "bridge", "castle",
        "tiger", "willow", "anchor", "beacon", "cedar", "dragon", "ember", "glacier", "hammer"]
DIGITS = 5  # answer length in bytes


def key_line(name: str, digits: str) -> bytes:
    return f"the key for {name} is {digits}.\n".encode()


def question(name: str) -> bytes:
    return f"\nthe key for {name} is ".encode()


def _names(rng: np.random.Generator, n: int, colliding: bool) -> List[str]:
    """n distinct names; colliding: each shares its first or second word with another."""
    if not colliding or n == 1:
        out: List[str] = []
        while len(out) < n:
            s = f"{ADJ[rng.integers(len(ADJ))]}_{NOUN[rng.integers(len(NOUN))]}"
            if s not in out:
                out.append(s)
        return out
    a = rng.choice(len(ADJ), size=n, replace=False)
    b = rng.choice(len(NOUN), size=n, replace=False)
    out = [f"{ADJ[a[0]]}_{NOUN[b[0]]}"]
    for i in range(1, n):  # alternately reuse the previous name's first or second word
        prev_a, prev_b = out[-1].split("_")
        out.append(f"{prev_a}_{NOUN[b[i]]}" if i % 2 else f"{ADJ[a[i]]}_{prev_b}")
    return out


@dataclass
class PassKey:
    context: bytes          # code with the key lines (what gets compressed)
    question: bytes         # "\nthe key for NAME is " (kept uncompressed)
    answer: bytes           # the DIGITS
    depths: List[float]     # where each key line sits, as a fraction of the context
    target_depth: float     # depth of the asked key


def make_passkey(text: np.ndarray, rng: np.random.Generator, length: int, n_keys: int = 1,
                 colliding: bool = False, depth: Optional[float] = None) -> PassKey:
    """A sample of `length` bytes in all (context + question + answer).

    text: uint8 array to cut the code window from; depth: where the asked key goes (0 = start
    of the context, 1 = end), None = uniformly random; the other keys go anywhere.
    """
    names = _names(rng, n_keys, colliding)
    digits = [str(rng.integers(10 ** (DIGITS - 1), 10 ** DIGITS)) for _ in names]
    ask = int(rng.integers(n_keys))
    q = question(names[ask])
    lines = [key_line(n, d) for n, d in zip(names, digits)]
    code_len = length - len(q) - DIGITS - sum(len(l) for l in lines)
    start = int(rng.integers(0, len(text) - code_len - 1))
    code = bytes(text[start:start + code_len])
    # insertion points: line starts (just after a newline) at the wanted depths
    cuts = []
    for i in range(n_keys):
        f = depth if (i == ask and depth is not None) else float(rng.random())
        p = int(f * code_len)
        nl = code.rfind(b"\n", 0, p)
        cuts.append((nl + 1 if nl >= 0 else 0, i))
    cuts.sort()
    parts, last, pos = [], 0, {}
    for p, i in cuts:
        parts.append(code[last:p])
        pos[i] = sum(len(x) for x in parts)
        parts.append(lines[i])
        last = p
    parts.append(code[last:])
    context = b"".join(parts)
    n = len(context)
    return PassKey(context, q, digits[ask].encode(), [pos[i] / n for i in range(n_keys)],
                   pos[ask] / n)


# --- held-out text ---

def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def heldout_files(root: Optional[str] = None, min_bytes: int = 8192) -> List[str]:
    """The held-out files: top-level .py modules of the standard library, >= min_bytes, sorted."""
    root = root or stdlib_dir()
    out = []
    for f in sorted(os.listdir(root)):
        p = os.path.join(root, f)
        if f.endswith(".py") and os.path.isfile(p) and os.path.getsize(p) >= min_bytes:
            out.append(p)
    return out


def read_files(paths: Sequence[str]) -> List[bytes]:
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(f.read())
    return out


def digest(blobs: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for b in blobs:
        h.update(hashlib.sha256(b).digest())
    return h.hexdigest()[:16]


def concat(blobs: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"\n".join(blobs), dtype=np.uint8)


def ids(b: bytes):
    import torch
    return torch.tensor(list(b), dtype=torch.long)

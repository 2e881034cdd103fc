"""Builds the mixed English + code corpus of the GQA models (docs/model-card.md).

    python3 bench/quality/corpus.py --out DIR [--en-mb 48] [--code-mb 48]

English: the build machine's installed documentation (/usr/share/doc: README, NEWS, changelog,
copyright, .txt/.md/.rst files, .gz ones decompressed; HTML with its tags stripped). Code: C and
C++ headers (/usr/include) and Python sources of the installed packages (site-packages; the
standard library is never read). Files are assigned to the held-out split by a hash of their
path (1 in 8), so no file is in both. Writes DIR/corpus.tar.xz holding train_en.bin,
train_code.bin, held_en.bin, held_code.bin (files joined by a blank line) and manifest.json
(file counts, bytes and sha256 digests), which is what travels to the GPU machine.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import site
import sysconfig
import tarfile

TEXT_EXT = (".txt", ".md", ".rst", ".html", ".htm", ".Debian", ".text")
TEXT_NAMES = ("README", "NEWS", "changelog", "copyright", "AUTHORS", "TODO", "THANKS", "HISTORY",
              "FAQ", "CHANGES", "BUGS", "INSTALL")
TAG = re.compile(rb"<[^>]{0,400}>")
WS = re.compile(rb"[ \t]*\n[ \t\n]*\n")


def held(path: str) -> bool:
    return hashlib.sha256(path.encode()).digest()[0] % 8 == 0


def _read(p: str) -> bytes:
    with open(p, "rb") as f:
        b = f.read()
    if p.endswith(".gz"):
        try:
            b = gzip.decompress(b)
        except (OSError, EOFError):
            return b""
    if p.endswith((".html", ".htm", ".html.gz")):
        b = TAG.sub(b"", b)
        b = WS.sub(b"\n\n", b)
    if b.count(b"\0") or not b:
        return b""
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return b""
    return b


def english_files(root="/usr/share/doc"):
    out = []
    for dp, dn, fn in os.walk(root):
        dn.sort()
        for f in sorted(fn):
            base = f[:-3] if f.endswith(".gz") else f
            if base.endswith(TEXT_EXT) or base.split(".")[0] in TEXT_NAMES:
                out.append(os.path.join(dp, f))
    return out


def code_files():
    out = []
    for dp, dn, fn in os.walk("/usr/include"):
        dn.sort()
        out += [os.path.join(dp, f) for f in sorted(fn) if f.endswith((".h", ".hpp", ".hh"))
                or "." not in f]
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    for r in sorted(set(site.getsitepackages() + [sysconfig.get_paths()["purelib"]])):
        if not os.path.isdir(r) or os.path.realpath(r).startswith(stdlib + os.sep):
            continue
        for dp, dn, fn in os.walk(r):
            dn[:] = sorted(d for d in dn if d != "__pycache__" and "_vendor" not in d)
            out += [os.path.join(dp, f) for f in sorted(fn) if f.endswith(".py")]
    return out


def collect(paths, max_bytes, seed):
    import random
    paths = list(paths)
    random.Random(seed).shuffle(paths)
    tr, he, ntr, nhe, seen = [], [], 0, 0, set()
    for p in paths:
        if ntr >= max_bytes and nhe >= max_bytes // 8:
            break
        try:
            b = _read(p)
        except OSError:
            continue
        if len(b) < 256 or len(b) > 4_000_000:
            continue
        h = hashlib.sha256(b).digest()
        if h in seen:  # the same file installed twice (e.g. copyright files)
            continue
        seen.add(h)
        if held(p):
            if nhe < max_bytes // 8:
                he.append(b)
                nhe += len(b)
        elif ntr < max_bytes:
            tr.append(b)
            ntr += len(b)
    return b"\n\n".join(tr), b"\n\n".join(he), len(tr), len(he)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--en-mb", type=float, default=48)
    ap.add_argument("--code-mb", type=float, default=48)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    man = {}
    parts = {}
    for kind, files, mb in (("en", english_files(), args.en_mb),
                            ("code", code_files(), args.code_mb)):
        tr, he, ntr, nhe = collect(files, int(mb * 1e6), seed=1)
        parts[f"train_{kind}.bin"], parts[f"held_{kind}.bin"] = tr, he
        man[kind] = {"candidates": len(files), "train_files": ntr, "held_files": nhe,
                     "train_bytes": len(tr), "held_bytes": len(he),
                     "train_sha256": hashlib.sha256(tr).hexdigest()[:16],
                     "held_sha256": hashlib.sha256(he).hexdigest()[:16]}
        print(kind, man[kind], flush=True)
    parts["manifest.json"] = json.dumps(man, indent=1).encode()
    dst = os.path.join(args.out, "corpus.tar.xz")
    with tarfile.open(dst, "w:xz", preset=6) as t:
        for name, b in parts.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(b)
            t.addfile(ti, io.BytesIO(b))
    print(f"wrote {dst} ({os.path.getsize(dst) / 1e6:.1f} MB)")


def load(path: str) -> dict:
    """The corpus parts (name -> bytes) from corpus.tar.xz or a directory of them."""
    out = {}
    if os.path.isdir(path):
        for f in os.listdir(path):
            if f.endswith((".bin", ".json")):
                with open(os.path.join(path, f), "rb") as fh:
                    out[f] = fh.read()
        return out
    with tarfile.open(path, "r:*") as t:
        for m in t.getmembers():
            out[m.name] = t.extractfile(m).read()
    return out


if __name__ == "__main__":
    main()

"""RULER-style suite of full-length codecs, eviction + codec policies and the peers' schemes on a
byte-level model (bench/quality/ruler.py tasks, next-byte loss), with 95% intervals.

    python3 bench/quality/suite.py --model DIR --corpus corpus.tar.xz --lengths 4096 8192 \\
        --n 50 [--device cuda] [--budget-seconds 0] --out PREFIX

For each length and each sample (tasks in turn, haystacks alternately English and code from the
corpus' held-out split) the context is prefilled once; every configuration then replaces the
cache with its decoded form (codecs_ref.py; eviction keeps the same number of tokens in every
kv head), and the question and answer are run over it (teacher-forced greedy bytes: an answer
item counts when all its bytes are the argmax). Loss: mean next-byte NLL over the last quarter of
held-out windows after the first three quarters are compressed. The cache is bf16 (the model
runs in bf16 on a GPU, float32 on a CPU). Bytes per token count every stored byte of the codec
(codes, scales, per-head constants; eviction adds a 4-byte position per kept token and head)
against the bf16 cache; "entropy" bytes are what an order-0 entropy coder of the codes reaches.

Writes PREFIX.json (per-sample scores, intervals, KV statistics of the full cache) and PREFIX.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "lm"))
import codecs_ref  # noqa: E402
import corpus as corpus_mod  # noqa: E402
import ruler  # noqa: E402

# name: (key codec, value codec, eviction policy, ratio)
CONFIGS = {
    "full": ("bf16", "bf16", None, 0.0),
    "fp8 (LMCache fp8)": ("fp8", "fp8", None, 0.0),
    "int8t": ("int8t", "int8t", None, 0.0),
    "kivi4": ("kivi4", "kivi4", None, 0.0),
    "kivi2": ("kivi2", "kivi2", None, 0.0),
    "tq k8v4": ("tq8", "tq4", None, 0.0),
    "tq k4v4": ("tq4", "tq4", None, 0.0),
    "tq k4v3": ("tq4", "tq3", None, 0.0),
    "tq k3v2": ("tq3", "tq2", None, 0.0),
    "hq k4v4": ("hq4", "hq4", None, 0.0),
    "hq k4v3": ("hq4", "hq3", None, 0.0),
    "hq k3v3": ("hq3", "hq3", None, 0.0),
    "hq k4cv3": ("hq4c", "hq3", None, 0.0),
    "hq k3cv2": ("hq3c", "hq2g32", None, 0.0),
    "hq k2cv2 g32": ("hq2cg32", "hq2g32", None, 0.0),
    "hq k4v2 g32": ("hq4", "hq2g32", None, 0.0),
    "tq k4v2": ("tq4", "tq2", None, 0.0),
    "int8t k + hq v4": ("int8t", "hq4", None, 0.0),
    "manifold_r50 0.5": ("bf16", "bf16", "manifold_r50", 0.5),
    "manifold_r50 0.5 + hq k4v3": ("hq4", "hq3", "manifold_r50", 0.5),
    "manifold_r50 0.75 + hq k4v3": ("hq4", "hq3", "manifold_r50", 0.75),
    "streaming 0.5 + hq k4v3": ("hq4", "hq3", "streaming", 0.5),
    "keydiff 0.5 + hq k4v3": ("hq4", "hq3", "keydiff", 0.5),
    # kvcomp's engine codecs hq4 / hq3 (codecs_ref "kvhq": the engine's arithmetic, bit-identical)
    "kvhq k4v4": ("kvhq4", "kvhq4", None, 0.0),
    "kvhq k4v3": ("kvhq4", "kvhq3", None, 0.0),
    "kvhq k3v3": ("kvhq3", "kvhq3", None, 0.0),
    "kvhq k3v4": ("kvhq3", "kvhq4", None, 0.0),
    "kvhq k3v2": ("kvhq3", "kvhq2", None, 0.0),
    "manifold_r50 0.5 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r50", 0.5),
    "manifold_r50 0.5 + kvhq k3v3": ("kvhq3", "kvhq3", "manifold_r50", 0.5),
    "manifold_r50 0.67 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r50", 0.67),
    "manifold_r50 0.75 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r50", 0.75),
    # single scorers against the default policy (manifold, no recent window) at 0.5 and 0.75
    "manifold 0.5": ("bf16", "bf16", "manifold", 0.5),
    "manifold 0.75": ("bf16", "bf16", "manifold", 0.75),
    "manifold_r50 0.75": ("bf16", "bf16", "manifold_r50", 0.75),
    "knorm 0.5": ("bf16", "bf16", "knorm", 0.5),
    "knorm 0.75": ("bf16", "bf16", "knorm", 0.75),
    "keydiff 0.5": ("bf16", "bf16", "keydiff", 0.5),
    "keydiff 0.75": ("bf16", "bf16", "keydiff", 0.75),
    "streaming 0.5": ("bf16", "bf16", "streaming", 0.5),
    "streaming 0.75": ("bf16", "bf16", "streaming", 0.75),
    # candidates for the default policy: manifold with a larger share of the kept budget recent
    # (the 4 sink tokens kept as in every protected policy)
    "manifold_r75 0.5": ("bf16", "bf16", "manifold_r75", 0.5),
    "manifold_r75 0.75": ("bf16", "bf16", "manifold_r75", 0.75),
    "manifold_r90 0.5": ("bf16", "bf16", "manifold_r90", 0.5),
    "manifold_r90 0.75": ("bf16", "bf16", "manifold_r90", 0.75),
    "manifold_r75 0.5 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r75", 0.5),
    # between r75 and r90, and larger sinks (manifold_rNNsS: S sink tokens)
    "manifold_r80 0.5": ("bf16", "bf16", "manifold_r80", 0.5),
    "manifold_r80 0.75": ("bf16", "bf16", "manifold_r80", 0.75),
    "manifold_r85 0.5": ("bf16", "bf16", "manifold_r85", 0.5),
    "manifold_r85 0.75": ("bf16", "bf16", "manifold_r85", 0.75),
    "manifold_r75s16 0.5": ("bf16", "bf16", "manifold_r75s16", 0.5),
    "manifold_r75s16 0.75": ("bf16", "bf16", "manifold_r75s16", 0.75),
    "manifold_r80s16 0.5": ("bf16", "bf16", "manifold_r80s16", 0.5),
    "manifold_r80s16 0.75": ("bf16", "bf16", "manifold_r80s16", 0.75),
    "manifold_r85s16 0.5": ("bf16", "bf16", "manifold_r85s16", 0.5),
    "manifold_r85s16 0.75": ("bf16", "bf16", "manifold_r85s16", 0.75),
    "manifold_r80s64 0.5": ("bf16", "bf16", "manifold_r80s64", 0.5),
    "manifold_r80s64 0.75": ("bf16", "bf16", "manifold_r80s64", 0.75),
    # eviction under the default's window + the codec: the balanced preset's candidates
    "manifold_r75 0.67 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r75", 0.67),
    "manifold_r85 0.5 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r85", 0.5),
    "manifold_r85 0.67 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r85", 0.67),
    "manifold_r75 0.6 + kvhq k3v3": ("kvhq3", "kvhq3", "manifold_r75", 0.6),
    "manifold_r85 0.6 + kvhq k3v3": ("kvhq3", "kvhq3", "manifold_r85", 0.6),
    "streaming 0.67 + kvhq k4v3": ("kvhq4", "kvhq3", "streaming", 0.67),
    # keydiff under the recent window; eviction + codec at lower ratios (balanced within 2%)
    "keydiff_r75 0.5": ("bf16", "bf16", "keydiff_r75", 0.5),
    "keydiff_r75 0.75": ("bf16", "bf16", "keydiff_r75", 0.75),
    "keydiff_r85 0.5": ("bf16", "bf16", "keydiff_r85", 0.5),
    "keydiff_r85 0.75": ("bf16", "bf16", "keydiff_r85", 0.75),
    "manifold_r85 0.25 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r85", 0.25),
    "manifold_r85 0.33 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r85", 0.33),
    "manifold_r85 0.4 + kvhq k4v3": ("kvhq4", "kvhq3", "manifold_r85", 0.4),
    "manifold_r85 0.25 + kvhq k3v3": ("kvhq3", "kvhq3", "manifold_r85", 0.25),
    "manifold_r85 0.33 + kvhq k3v3": ("kvhq3", "kvhq3", "manifold_r85", 0.33),
    "manifold_r85 0.4 + kvhq k3v3": ("kvhq3", "kvhq3", "manifold_r85", 0.4),
    # the calibrated decorrelation codec (codecs_ref "pca{bits}": a per-model PCA basis per
    # layer and kv head, widths by reverse water-filling, Lloyd-Max codes, no per-row side data;
    # "n": an f16 scale per row); bits = average width per element, keys / values
    **{f"pca k{k}v{v}": (f"pca{k}", f"pca{v}", None, 0.0) for k, v in (
        ("4", "3"), ("3", "3"), ("3", "2.5"), ("3", "2"), ("3.5", "2"), ("2.5", "2.5"),
        ("2.5", "2"), ("2", "2"), ("2.5", "1.5"), ("2", "1.5"), ("2", "1"), ("1.5", "1.5"),
        ("1.5", "1"), ("1", "1"))},
    "pca k3nv2n": ("pca3n", "pca2n", None, 0.0),
    "manifold_r85 0.33 + pca k3v2": ("pca3", "pca2", "manifold_r85", 0.33),
    "manifold_r85 0.33 + pca k2v1.5": ("pca2", "pca1.5", "manifold_r85", 0.33),
    "manifold_r85 0.5 + pca k3v2": ("pca3", "pca2", "manifold_r85", 0.5),
    "manifold_r85 0.25 + pca k2v1": ("pca2", "pca1", "manifold_r85", 0.25),
    "manifold_r85 0.5 + pca k2.5v2": ("pca2.5", "pca2", "manifold_r85", 0.5),
    # kvpress's own presses (its PyPI wheel, --kvpress): the context prefilled under the press
    # (its forward hooks compress each layer's cache as kvpress does), kept keys and values bf16
    "kvpress knorm 0.5": ("bf16", "bf16", "kvpress:knorm", 0.5),
    "kvpress streaming 0.5": ("bf16", "bf16", "kvpress:streaming", 0.5),
    "kvpress keydiff 0.5": ("bf16", "bf16", "kvpress:keydiff", 0.5),
    "kvpress snapkv 0.5": ("bf16", "bf16", "kvpress:snapkv", 0.5),
    "kvpress snapkv 0.75": ("bf16", "bf16", "kvpress:snapkv", 0.75),
    "kvpress expected_attention 0.5": ("bf16", "bf16", "kvpress:expected_attention", 0.5),
    "kvpress expected_attention 0.75": ("bf16", "bf16", "kvpress:expected_attention", 0.75),
}

# What a run measures unless --configs says otherwise: the peers, the engine's hq codecs, eviction
# plus codec, and the single scorers at 0.5 / 0.75 (the float "hq" references of earlier runs
# stay available by name).
DEFAULT_CONFIGS = [
    "full", "fp8 (LMCache fp8)", "kivi4", "kivi2", "tq k8v4", "tq k4v4", "tq k4v3", "tq k4v2",
    "tq k3v2", "kvhq k4v4", "kvhq k4v3", "kvhq k3v3", "kvhq k3v4",
    "manifold_r50 0.5", "manifold_r50 0.5 + kvhq k4v3", "manifold_r50 0.5 + kvhq k3v3",
    "manifold_r50 0.67 + kvhq k4v3", "manifold_r50 0.75 + kvhq k4v3",
    "manifold 0.5", "manifold 0.75", "manifold_r50 0.75", "knorm 0.5", "knorm 0.75",
    "keydiff 0.5", "keydiff 0.75", "streaming 0.5", "streaming 0.75",
]

# The presets and the default against the single scorers (--config-set policies): codec =
# kvhq k4v3, balanced = manifold_r50 0.5 + kvhq k4v3, the default policy's selection = manifold
# (no recent window) at 0.5, each scorer at 0.5 and 0.75, and a few codec anchors.
POLICY_CONFIGS = [
    "full", "kvhq k4v3", "kvhq k3v3", "tq k4v3", "kivi2",
    "manifold_r50 0.5 + kvhq k4v3", "manifold_r50 0.67 + kvhq k4v3",
    "manifold 0.5", "manifold 0.75", "manifold_r50 0.5", "manifold_r50 0.75",
    "knorm 0.5", "knorm 0.75", "keydiff 0.5", "keydiff 0.75", "streaming 0.5", "streaming 0.75",
]
# The default policy's candidates against the single scorers at 0.5 and 0.75 (--config-set
# defaults), with kvpress's query-aware presses (dropped when --kvpress finds no wheel).
DEFAULTS_CONFIGS = [
    "full", "manifold 0.5", "manifold 0.75", "manifold_r50 0.5", "manifold_r50 0.75",
    "manifold_r75 0.5", "manifold_r75 0.75", "manifold_r90 0.5", "manifold_r90 0.75",
    "knorm 0.5", "knorm 0.75", "keydiff 0.5", "keydiff 0.75", "streaming 0.5", "streaming 0.75",
    "kvpress snapkv 0.5", "kvpress snapkv 0.75", "kvpress expected_attention 0.5",
    "kvpress expected_attention 0.75",
]
# The presets and the default's candidates at a long context (--config-set long).
LONG_CONFIGS = [
    "full", "kvhq k4v3", "manifold_r50 0.5 + kvhq k4v3", "manifold_r75 0.5 + kvhq k4v3",
    "manifold 0.5", "manifold_r50 0.5", "manifold_r75 0.5", "manifold_r75 0.75",
    "streaming 0.5", "streaming 0.75",
]
# kvpress's key-only presses beside the suite's own scorers of the same name (same selection
# expected: a check of the suite's references against the package).
KVPRESS_CHECK_CONFIGS = [
    "full", "knorm 0.5", "streaming 0.5", "keydiff 0.5", "kvpress knorm 0.5",
    "kvpress streaming 0.5", "kvpress keydiff 0.5", "kvpress snapkv 0.5",
    "kvpress expected_attention 0.5", "manifold_r75 0.5",
]
# The default's candidates between r75 and r90 and with larger sinks against the single scorers,
# and eviction under those windows + the codec (balanced at about 8x and 12x), at one length
# (--config-set window).
WINDOW_CONFIGS = [
    "full", "manifold 0.5", "manifold 0.75", "knorm 0.5", "knorm 0.75", "keydiff 0.5",
    "keydiff 0.75", "streaming 0.5", "streaming 0.75",
    "manifold_r75 0.5", "manifold_r75 0.75", "manifold_r80 0.5", "manifold_r80 0.75",
    "manifold_r85 0.5", "manifold_r85 0.75", "manifold_r90 0.5", "manifold_r90 0.75",
    "manifold_r75s16 0.5", "manifold_r75s16 0.75", "manifold_r80s16 0.5", "manifold_r80s16 0.75",
    "manifold_r85s16 0.5", "manifold_r85s16 0.75", "manifold_r80s64 0.5", "manifold_r80s64 0.75",
    "kvhq k4v3", "kvhq k3v3", "manifold_r50 0.5 + kvhq k4v3", "manifold_r75 0.5 + kvhq k4v3",
    "manifold_r85 0.5 + kvhq k4v3", "manifold_r75 0.67 + kvhq k4v3",
    "manifold_r85 0.67 + kvhq k4v3", "manifold_r75 0.6 + kvhq k3v3",
    "manifold_r85 0.6 + kvhq k3v3", "streaming 0.67 + kvhq k4v3",
]
# keydiff under the recent window against the single scorers, and eviction + codec at ratios
# below 0.5 (what stays within 2% on every model) (--config-set window2).
WINDOW2_CONFIGS = [
    "full", "manifold 0.5", "manifold 0.75", "knorm 0.5", "knorm 0.75", "keydiff 0.5",
    "keydiff 0.75", "streaming 0.5", "streaming 0.75", "keydiff_r75 0.5", "keydiff_r75 0.75",
    "keydiff_r85 0.5", "keydiff_r85 0.75", "kvhq k4v3", "kvhq k3v3",
    "manifold_r85 0.25 + kvhq k4v3", "manifold_r85 0.33 + kvhq k4v3",
    "manifold_r85 0.4 + kvhq k4v3", "manifold_r85 0.25 + kvhq k3v3",
    "manifold_r85 0.33 + kvhq k3v3", "manifold_r85 0.4 + kvhq k3v3",
]
# The calibrated decorrelation codec at 1 to 4 bits per element against the engine's hq codecs,
# alone and under the balanced preset's eviction (--config-set codec8; needs --calib).
CODEC8_CONFIGS = [
    "full", "kvhq k4v3", "kvhq k3v3", "kvhq k3v2", "pca k4v3", "pca k3v3", "pca k3v2.5",
    "pca k3v2", "pca k3.5v2", "pca k2.5v2.5", "pca k2.5v2", "pca k2v2", "pca k2.5v1.5",
    "pca k2v1.5", "pca k2v1", "pca k1.5v1.5", "pca k1.5v1", "pca k1v1", "pca k3nv2n",
    "manifold_r85 0.33 + kvhq k4v3", "manifold_r85 0.33 + pca k3v2",
    "manifold_r85 0.33 + pca k2v1.5", "manifold_r85 0.5 + pca k3v2",
    "manifold_r85 0.25 + pca k2v1", "manifold_r85 0.5 + pca k2.5v2",
]
CONFIG_SETS = {"default": DEFAULT_CONFIGS, "window2": WINDOW2_CONFIGS, "policies": POLICY_CONFIGS,
               "defaults": DEFAULTS_CONFIGS, "long": LONG_CONFIGS, "window": WINDOW_CONFIGS,
               "kvpress_check": KVPRESS_CHECK_CONFIGS, "codec8": CODEC8_CONFIGS}

# kvpress press classes by the suite's name: (module, class, keyword arguments)
KVPRESS_PRESSES = {
    "knorm": ("knorm_press", "KnormPress", {}),
    "streaming": ("streaming_llm_press", "StreamingLLMPress", {"n_sink": 4}),
    "keydiff": ("keydiff_press", "KeyDiffPress", {}),
    "snapkv": ("snapkv_press", "SnapKVPress", {}),
    "expected_attention": ("expected_attention_press", "ExpectedAttentionPress", {}),
}
_KVPRESS = {}


def load_kvpress(wheel):
    """kvpress's press modules from its wheel (a .whl or an unpacked directory), without the
    package's __init__ (it imports every press with optional dependencies the suite does not
    need). Returns a short description, or raises."""
    import importlib
    import types
    import zipfile
    if wheel.endswith(".whl"):
        import tempfile
        dest = tempfile.mkdtemp(prefix="kvcomp-kvpress-")
        zipfile.ZipFile(wheel).extractall(dest)
        wheel = dest
    sys.path.insert(0, wheel)
    for name, sub in (("kvpress", "kvpress"), ("kvpress.presses", "kvpress/presses")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(wheel, sub)]
        sys.modules[name] = pkg
    for key, (mod, cls, kw) in KVPRESS_PRESSES.items():
        _KVPRESS[key] = (getattr(importlib.import_module(f"kvpress.presses.{mod}"), cls), kw)
    return wheel


def kvpress_caches(model, ids, cfgs):
    """{config: (K, V [L,H,kept,d])} of the kvpress configs: the context prefilled under the
    press (kvpress's forward hooks compress each layer's cache during the prefill)."""
    out = {}
    for c in cfgs:
        pol, ratio = CONFIGS[c][2], CONFIGS[c][3]
        if not (pol or "").startswith("kvpress:"):
            continue
        cls, kw = _KVPRESS[pol.split(":", 1)[1]]
        press = cls(compression_ratio=ratio, **kw)
        press.post_init_from_model(model)
        for layer in model.model.layers:  # where kvpress looks for the rotary embedding
            if not hasattr(layer.self_attn, "rotary_emb"):
                layer.self_attn.rotary_emb = model.model.rotary_emb

        def hook(module, args, kwargs, output, press=press):
            # what BasePress.__call__ registers; this transformers release passes no
            # cache_position to the attention layers, and the prefill starts at position 0
            if "cache_position" not in kwargs:
                hs = kwargs["hidden_states"]
                kwargs = dict(kwargs, cache_position=torch.arange(hs.shape[1], device=hs.device))
            return press.forward_hook(module, args, kwargs, output)
        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True)
                 for layer in model.model.layers]
        try:
            pkv = model(ids[None].to(model.device), use_cache=True).past_key_values
        finally:
            for h in hooks:
                h.remove()
        out[c] = (torch.stack([pkv.layers[l].keys[0] for l in range(len(pkv.layers))]).float(),
                  torch.stack([pkv.layers[l].values[0] for l in range(len(pkv.layers))]).float())
    return out


def git_commit():
    if os.environ.get("KVCOMP_COMMIT"):
        return os.environ["KVCOMP_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def calibrate_pca(model, parts, length, n):
    """Fits codecs_ref's pca bases on n windows of the corpus' training split (English and code
    in turn, consecutive windows from the start of each part); returns what the run records."""
    Ks, Vs, src = [], [], []
    for j in range(n):
        name = "train_en.bin" if j % 2 == 0 else "train_code.bin"
        t = np.frombuffer(parts[name], np.uint8)
        s = (j // 2) * length
        if s + length > len(t):
            raise SystemExit(f"--calib: {name} holds {len(t)} bytes, {s + length} needed")
        K, V, _ = prefill(model, torch.from_numpy(t[s:s + length].astype(np.int64)))
        Ks.append(K)
        Vs.append(V)
        src.append(f"{name}[{s}:{s + length}]")
    codecs_ref.pca_calibrate(Ks, Vs)
    man = json.loads(parts["manifest.json"]) if "manifest.json" in parts else None
    return {"windows": src, "manifest": man,
            "key_sd_top8": codecs_ref._PCA["K"]["sd"][..., :8].tolist(),
            "value_sd_top8": codecs_ref._PCA["V"]["sd"][..., :8].tolist()}


@torch.no_grad()
def prefill(model, ids):
    out = model(ids[None].to(model.device), use_cache=True)
    pkv = out.past_key_values
    K = torch.stack([pkv.layers[l].keys[0] for l in range(len(pkv.layers))]).float()
    V = torch.stack([pkv.layers[l].values[0] for l in range(len(pkv.layers))]).float()
    return K, V, out.logits[0, -1].float()


def keep_mask(policy, K, ratio):
    import variants
    return variants.policy_mask(policy, K, ratio)


def build(cfgs, K, V, pressed=None):
    """Per config: (decoded K, V [L,H,n,d], bytes per token, entropy bytes per token).
    `pressed`: the kvpress configs' caches (kvpress_caches); kvpress keeps bf16 keys and values
    and no positions (they stay implicit in its cache)."""
    L, H, N, d = K.shape
    out = {}
    memo = {}
    for name in cfgs:
        kc, vc, pol, ratio = CONFIGS[name]
        if (pol or "").startswith("kvpress:"):
            Kp, Vp = pressed[name]
            _, kb, _ = codecs_ref.encode("bf16", K[:, :, :1], True)
            _, vb, _ = codecs_ref.encode("bf16", V[:, :, :1], False)
            b = Kp.shape[2] * (kb + vb) / N
            out[name] = (Kp, Vp, b, b)
            continue
        if (kc, True) not in memo:
            memo[(kc, True)] = codecs_ref.encode(kc, K, True)
        if (vc, False) not in memo:
            memo[(vc, False)] = codecs_ref.encode(vc, V, False)
        Kd, kb, ke = memo[(kc, True)]
        Vd, vb, ve = memo[(vc, False)]
        ke = kb if ke is None else ke
        ve = vb if ve is None else ve
        frac, pos = 1.0, 0.0
        if pol:
            m = keep_mask(pol, K, ratio)
            kept = int(m[0, 0].sum())
            idx = m.nonzero()[:, 2].reshape(L, H, kept)  # ascending positions per head
            g = idx[..., None].expand(L, H, kept, d)
            Kd, Vd = Kd.gather(2, g), Vd.gather(2, g)
            frac, pos = kept / N, 4.0 * L * H * kept
        out[name] = (Kd, Vd, (frac * (kb + vb) + pos) / N, (frac * (ke + ve) + pos) / N)
    return out


@torch.no_grad()
def tail_logits(model, caches, N, tail, dtype):
    """Logits of `tail` after each cache (batched over caches of one length)."""
    from transformers import DynamicCache
    B = len(caches)
    L = len(caches[0][0])
    c = DynamicCache()
    for l in range(L):
        k = torch.stack([x[0][l] for x in caches]).to(dtype)
        v = torch.stack([x[1][l] for x in caches]).to(dtype)
        c.update(k, v, l)
    ids = tail[None].expand(B, -1).to(model.device)
    pos = torch.arange(N, N + tail.numel(), device=model.device)[None].expand(B, -1)
    return model(ids, past_key_values=c, position_ids=pos, use_cache=True).logits.float()


def run_configs(model, built, N, tail, dtype):
    """{name: logits [len(tail), V]} grouped by cache length."""
    groups = {}
    for name, (Kd, Vd, _, _) in built.items():
        groups.setdefault(Kd.shape[2], []).append(name)
    out = {}
    for n, names in groups.items():
        lg = tail_logits(model, [built[x][:2] for x in names], N, tail, dtype)
        for i, x in enumerate(names):
            out[x] = lg[i]
    return out


def kv_stats(K, V):
    """Per layer: key channel outliers and value spread of one full cache [L, H, N, d]."""
    rows = []
    for l in range(K.shape[0]):
        k, v = K[l], V[l]
        ch = k.abs().mean(dim=1)  # [H, d] mean |k| per channel
        med = ch.median(dim=-1, keepdim=True).values.clamp_min(1e-6)
        kur = (((k - k.mean(1, keepdim=True)) ** 4).mean(1) /
               (k.var(1) ** 2).clamp_min(1e-12))  # per channel
        vstd = v.std(dim=1)  # [H, d]
        vt = v.norm(dim=-1)
        rows.append({
            "layer": l,
            "key_channel_max_over_median": float((ch.max(-1).values / med[:, 0]).max()),
            "key_channels_over_3x_median": int((ch > 3 * med).sum()),
            "key_channel_kurtosis_max": float(kur.max()),
            "key_absmax": float(k.abs().max()),
            "value_channel_std_max_over_min": float((vstd.max(-1).values /
                                                     vstd.min(-1).values.clamp_min(1e-6)).max()),
            "value_token_norm_cv": float((vt.std(-1) / vt.mean(-1)).mean()),
            "value_absmax": float(v.abs().max()),
            "value_channel_kurtosis_max": float(
                (((v - v.mean(1, keepdim=True)) ** 4).mean(1) /
                 (v.var(1) ** 2).clamp_min(1e-12)).max()),
        })
    return rows


def ci_binary(k, n):
    """Wilson 95% interval."""
    if n == 0:
        return (None, None)
    z = 1.96
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, c - h), min(1.0, c + h))


def ci_mean(x):
    x = np.asarray(x, float)
    if len(x) < 2:
        return (None, None)
    h = 1.96 * x.std(ddof=1) / math.sqrt(len(x))
    return (float(x.mean() - h), float(x.mean() + h))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--render", metavar="JSON", help="only write the .md of a JSON written "
                    "before")
    ap.add_argument("--pool", nargs="+", metavar="JSON", help="only write the pooled table of "
                    "several models' JSONs to --out.md")
    ap.add_argument("--scorers", nargs="+", metavar="JSON", help="only write the table of the "
                    "default policy's scorer against the single scorers (paired, per model, "
                    "length and ratio) of several models' JSONs to --out.md")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="only merge one model's JSONs "
                    "of different lengths into --out .json/.md")
    ap.add_argument("--model")
    ap.add_argument("--corpus")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--n-loss", type=int, default=50)
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--config-set", default="default", choices=sorted(CONFIG_SETS),
                    help="the configurations measured when --configs is not given")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-seconds", type=float, default=0)
    ap.add_argument("--out")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--kvpress", default=os.environ.get("KVCOMP_KVPRESS_WHEEL", ""),
                    metavar="WHEEL", help="kvpress's wheel (or its unpacked directory) for the "
                    "kvpress configurations; without it (or when its presses do not load) those "
                    "configurations are left out and the run says so")
    ap.add_argument("--calib", default="", metavar="CORPUS",
                    help="a corpus (tar.xz or directory) whose train_en.bin / train_code.bin "
                         "calibrate the pca codecs' bases (never the held-out split)")
    ap.add_argument("--calib-windows", type=int, default=8,
                    help="calibration windows (English and code in turn) of the longest length")
    ap.add_argument("--shard", default="0/1", metavar="I/K",
                    help="run only the rounds j with j %% K == I (several processes, or GPUs, "
                         "share one length; --merge joins their JSONs); each round draws its "
                         "samples from its own generator (seed, length, j)")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            write_md(args.render[:-5] + ".md", json.load(f))
        return
    if args.pool:
        write_pool(args.out + ".md", args.pool)
        return
    if args.scorers:
        write_scorers(args.out + ".md", args.scorers)
        return
    if args.merge:  # one model's lengths and shards, run as separate processes, into one result
        res = [json.load(open(p)) for p in args.merge]
        out = res[0]
        out["meta"]["merged_from"] = [
            {"file": os.path.basename(p), "commit": r["meta"]["commit"],
             "date": r["meta"]["date"], "rounds": {L: pl["rounds"]
                                                   for L, pl in r["per_length"].items()}}
            for p, r in zip(args.merge, res)]
        for r in res[1:]:
            for Lb, pl in r["per_length"].items():
                have = out["per_length"].get(Lb)
                if have is None:
                    out["per_length"][Lb] = pl
                    out["meta"]["lengths"] = out["meta"]["lengths"] + [int(Lb)]
                    continue
                for key in ("scores",):  # another shard of a length: its rounds appended
                    for c in have[key]:
                        for t in have[key][c]:
                            have[key][c][t] += pl[key][c][t]
                for key in ("loss", "bytes_per_token", "entropy_bytes_per_token"):
                    for c in have[key]:
                        have[key][c] += pl[key][c]
                have["rounds"] += pl["rounds"]
            for Lb, st in r["kv_stats"].items():
                out["kv_stats"].setdefault(Lb, st)
            out["meta"]["seconds"] = max(out["meta"]["seconds"], r["meta"]["seconds"])
        out["meta"]["lengths"] = sorted(set(out["meta"]["lengths"]))
        out["meta"]["shards"] = len(res)
        with open(args.out + ".json", "w") as f:
            json.dump(out, f)
        write_md(args.out + ".md", out)
        return
    from transformers import AutoModelForCausalLM
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    model.set_attn_implementation("sdpa")
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.machine()
    parts = corpus_mod.load(args.corpus)
    en = np.frombuffer(parts["held_en.bin"], np.uint8)
    code = np.frombuffer(parts["held_code.bin"], np.uint8)
    words = ruler.word_list(en)
    cfgs = args.configs or CONFIG_SETS[args.config_set]
    unknown = [c for c in cfgs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations: {unknown}")
    kvpress_note = None
    if any((CONFIGS[c][2] or "").startswith("kvpress:") for c in cfgs):
        try:
            if not args.kvpress:
                raise FileNotFoundError("no --kvpress wheel given")
            kvpress_note = "kvpress from " + os.path.basename(args.kvpress.rstrip("/"))
            load_kvpress(args.kvpress)
            kvpress_caches(model, torch.arange(256) % 200 + 32, cfgs)  # fails here, not later
        except Exception as e:  # noqa: BLE001 - the rest of the run goes on without them
            kvpress_note = f"kvpress configurations left out ({type(e).__name__}: {e})"
            cfgs = [c for c in cfgs if not (CONFIGS[c][2] or "").startswith("kvpress:")]
        print(kvpress_note, flush=True)
    t0 = time.time()
    per_len = {}
    stats = {}

    def log(m):
        print(f"[{time.time() - t0:6.1f}s] {os.path.basename(args.model)} {m}", flush=True)

    budget_each = args.budget_seconds / len(args.lengths) if args.budget_seconds else 0
    shard, nshard = (int(x) for x in args.shard.split("/"))
    if not 0 <= shard < nshard:
        raise SystemExit(f"--shard {args.shard}: want I/K with 0 <= I < K")
    pca_meta = None
    if any(CONFIGS[c][0].startswith("pca") or CONFIGS[c][1].startswith("pca") for c in cfgs):
        if not args.calib:
            raise SystemExit("the pca configurations need --calib (a corpus with a train split)")
        pca_meta = calibrate_pca(model, corpus_mod.load(args.calib), max(args.lengths),
                                 args.calib_windows)
        log(f"pca bases calibrated on {args.calib_windows} windows")
    for Lb in args.lengths:
        tl = time.time()
        sc = {c: {t: [] for t in ruler.TASKS} for c in cfgs}
        loss = {c: [] for c in cfgs}
        bpt, ent = {c: [] for c in cfgs}, {c: [] for c in cfgs}
        q = Lb * 3 // 4
        starts_en = np.linspace(0, len(en) - Lb - 2, args.n_loss).astype(np.int64)
        starts_code = np.linspace(0, len(code) - Lb - 2, args.n_loss).astype(np.int64)
        taken = 0
        for j in range(max(args.n, args.n_loss)):
            if j % nshard != shard:
                continue
            if budget_each and time.time() - tl > budget_each:
                log(f"{Lb}: time budget reached after {taken} rounds")
                break
            taken += 1
            rng = np.random.default_rng([args.seed, Lb, j])
            if j < args.n_loss:  # loss window (English on even j, code on odd)
                t, s = (en, starts_en[j]) if j % 2 == 0 else (code, starts_code[j])
                w = torch.from_numpy(t[s:s + Lb].astype(np.int64))
                K, V, last = prefill(model, w[:q])
                if j == 0:
                    stats[Lb] = kv_stats(K, V)
                built = build(cfgs, K, V, kvpress_caches(model, w[:q], cfgs))
                lg = run_configs(model, built, q, w[q:-1].to(device), dtype)
                tgt = w[q:].to(device)
                for c in cfgs:
                    allg = torch.cat([last[None], lg[c]])
                    loss[c].append(float(torch.nn.functional.cross_entropy(allg, tgt)))
            if j < args.n:
                for ti, task in enumerate(ruler.TASKS):
                    smp = ruler.make(task, en if (j + ti) % 2 == 0 else code, rng, Lb,
                                     words=words)
                    ctx = torch.tensor(list(smp.context), dtype=torch.long)
                    tail = torch.tensor(list(smp.question + smp.answer), dtype=torch.long)
                    K, V, _ = prefill(model, ctx)
                    built = build(cfgs, K, V, kvpress_caches(model, ctx, cfgs))
                    if ti == 0:
                        for c in cfgs:
                            bpt[c].append(built[c][2])
                            ent[c].append(built[c][3])
                    lg = run_configs(model, built, len(ctx), tail[:-1].to(device), dtype)
                    na = len(smp.answer)
                    for c in cfgs:
                        pred = lg[c][-na:].argmax(-1).cpu().numpy().astype(np.uint8)
                        sc[c][task].append(ruler.score(pred, smp))
            if taken % 10 == 0:
                log(f"{Lb}: {taken} rounds")
        per_len[Lb] = {"scores": sc, "loss": loss, "bytes_per_token": bpt,
                       "entropy_bytes_per_token": ent, "rounds": taken}
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ"),
            "commit": git_commit(), "model": args.model, "card": card, "device": str(device),
            "pca_calibration": pca_meta,
            "dtype": str(dtype), "torch": torch.__version__, "lengths": args.lengths,
            "n": args.n, "n_loss": args.n_loss, "shard": args.shard, "kvpress": kvpress_note,
            "corpus": json.loads(parts["manifest.json"]),
            "configs": {c: CONFIGS[c] for c in cfgs}, "seconds": time.time() - t0,
            "parameters": sum(p.numel() for p in model.parameters()),
            "model_config": {k: getattr(model.config, k, None) for k in (
                "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")}}
    res = {"meta": meta, "per_length": per_len, "kv_stats": stats}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f)
    write_md(args.out + ".md", res)
    log(f"wrote {args.out}.json/.md in {time.time() - t0:.0f} s")


def summarize(res):
    """Rows per (length, config): mean score per task with 95% interval, paired difference
    against the full cache, loss and bytes."""
    rows = []
    for Lb, r in res["per_length"].items():
        full = r["scores"]["full"]
        fl = np.array(r["loss"]["full"])
        bf16 = None
        for c in r["scores"]:
            row = {"length": int(Lb), "config": c}
            for t, v in r["scores"][c].items():
                v = np.array(v)
                n = len(v)
                binary = np.all((v == 0) | (v == 1))
                row[t] = float(v.mean()) if n else None
                if binary:
                    row[t + "_ci"] = ci_binary(v.sum(), n)
                else:  # normal approximation, clipped to the scores' range [0, 1]
                    lo, hi = ci_mean(v)
                    row[t + "_ci"] = (None, None) if lo is None else (max(0.0, lo), min(1.0, hi))
                d = v - np.array(full[t])
                row[t + "_diff_ci"] = ci_mean(d) if n > 1 else (None, None)
                row["n"] = n
            ls = np.array(r["loss"][c])
            row["loss"] = float(ls.mean()) if len(ls) else None
            row["loss_pct"] = float(100 * (ls.mean() / fl.mean() - 1)) if len(ls) else None
            rel = 100 * (ls / fl - 1) if len(ls) else np.array([])
            row["loss_pct_ci"] = ci_mean(rel)
            row["n_loss"] = len(ls)
            b = float(np.mean(r["bytes_per_token"][c]))
            e = float(np.mean(r["entropy_bytes_per_token"][c]))
            if c == "full":
                bf16 = b
            row["bytes_per_token"], row["entropy_bytes_per_token"] = b, e
            rows.append(row)
        for row in rows:
            if row["length"] == int(Lb):
                row["x"] = bf16 / row["bytes_per_token"]
                row["x_entropy"] = bf16 / row["entropy_bytes_per_token"]
    return rows


def write_pool(path, paths):
    """Bytes against loss of every configuration on every model and length (one table), with
    the worst loss over them and the single/multi-key needles where the full cache finds them."""
    res = [json.load(open(p)) for p in paths]
    summ = [summarize(r) for r in res]
    names = [os.path.basename(p).rsplit("-", 1)[-1][:-5] for p in paths]
    lens = sorted({r["length"] for s in summ for r in s})
    cfgs = list(dict.fromkeys(r["config"] for s in summ for r in s))
    head = [f"{n} {L}" for n in names for L in lens]
    out = ["# Codecs and policies pooled over models (RULER-style suite)", "",
           "Loss relative to each model's full cache (nats/byte, last quarter of held-out "
           "windows), per model and context length; worst = the largest over all of them. "
           "Needles: single and multi-key accuracy where the full cache scores >= 0.9 (the "
           "other tasks are at the floor on every model: see the per-model tables). Sources: "
           + ", ".join(os.path.basename(p) for p in paths) + ".", "",
           "| config | x | x entropy-coded | " + " | ".join(head) + " | worst | needles |",
           "| --- | --- | --- | " + " | ".join("---" for _ in head) + " | --- | --- |"]
    for c in cfgs:
        cells, worst, needles, x, xe = [], -1e9, [], None, None
        for n, s in zip(names, summ):
            for L in lens:
                r = next((r for r in s if r["config"] == c and r["length"] == L), None)
                if r is None:  # not run on this model at this length
                    cells.append("-")
                    continue
                full = next(r for r in s if r["config"] == "full" and r["length"] == L)
                x, xe = r["x"], r["x_entropy"]
                cells.append(f"{r['loss_pct']:+.2f}%")
                worst = max(worst, r["loss_pct"])
                for t in ("niah_single", "niah_multikey"):
                    if full[t] >= 0.9:
                        needles.append(f"{n} {L} {t[5:]} {r[t]:.2f}")
        out.append(f"| {c} | {x:.2f} | {xe:.2f} | " + " | ".join(cells) +
                   f" | {worst:+.2f}% | {'; '.join(needles)} |")
    ns = [f"{n} {L}: n = {next(r['n'] for r in s if r['length'] == L)} per task, "
          f"{next(r['n_loss'] for r in s if r['length'] == L)} loss windows"
          for n, s in zip(names, summ) for L in lens if any(r["length"] == L for r in s)]
    out += ["", "Samples: " + "; ".join(ns) + "."]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


SINGLE_SCORERS = ("manifold", "keydiff", "knorm", "streaming")  # kvcomp's scorers alone
# manifold + a recent share (manifold_rNN, manifold_rNNsS with S sink tokens)
CANDIDATES = ("manifold_r50", "manifold_r75", "manifold_r80", "manifold_r85", "manifold_r90",
              "manifold_r75s16", "manifold_r80s16", "manifold_r85s16", "manifold_r80s64",
              "keydiff_r75", "keydiff_r85")


def scorer_rows(pl, ratio):
    """The eviction-only configurations of one ratio in a length's results, the default's
    scorer first: single scorers, candidates, then anything else (kvpress's presses)."""
    names = [c[:-len(ratio) - 1] for c in pl["loss"] if c.endswith(f" {ratio}") and "+" not in c]
    order = [x for x in SINGLE_SCORERS + CANDIDATES if x in names]
    return order + [x for x in names if x not in order]


def criterion(rows, scores, Lb, ratio, names, tol=0.3):
    """The default-policy criterion for one (length, ratio): each candidate against the best
    single scorer: loss within `tol` points of the lowest single-scorer loss, and single and
    multi-key needles within the 95% interval of the best single scorer's (the 95% interval of
    the paired per-sample difference to the single scorer with the most needles reaches 0).
    `scores`: the length's per-sample scores ({config: {task: [..]}}). Returns (best loss,
    best needles, {name: (points behind, needles kept, meets)})."""
    def row(c):
        return next(x for x in rows if x["config"] == c and x["length"] == int(Lb))
    singles = [f"{sc} {ratio}" for sc in SINGLE_SCORERS if f"{sc} {ratio}" in scores]
    best_loss = min(row(c)["loss_pct"] for c in singles)
    tasks = ("niah_single", "niah_multikey")
    best_cfg = {t: max(singles, key=lambda c: float(np.mean(scores[c][t] or [0])))
                for t in tasks}
    best_need = {t: float(np.mean(scores[best_cfg[t]][t] or [0])) for t in tasks}
    verdict = {}
    for c in names:
        dl = row(c)["loss_pct"] - best_loss
        needles_ok = True
        for t in tasks:
            d = np.array(scores[c][t], float) - np.array(scores[best_cfg[t]][t], float)
            if len(d) > 1 and d.any():
                needles_ok &= ci_mean(d)[1] >= 0
        verdict[c] = (dl, bool(needles_ok), bool(dl <= tol and needles_ok))
    return best_loss, best_need, verdict


def write_scorers(path, paths, ratios=("0.5", "0.75")):
    """Per model, length and ratio: each single scorer's, candidate's and peer press's loss
    against the full cache and, paired over the same windows, against the default policy's
    selection (manifold, no recent window), in points of the full cache's loss; single and
    multi-key needles with 95% intervals; then the default-policy criterion per candidate."""
    out = ["# The default policy's scorer against the single scorers, per model", "",
           "Loss: relative to the full cache (ratio of means; 95% interval of the per-window "
           "ratios in brackets). Paired: mean and 95% half-width over the same windows of "
           "(loss - loss of manifold) / full loss, in points. Needles: accuracy with Wilson 95% "
           "intervals. manifold_rNN: manifold with NN% of each head's kept budget the most "
           "recent tokens (recent_fraction 0.NN; 4 sink tokens as in every protected policy; "
           "manifold_rNNsS: S sink tokens). "
           "kvpress NAME: kvpress's press of that name from its wheel. The suite models "
           "eviction without the moment correction. Sources: "
           + ", ".join(os.path.basename(p) for p in paths) + ".", ""]
    crit = []
    for p in paths:
        r = json.load(open(p))
        rows = summarize(r)
        name = os.path.basename(p).rsplit("-", 1)[-1][:-5]
        m = r["meta"]
        runs = (f"commit {m['commit']}, {m['date']}" if "merged_from" not in m else
                "; ".join(sorted({f"commit {x['commit']}, {x['date']}"
                                  for x in m["merged_from"]})))
        out += [f"## {name} ({m['parameters']} parameters; {m['card']}, {runs})", "",
                "| length | ratio | scorer | loss vs full | paired vs manifold | single | "
                "multi-key | multi-value | vt | n |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for Lb in sorted(r["per_length"], key=int):
            pl = r["per_length"][Lb]
            fl = np.array(pl["loss"]["full"])
            for ratio in ratios:
                if f"manifold {ratio}" not in pl["loss"]:
                    continue
                base = np.array(pl["loss"][f"manifold {ratio}"])
                for sc in scorer_rows(pl, ratio):
                    c = f"{sc} {ratio}"
                    row = next(x for x in rows if x["config"] == c and x["length"] == int(Lb))
                    d = 100 * (np.array(pl["loss"][c]) - base) / fl
                    h = 1.96 * d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
                    lo, hi = row["loss_pct_ci"]
                    lo = float("nan") if lo is None else lo
                    hi = float("nan") if hi is None else hi
                    cells = []
                    for t in ("niah_single", "niah_multikey"):
                        a, b = row[t + "_ci"]
                        cells.append(f"{row[t]:.2f} [{a:.2f},{b:.2f}]" if a is not None
                                     else f"{row[t]:.2f}")
                    paired = "-" if sc == "manifold" else f"{d.mean():+.2f} +- {h:.2f}"
                    out.append(f"| {Lb} | {ratio} | {sc} | {row['loss_pct']:+.2f}% "
                               f"[{lo:+.2f},{hi:+.2f}] | {paired} | " + " | ".join(cells) +
                               f" | {row['niah_multivalue']:.2f} | {row['vt']:.2f} | "
                               f"{row['n']} / {row['n_loss']} |")
                cands = [f"{x} {ratio}" for x in ("manifold",) + CANDIDATES
                         if f"{x} {ratio}" in pl["loss"]]
                if not all(f"{sc} {ratio}" in pl["loss"] for sc in SINGLE_SCORERS):
                    continue  # the criterion needs every single scorer
                bl, bn, v = criterion(rows, pl["scores"], Lb, ratio, cands)
                for c in cands:
                    dl, nok, ok = v[c]
                    crit.append((c.rsplit(" ", 1)[0], name, Lb, ratio, bl, bn, dl, nok, ok))
        out.append("")
    if crit:
        out += ["## The default-policy criterion", "",
                "At or above the best single scorer (manifold, keydiff, knorm, streaming) at "
                "each ratio: loss within 0.3 point of the lowest single-scorer loss, and single "
                "and multi-key needles within the 95% interval of the best single scorer's (the "
                "95% interval of the paired per-sample difference to the single scorer with the "
                "most needles reaches 0). Points = candidate's loss minus the lowest single-"
                "scorer loss, in % of the full cache's loss.", "",
                "| candidate | model | length | ratio | best single loss | best needles "
                "(single / multi-key) | candidate - best, points | needles | meets |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c, name, Lb, ratio, bl, bn, dl, nok, ok in crit:
            out.append(f"| {c} | {name} | {Lb} | {ratio} | {bl:+.2f}% | "
                       f"{bn['niah_single']:.2f} / {bn['niah_multikey']:.2f} | {dl:+.2f} | "
                       f"{'kept' if nok else 'lost'} | {'yes' if ok else 'no'} |")
        out += ["", "| candidate | cells met | worst points behind | needles lost in |",
                "| --- | --- | --- | --- |"]
        for c in dict.fromkeys(x[0] for x in crit):
            mine = [x for x in crit if x[0] == c]
            lost = [f"{x[1]} {x[2]} {x[3]}" for x in mine if not x[7]]
            out.append(f"| {c} | {sum(x[8] for x in mine)} of {len(mine)} | "
                       f"{max(x[6] for x in mine):+.2f} | {', '.join(lost) or 'none'} |")
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_md(path, res):
    m = res["meta"]
    rows = summarize(res)
    ab = {"niah_single": "single", "niah_multikey": "mkey", "niah_multivalue": "mval",
          "niah_multiquery": "mquery", "vt": "vt", "cwe": "cwe", "fwe": "fwe"}
    src = ""
    if len({x["commit"] for x in m.get("merged_from", [])} | {m["commit"]}) > 1:
        src = " (merged runs: " + "; ".join(
            f"{x['file']} commit {x['commit']} date {x['date']}" for x in m["merged_from"]) + ")"
    out = [f"# RULER-style suite: {m['model']}", "",
           f"date {m['date']}, commit {m['commit']}{src}, {m['card']} ({m['device']}, {m['dtype']}), "
           f"torch {m['torch']}; {m['parameters']} parameters {m['model_config']}; held-out "
           f"corpus English {m['corpus']['en']['held_sha256']} / code "
           f"{m['corpus']['code']['held_sha256']}; {m['seconds']:.0f} s. Scores: mean item "
           f"accuracy (n per task in the table; 95% interval in brackets: Wilson for 0/1 "
           f"tasks, normal for the multi-item ones); a task marked * is below the full cache "
           f"beyond the 95% interval of the paired difference. Loss: nats/byte over the last "
           f"quarter of the windows, relative to the full cache (95% interval of the paired "
           f"relative difference). x: bf16 bytes over stored bytes; x ent.: with the codes "
           f"entropy-coded (order 0).", ""]
    for Lb in sorted({r["length"] for r in rows}):
        out += [f"## {Lb} bytes", "",
                "| config | x | x ent. | " + " | ".join(ab.values()) + " | loss | loss vs full |",
                "| --- | --- | --- | " + " | ".join("---" for _ in ab) + " | --- | --- |"]
        for r in rows:
            if r["length"] != Lb:
                continue
            cells = []
            for t in ab:
                lo, hi = r[t + "_ci"]
                dlo, dhi = r[t + "_diff_ci"]
                star = "*" if (dhi is not None and dhi < 0) else ""
                cells.append(f"{r[t]:.2f}{star} [{lo:.2f},{hi:.2f}]" if lo is not None
                             else f"{r[t]:.2f}")
            lo, hi = r["loss_pct_ci"]
            lt = "-" if r["loss"] is None else f"{r['loss']:.4f}"
            lp = "-" if r["loss_pct"] is None else f"{r['loss_pct']:+.2f}%"
            li = "" if lo is None else f" [{lo:+.2f},{hi:+.2f}]"
            out.append(f"| {r['config']} | {r['x']:.2f} | {r['x_entropy']:.2f} | "
                       + " | ".join(cells) + f" | {lt} | {lp}{li} (n {r['n_loss']}) |")
        out.append(f"\nn = {next(r['n'] for r in rows if r['length'] == Lb)} per task.\n")
    out += ["## KV statistics of the full cache (first loss window)", "",
            "| length | layer | key ch. max/median | key ch. > 3x median | key kurtosis max | "
            "key absmax | value ch. std max/min | value norm CV | value absmax |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for Lb, st in res["kv_stats"].items():
        for s in st:
            out.append(f"| {Lb} | {s['layer']} | {s['key_channel_max_over_median']:.1f} | "
                       f"{s['key_channels_over_3x_median']} | {s['key_channel_kurtosis_max']:.1f}"
                       f" | {s['key_absmax']:.1f} | {s['value_channel_std_max_over_min']:.1f} | "
                       f"{s['value_token_norm_cv']:.2f} | {s['value_absmax']:.2f} |")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

"""kvpress's own presses on one layer, timed on the card that runs kvcomp's kernels.

kvpress (PyPI, pure Python) is loaded from its wheel without its package __init__ (which patches
transformers' attention functions and imports every press with their optional dependencies): the
presses compared here need only torch and their base classes. Where the base classes do not
import (a transformers release kvpress does not support), they are replaced by the two names the
presses use, and the run says so.

One layer: 8 kv heads, head_dim 128, bf16, compression ratio 0.5, fresh random K and V;
`press.compress(module, hidden_states, keys, values, None, {})` as kvpress's forward hook calls
it (score, top-k, gather). Lengths 2K to 128K and a batch of 64 requests of 2K tokens (kvpress
takes the batch as its first dimension). Manifold, which kvpress lacks, comes from
torch_reference.py. Device-to-device copy of K and V in the same run; limit_x = the press's time
over the time a copy of the minimal bytes (read K and V, write the kept K and V) takes at that
bandwidth: the largest speed-up any implementation can have over the press.

  python3 bench/gpu/kvpress_bench.py [path/to/kvpress-*.whl]
"""
import glob
import importlib
import os
import sys
import types
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference  # noqa: E402

H, D, RATIO = 8, 128, 0.5


def load_kvpress(wheel):
    sys.path.insert(0, wheel)
    for name, sub in (("kvpress", "kvpress"), ("kvpress.presses", "kvpress/presses")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(wheel, sub)]
        sys.modules[name] = pkg
    stubbed = False
    try:
        importlib.import_module("kvpress.presses.base_press")
    except Exception as e:  # transformers names kvpress expects but this release lacks
        print(f"kvpress base classes stubbed ({type(e).__name__}: {e})", flush=True)
        stubbed = True
        utils = types.ModuleType("kvpress.utils")
        utils.compute_n_kept = lambda k_len, ratio: 0 if ratio >= 1.0 else max(
            1, int(k_len * (1 - ratio)))
        sys.modules["kvpress.utils"] = utils
        base = types.ModuleType("kvpress.presses.base_press")

        @dataclass
        class BasePress:
            pass

        base.BasePress = BasePress
        sys.modules["kvpress.presses.base_press"] = base
    presses = {}
    for key, mod, cls, kw in (("knorm", "knorm_press", "KnormPress", {}),
                              ("streaming", "streaming_llm_press", "StreamingLLMPress",
                               {"n_sink": 4}),
                              ("keydiff", "keydiff_press", "KeyDiffPress", {}),
                              ("random", "random_press", "RandomPress", {"seed": 0})):
        m = importlib.import_module(f"kvpress.presses.{mod}")
        presses[key] = getattr(m, cls)(compression_ratio=RATIO, **kw)
    return presses, stubbed


class Module:  # what ScorerPress.compress reads of the attention module
    head_dim = D


def main():
    wheel = sys.argv[1] if len(sys.argv) > 1 else (sorted(glob.glob(".whl/kvpress-*.whl")) or [""])[-1]
    if not wheel or not os.path.exists(wheel):
        print("kvpress wheel not found (pip download kvpress into .whl/)")
        return 2
    presses, stubbed = load_kvpress(wheel)
    print(f"kvpress {os.path.basename(wheel)} base={'stub' if stubbed else 'real'} torch "
          f"{torch.__version__} {torch.cuda.get_device_name(0)}", flush=True)
    dev = torch.device("cuda")
    module = Module()
    cases = [(1, n) for n in (2048, 8192, 32768, 65536, 131072)] + [(64, 2048)]
    for batch, n in cases:
        k = torch.randn(batch, H, n, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(batch, H, n, D, device=dev, dtype=torch.bfloat16)
        hidden = torch.empty(batch, n, 1, device=dev, dtype=torch.bfloat16)  # unused by these presses
        kept = max(1, int(n * (1 - RATIO)))
        kv = torch.cat([k, v])
        dst = torch.empty_like(kv)
        copy_us = torch_reference.median_us(lambda: dst.copy_(kv))
        copy_gbps = 2 * kv.numel() * 2 / (copy_us * 1e3)
        minimal = 2 * k.numel() * 2 + 2 * batch * H * kept * D * 2
        limit_us = minimal / (copy_gbps * 1e3)
        runs = {name: (lambda p=p: p.compress(module, hidden, k, v, None, {}))
                for name, p in presses.items()}
        runs["manifold"] = lambda: torch_reference.compress("manifold", k.view(-1, H, n, D),
                                                            v.view(-1, H, n, D), kept)
        for name, fn in runs.items():
            ko, vo = fn()
            assert ko.shape == (batch, H, kept, D), (name, ko.shape)
            us = torch_reference.median_us(fn)
            gbps = minimal / (us * 1e3)
            src = "torch_reference" if name == "manifold" else "kvpress"
            print(f"RESULT bench=kvpress source={src} scorer={name} batch={batch} tokens={n} "
                  f"us={us:.1f} GBps={gbps:.0f} copy_GBps={copy_gbps:.0f} "
                  f"press/copy={100 * gbps / copy_gbps:.0f}% limit_x={us / limit_us:.1f}",
                  flush=True)
        del k, v, kv, dst, hidden
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Packs a trained model's bf16 weights as int8 rows with one f32 scale each (about half the
bytes, for carrying a checkpoint where space is short) and unpacks them into a Hugging Face
model directory to resume training from (train.py --init-from). Lossy: each weight is rounded to
1/127 of its row's largest magnitude, a perturbation training absorbs in its first steps.

    python3 pack_weights.py pack MODEL_DIR OUT.npz
    python3 pack_weights.py unpack OUT.npz CONFIG_DIR OUT_DIR   (CONFIG_DIR: config.json's dir)
"""

import json
import os
import shutil
import sys

import numpy as np
import torch


def pack(model_dir, out):
    from safetensors.torch import load_file
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    arrs = {}
    for name, t in sd.items():
        t = t.float()
        rows = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
        scale = rows.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
        arrs[name + "::q"] = q.numpy()
        arrs[name + "::s"] = scale.numpy().astype(np.float32)
        arrs[name + "::shape"] = np.array(t.shape, np.int64)
    np.savez_compressed(out, **arrs)


def unpack(npz, config_dir, out_dir):
    from safetensors.torch import save_file
    z = np.load(npz)
    names = sorted({k.split("::")[0] for k in z.files})
    sd = {}
    for n in names:
        q = torch.from_numpy(z[n + "::q"]).float()
        s = torch.from_numpy(z[n + "::s"])
        sd[n] = (q * s).reshape(tuple(z[n + "::shape"])).to(torch.bfloat16).contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(config_dir, f)):
            shutil.copy(os.path.join(config_dir, f), os.path.join(out_dir, f))


if __name__ == "__main__":
    if sys.argv[1] == "pack":
        pack(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "unpack":
        unpack(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(__doc__)

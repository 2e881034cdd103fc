"""Trains the project's small byte-level LlamaForCausalLM (docs/model-card.md).

    python3 bench/quality/lm/train.py --out DIR [--seconds 460] [--device cuda]

Training text: the Python sources of the installed packages (site-packages of the running
interpreter; the standard library is never read: it is the held-out text, see tasks.py), with
pass-key samples mixed in (tasks.make_passkey: 1 to 4 keys, half of them with colliding names,
asked at the end). The loss is next-byte cross-entropy over every position plus the mean loss
over the answer bytes of pass-key samples. The schedule is set by wall-clock time (warmup, then
cosine to 10%); a checkpoint (model.safetensors in bf16, config.json) is written to --out every
--checkpoint-seconds and at the end, followed by the held-out loss and pass-key accuracy at
--seq-len with the full cache (train_log.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import site
import sys
import sysconfig
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def model_config(seq_len: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=2 * seq_len, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, attention_bias=False,
        mlp_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def training_text(max_bytes: int, exclude_names: set, log) -> np.ndarray:
    roots = []
    for r in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]:
        if os.path.isdir(r) and r not in roots:
            roots.append(r)
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    files = []
    for root in roots:
        for dp, dn, fn in os.walk(root):
            dn[:] = [d for d in dn if d not in ("__pycache__",) and "_vendor" not in d]
            if os.path.realpath(dp).startswith(stdlib + os.sep) and not root.startswith(stdlib):
                continue
            for f in fn:
                if f.endswith(".py") and f not in exclude_names:
                    files.append(os.path.join(dp, f))
    files.sort()
    rng = np.random.default_rng(1)
    rng.shuffle(files)
    blobs, total = [], 0
    for p in files:
        try:
            with open(p, "rb") as fh:
                b = fh.read()
        except OSError:
            continue
        if len(b) < 512:
            continue
        blobs.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    log(f"training text: {len(blobs)} files, {total / 1e6:.1f} MB from {roots}")
    return tasks.concat(blobs)


def batch(text, rng, bsz, seq_len, passkey_frac):
    x = np.empty((bsz, seq_len + 1), np.uint8)
    w = np.zeros((bsz, seq_len), np.float32)  # answer-byte mask (targets)
    for i in range(bsz):
        if rng.random() < passkey_frac:
            n = int(rng.integers(1, 5))
            s = tasks.make_passkey(text, rng, seq_len + 1, n_keys=n,
                                   colliding=bool(rng.random() < 0.5))
            b = s.context + s.question + s.answer
            x[i] = np.frombuffer(b, np.uint8)
            w[i, seq_len - tasks.DIGITS:] = 1.0
        else:
            o = int(rng.integers(0, len(text) - seq_len - 1))
            x[i] = text[o:o + seq_len + 1]
    return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(w)


@torch.no_grad()
def evaluate(model, heldout, seq_len, device, n_loss=32, n_pk=100):
    model.eval()
    rng = np.random.default_rng(12345)
    losses = []
    starts = np.linspace(0, len(heldout) - seq_len - 2, n_loss).astype(np.int64)
    for s in starts:
        x = torch.from_numpy(heldout[s:s + seq_len + 1].astype(np.int64))[None].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1]).logits.float()
        # the last quarter, as the harness measures it
        q = seq_len * 3 // 4
        losses.append(torch.nn.functional.cross_entropy(logits[0, q:], x[0, q + 1:]).item())
    acc = {}
    for name, n_keys, coll in (("passkey_1", 1, False), ("passkey_3_colliding", 3, True)):
        ok = 0
        for _ in range(n_pk):
            s = tasks.make_passkey(heldout, rng, seq_len, n_keys=n_keys, colliding=coll)
            prompt = s.context + s.question
            x = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
            got = []
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                enabled=device.type == "cuda"):
                out = model(x, use_cache=True)
                past = out.past_key_values
                for _ in range(tasks.DIGITS):
                    t = out.logits[0, -1].argmax().item()
                    got.append(t)
                    out = model(torch.tensor([[t]], device=device), past_key_values=past,
                                use_cache=True)
                    past = out.past_key_values
            ok += bytes(got) == s.answer
        acc[name] = ok / n_pk
    model.train()
    return {"heldout_loss_last_quarter": float(np.mean(losses)), **acc}


def save(model, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    m = model.to(torch.bfloat16)
    m.save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=460)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--passkey-frac", type=float, default=0.5)
    ap.add_argument("--text-mb", type=float, default=400)
    ap.add_argument("--checkpoint-seconds", type=float, default=90)
    ap.add_argument("--eval-n", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-dir", default=None,
                    help="directory of the held-out .py files (default: this interpreter's "
                         "standard library)")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "train.log"), "a")

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    t_start = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    held_paths = tasks.heldout_files(args.heldout_dir)
    held_blobs = tasks.read_files(held_paths)
    heldout = tasks.concat(held_blobs)
    log(f"held-out: {len(held_paths)} stdlib files, {len(heldout)} bytes, digest "
        f"{tasks.digest(held_blobs)} ({args.heldout_dir or tasks.stdlib_dir()})")
    text = training_text(int(args.text_mb * 1e6), {os.path.basename(p) for p in held_paths}, log)

    cfg = model_config(args.seq_len)
    model = LlamaForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters, device {device}, torch {torch.__version__}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=device.type == "cuda")
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    last_ckpt = t0
    step, tokens = 0, 0
    hist = []
    while True:
        elapsed = time.time() - t0
        if elapsed >= args.seconds or (args.max_steps and step >= args.max_steps):
            break
        frac = elapsed / args.seconds
        cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * frac))  # 1 -> 0.1 over the budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * cosine
        for g in opt.param_groups:
            g["lr"] = lr
        x, w = batch(text, rng, args.batch, args.seq_len, args.passkey_frac)
        x, w = x.to(device, non_blocking=True), w.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256),
                                                x[:, 1:].reshape(-1), reduction="none")
        nll = nll.view(args.batch, args.seq_len)
        lm = nll.mean()
        ans = (nll * w).sum() / w.sum().clamp(min=1.0)
        loss = lm + ans
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += args.batch * args.seq_len
        if step % 50 == 0 or step == 1:
            rec = {"step": step, "seconds": round(time.time() - t0, 1), "lr": lr,
                   "lm_loss": lm.item(), "answer_loss": ans.item(), "tokens": tokens}
            hist.append(rec)
            log(json.dumps(rec))
        if time.time() - last_ckpt > args.checkpoint_seconds:
            save(model, args.out)
            last_ckpt = time.time()
            log(f"checkpoint at step {step}")
    train_seconds = time.time() - t0
    save(model, args.out)
    log(f"trained {step} steps, {tokens} tokens in {train_seconds:.0f} s; evaluating")
    # evaluate the bf16 weights as saved
    model = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(device)
    ev = evaluate(model, heldout, args.seq_len, device, n_pk=args.eval_n)
    log(json.dumps(ev))
    info = {"steps": step, "tokens": tokens, "train_seconds": train_seconds,
            "parameters": n_params, "seq_len": args.seq_len, "batch": args.batch,
            "lr": args.lr, "passkey_frac": args.passkey_frac, "eval": ev,
            "heldout_files": [os.path.basename(p) for p in held_paths],
            "heldout_digest": tasks.digest(held_blobs),
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "history": hist,
            "wall_seconds": time.time() - t_start}
    import transformers
    info["transformers"] = transformers.__version__
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(info, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()

"""Trains the project's byte-level LlamaForCausalLM models (docs/model-card.md).

    python3 bench/quality/lm/train.py --out DIR [--seconds 460] [--device cuda]
    python3 bench/quality/lm/train.py --out DIR --arch g16|d8 --corpus corpus.tar.xz \
        --seq-len 8192 --short-len 2048 [--resume]

--arch small (default) is the committed code model below. --arch g16 (hidden 512, 4 layers, 16
query / 2 kv heads) and d8 (hidden 384, 8 layers, 8 query / 1 kv head) are the GQA 8:1 models
(head_dim 128, RoPE theta 500000, 8K context): they read the mixed English + code corpus of
bench/quality/corpus.py (--corpus; --en-frac of the text windows English) and the RULER-style
tasks of bench/quality/ruler.py (--task-frac of the sequences, the seven tasks in turn), the
first --short-frac of the time at --short-len bytes (the same tokens per step), the rest at
--seq-len. --resume continues from DIR's last checkpoint (weights, optimizer, step, schedule
position; trainer_state.pt beside the weights).

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


ARCHS = {  # hidden, intermediate, layers, query heads, kv heads, rope theta
    "g16": (512, 1024, 4, 16, 2, 500000.0),
    "d8": (384, 896, 8, 8, 1, 500000.0),
}


def model_config(seq_len: int, arch: str = "small") -> LlamaConfig:
    if arch != "small":
        h, inter, nl, nq, nk, theta = ARCHS[arch]
        return LlamaConfig(
            vocab_size=256, hidden_size=h, intermediate_size=inter, num_hidden_layers=nl,
            num_attention_heads=nq, num_key_value_heads=nk, head_dim=128,
            max_position_embeddings=2 * seq_len, rms_norm_eps=1e-5, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None, pad_token_id=0, attention_bias=False,
            mlp_bias=False, rope_parameters={"rope_type": "default", "rope_theta": theta})
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


class Mixed:
    """Text windows (English with probability en_frac, else code) and RULER-style task
    samples, from one split of the corpus."""

    def __init__(self, parts, split, en_frac):
        self.en = np.frombuffer(parts[f"{split}_en.bin"], np.uint8)
        self.code = np.frombuffer(parts[f"{split}_code.bin"], np.uint8)
        self.en_frac = en_frac
        self.words = ruler.word_list(self.en)

    def text(self, rng):
        return self.en if rng.random() < self.en_frac else self.code


def batch_mixed(mx, rng, bsz, seq_len, task_frac, step, task_weights=None):
    """task_weights: the tasks' shares of the task samples (ruler.TASKS order), drawn at
    random; None: the tasks in turn."""
    x = np.empty((bsz, seq_len + 1), np.uint8)
    w = np.zeros((bsz, seq_len), np.float32)
    for i in range(bsz):
        t = mx.text(rng)
        if rng.random() < task_frac:
            if task_weights is None:
                task = ruler.TASKS[(step * bsz + i) % len(ruler.TASKS)]
            else:
                task = ruler.TASKS[int(rng.choice(len(ruler.TASKS), p=task_weights))]
            s = ruler.make(task, t, rng, seq_len + 1, words=mx.words)
            b = s.context + s.question + s.answer
            x[i] = np.frombuffer(b, np.uint8)
            w[i, seq_len - len(s.answer):] = 1.0
        else:
            o = int(rng.integers(0, len(t) - seq_len - 1))
            x[i] = t[o:o + seq_len + 1]
    return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(w)


class _MixedBatches(torch.utils.data.IterableDataset):
    """batch_mixed in worker processes (--workers): each worker draws from its own generator
    (seed, worker, phase) and rotates the tasks by its own batch count."""

    def __init__(self, mx, seed, phase, bsz, seq_len, task_frac, task_weights):
        self.mx, self.seed, self.phase = mx, seed, phase
        self.bsz, self.seq_len, self.task_frac = bsz, seq_len, task_frac
        self.task_weights = task_weights

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        rng = np.random.default_rng([self.seed, wid, self.phase])
        k = 0
        while True:
            yield batch_mixed(self.mx, rng, self.bsz, self.seq_len, self.task_frac, k,
                              self.task_weights)
            k += 1


def mixed_loader(mx, seed, phase, bsz, seq_len, task_frac, task_weights, workers):
    ds = _MixedBatches(mx, seed, phase, bsz, seq_len, task_frac, task_weights)
    return iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                            prefetch_factor=4, pin_memory=True,
                                            persistent_workers=False))


@torch.no_grad()
def evaluate_mixed(model, mx, lengths, device, n_loss=16, n_task=20):
    """Full-cache held-out loss (last quarter of windows, English and code) and RULER-style
    task scores (teacher-forced greedy bytes) at each length."""
    model.eval()
    out = {}
    for L in lengths:
        rng = np.random.default_rng(12345)
        for kind, t in (("en", mx.en), ("code", mx.code)):
            losses = []
            for s in np.linspace(0, len(t) - L - 2, n_loss).astype(np.int64):
                x = torch.from_numpy(t[s:s + L + 1].astype(np.int64))[None].to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16,
                                    enabled=device.type == "cuda"):
                    lg = model(x[:, :-1]).logits.float()
                q = L * 3 // 4
                losses.append(torch.nn.functional.cross_entropy(lg[0, q:], x[0, q + 1:]).item())
            out[f"loss_{kind}_{L}"] = float(np.mean(losses))
        for task in ruler.TASKS:
            sc = []
            for j in range(n_task):
                smp = ruler.make(task, mx.en if j % 2 == 0 else mx.code, rng, L, words=mx.words)
                b = smp.context + smp.question + smp.answer
                x = torch.tensor(list(b), dtype=torch.long, device=device)[None]
                with torch.autocast(device.type, dtype=torch.bfloat16,
                                    enabled=device.type == "cuda"):
                    lg = model(x[:, :-1]).logits
                na = len(smp.answer)
                pred = lg[0, -na:].argmax(-1).cpu().numpy().astype(np.uint8)
                sc.append(ruler.score(pred, smp))
            out[f"{task}_{L}"] = float(np.mean(sc))
    model.train()
    return out


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


def save(model, out_dir, opt=None, state=None):
    os.makedirs(out_dir, exist_ok=True)
    if opt is not None:  # resumable: fp32 weights, optimizer, step and schedule position
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), **(state or {})},
                   os.path.join(out_dir, "trainer_state.pt.tmp"))
        os.replace(os.path.join(out_dir, "trainer_state.pt.tmp"),
                   os.path.join(out_dir, "trainer_state.pt"))
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
    ap.add_argument("--eval-lengths", type=int, nargs="+", default=None,
                    help="context lengths of the final evaluation (default 4096 and --seq-len)")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", default="small", choices=["small"] + sorted(ARCHS))
    ap.add_argument("--corpus", default=None, help="corpus.tar.xz of bench/quality/corpus.py "
                    "(English + code, RULER-style tasks); default: site-packages Python")
    ap.add_argument("--en-frac", type=float, default=0.5)
    ap.add_argument("--task-frac", type=float, default=0.4)
    ap.add_argument("--short-len", type=int, default=0,
                    help="train the first --short-frac of the time at this length")
    ap.add_argument("--short-frac", type=float, default=0.7)
    ap.add_argument("--task-weights", default=None,
                    help="comma-separated shares of the RULER-style tasks among the task "
                         "samples, in bench/quality/ruler.py TASKS order (default: the tasks "
                         "in turn, equal shares)")
    ap.add_argument("--workers", type=int, default=0,
                    help="processes that build the --corpus batches ahead of the GPU (0: in "
                         "the training loop)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--init-from", default=None,
                    help="a model directory (pack_weights.py unpack) whose weights start this run "
                         "(fresh optimizer, warmup and schedule): continuing a model whose "
                         "trainer state did not travel")
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
    if args.corpus:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import corpus as corpus_mod
        import ruler as ruler_mod
        globals()["ruler"] = ruler_mod
        parts = corpus_mod.load(args.corpus)
        manifest = json.loads(parts["manifest.json"])
        mx_train = Mixed(parts, "train", args.en_frac)
        mx_held = Mixed(parts, "held", 0.5)
        log(f"corpus {args.corpus}: {json.dumps(manifest)}")
    else:
        held_paths = tasks.heldout_files(args.heldout_dir)
        held_blobs = tasks.read_files(held_paths)
        heldout = tasks.concat(held_blobs)
        log(f"held-out: {len(held_paths)} stdlib files, {len(heldout)} bytes, digest "
            f"{tasks.digest(held_blobs)} ({args.heldout_dir or tasks.stdlib_dir()})")
        text = training_text(int(args.text_mb * 1e6), {os.path.basename(p) for p in held_paths},
                             log)

    cfg = model_config(args.seq_len, args.arch)
    model = LlamaForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model {args.arch}: {n_params} parameters, device {device}, torch {torch.__version__}")
    init_info = None
    if args.init_from:
        src = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        missing = model.load_state_dict(src.state_dict(), strict=True)
        del src
        prev = os.path.join(args.init_from, "train_log.json")
        init_info = json.load(open(prev)) if os.path.exists(prev) else None
        log(f"initialised from {args.init_from} ({missing})")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=device.type == "cuda")
    rng = np.random.default_rng(args.seed)
    step, tokens, done_seconds = 0, 0, 0.0
    hist = []
    ckpt = os.path.join(args.out, "trainer_state.pt")
    if args.resume and os.path.exists(ckpt):
        st = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, tokens, done_seconds = st["step"], st["tokens"], st["seconds"]
        hist = st.get("history", [])
        rng = np.random.default_rng([args.seed, step])
        log(f"resumed at step {step}, {done_seconds:.0f} s of {args.seconds:.0f} done")
    task_weights = None
    if args.task_weights:
        tw = np.array([float(x) for x in args.task_weights.split(",")])
        if len(tw) != len(ruler.TASKS) or (tw < 0).any() or tw.sum() <= 0:
            raise SystemExit(f"--task-weights: want {len(ruler.TASKS)} non-negative shares "
                             f"({', '.join(ruler.TASKS)})")
        task_weights = tw / tw.sum()
        log(f"task shares {dict(zip(ruler.TASKS, task_weights.round(3).tolist()))}")
    t0 = time.time() - done_seconds
    last_ckpt = time.time()
    loaders = {}  # (length, batch) -> iterator over worker-built batches (--workers)
    while True:
        elapsed = time.time() - t0
        if elapsed >= args.seconds or (args.max_steps and step >= args.max_steps):
            break
        frac = elapsed / args.seconds
        cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * frac))  # 1 -> 0.1 over the budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * cosine
        for g in opt.param_groups:
            g["lr"] = lr
        L, bsz = args.seq_len, args.batch
        if args.short_len and frac < args.short_frac:
            L, bsz = args.short_len, args.batch * args.seq_len // args.short_len
        if args.corpus and args.workers:
            if (L, bsz) not in loaders:
                loaders.clear()  # the short phase's workers end here
                loaders[(L, bsz)] = mixed_loader(mx_train, args.seed + step, L, bsz, L,
                                                 args.task_frac, task_weights, args.workers)
            x, w = next(loaders[(L, bsz)])
        elif args.corpus:
            x, w = batch_mixed(mx_train, rng, bsz, L, args.task_frac, step, task_weights)
        else:
            x, w = batch(text, rng, bsz, L, args.passkey_frac)
        x, w = x.to(device, non_blocking=True), w.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256),
                                                x[:, 1:].reshape(-1), reduction="none")
        nll = nll.view(bsz, L)
        lm = nll.mean()
        ans = (nll * w).sum() / w.sum().clamp(min=1.0)
        loss = lm + ans
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += bsz * L
        if step % 50 == 0 or step == 1:
            rec = {"step": step, "seconds": round(time.time() - t0, 1), "lr": lr, "len": L,
                   "lm_loss": lm.item(), "answer_loss": ans.item(), "tokens": tokens,
                   "batch": bsz}
            hist.append(rec)
            log(json.dumps(rec))
        if time.time() - last_ckpt > args.checkpoint_seconds:
            save(model, args.out, opt, {"step": step, "tokens": tokens, "history": hist,
                                        "seconds": time.time() - t0})
            last_ckpt = time.time()
            log(f"checkpoint at step {step}")
    train_seconds = time.time() - t0
    loaders.clear()
    save(model, args.out, opt, {"step": step, "tokens": tokens, "history": hist,
                                "seconds": train_seconds})
    log(f"trained {step} steps, {tokens} tokens in {train_seconds:.0f} s; evaluating")
    # evaluate the bf16 weights as saved
    model = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).to(device)
    info = {"arch": args.arch, "steps": step, "tokens": tokens, "train_seconds": train_seconds,
            "parameters": n_params, "seq_len": args.seq_len, "short_len": args.short_len,
            "short_frac": args.short_frac, "batch": args.batch, "lr": args.lr,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "history": hist}
    if args.init_from:
        info["init_from"] = args.init_from
        if init_info:  # the earlier runs this one continues
            info["earlier_runs"] = init_info.get("earlier_runs", []) + [
                {k: init_info.get(k) for k in ("steps", "tokens", "train_seconds", "device",
                                                "lr", "eval")}]
    if args.eval_n <= 0:  # no evaluation here (the suite measures the saved weights)
        ev = {}
        if args.corpus:
            info.update({"en_frac": args.en_frac, "task_frac": args.task_frac,
                         "task_weights": args.task_weights, "workers": args.workers,
                         "corpus": manifest, "eval": ev})
    elif args.corpus:
        ev = evaluate_mixed(model, mx_held, args.eval_lengths or sorted({4096, args.seq_len}), device,
                            n_task=args.eval_n)
        info.update({"en_frac": args.en_frac, "task_frac": args.task_frac,
                     "task_weights": args.task_weights, "corpus": manifest, "eval": ev})
    else:
        ev = evaluate(model, heldout, args.seq_len, device, n_pk=args.eval_n)
        info.update({"passkey_frac": args.passkey_frac, "eval": ev,
                     "heldout_files": [os.path.basename(p) for p in held_paths],
                     "heldout_digest": tasks.digest(held_blobs)})
    log(json.dumps(ev))
    info["wall_seconds"] = time.time() - t_start
    import transformers
    info["transformers"] = transformers.__version__
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(info, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()

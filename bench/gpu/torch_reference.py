"""PyTorch reference for the CUDA score+select+compact benchmark: the same work written as
kvpress does it (score, topk, gather), 8 kv heads, head_dim 128, bf16, ratio 0.5, in GB/s over
the same minimal bytes, next to a device-to-device copy measured in this run."""
import torch


def scores_of(name, k):
    kf = k.float()
    if name == "knorm":
        return -kf.norm(dim=-1)
    if name == "keydiff":
        anchor = torch.nn.functional.normalize(kf, p=2, dim=-1).mean(dim=2, keepdim=True)
        return -torch.nn.functional.cosine_similarity(kf, anchor, dim=-1)
    if name == "manifold":
        return (kf - kf.mean(dim=2, keepdim=True)).norm(dim=-1)
    raise ValueError(name)


def compress(name, k, v, kept):
    s = scores_of(name, k)
    idx = s.topk(kept, dim=-1).indices
    idx = idx.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
    return k.gather(2, idx), v.gather(2, idx)


def median_us(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def main():
    dev = torch.device("cuda")
    h, d = 8, 128
    for n in (65536, 131072):
        k = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16)
        kept = int(n * (1 - 0.5))
        kv = torch.cat([k, v])
        dst = torch.empty_like(kv)
        copy_us = median_us(lambda: dst.copy_(kv))
        copy_gbps = 2 * kv.numel() * 2 / (copy_us * 1e3)
        minimal = 2 * k.numel() * 2 + 2 * h * kept * d * 2
        for name in ("knorm", "keydiff", "manifold"):
            us = median_us(lambda: compress(name, k, v, kept))
            gbps = minimal / (us * 1e3)
            print(f"RESULT bench=torch scorer={name} tokens={n} us={us:.1f} GBps={gbps:.0f} "
                  f"copy_GBps={copy_gbps:.0f} torch/copy={100 * gbps / copy_gbps:.0f}%",
                  flush=True)


if __name__ == "__main__":
    main()

"""The extension against the same routing composed from PyTorch ops, forward and
forward+backward, in one process on the same inputs (docs/performance.md).

    PYTHONPATH=build/default/python .venv/bin/python python/bench/bench_extension.py [--threads 1] [--device cpu]

Prints one row per case: median time of each side and the ratio torch/moe_route."""

import argparse

import torch
import torch.utils.benchmark as tb

import moe_route as mr


def torch_route(z, cfg, bias):
    """Pure-PyTorch composition: gating, top-k, gather, normalise/scale, penalties."""
    if cfg.gating == "softmax":
        scores = torch.softmax(z, dim=-1)
    else:
        scores = torch.sigmoid(z)
    key = scores + bias if cfg.uses_expert_bias else scores
    idx = torch.topk(key, cfg.top_k, dim=-1).indices
    gates = scores.gather(1, idx)
    if cfg.normalizes:
        gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    gates = gates * cfg.scaling_factor
    aux = z.new_zeros(())
    if cfg.load_balance:
        n, e = z.shape
        dist = scores if cfg.gating == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        f = torch.bincount(idx.flatten(), minlength=e).to(z.dtype) / (n * cfg.top_k)
        aux = aux + cfg.load_balance * e * (f * dist.mean(dim=0)).sum()
    if cfg.z_loss:
        aux = aux + cfg.z_loss * torch.logsumexp(z, dim=-1).square().mean()
    return idx, gates, aux


def library_route(z, cfg, bias):
    r = mr.route(z, cfg, expert_bias=bias if cfg.uses_expert_bias else None)
    return r.indices, r.gates, r.aux_loss


def timed(fn, label, sub_label, description, threads):
    t = tb.Timer(stmt="fn()", globals={"fn": fn}, label=label, sub_label=sub_label, description=description,
                 num_threads=threads)
    return t.blocked_autorange(min_run_time=1.0).median


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if torch.device(args.device).type == "cuda" and not (torch.cuda.is_available() and mr.with_cuda):
        print("no CUDA device or no CUDA branch in moe_route: benchmark skipped")
        return
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    cases = [
        ("softmax", mr.RouterConfig(gating="softmax", top_k=6), 64),
        ("softmax", mr.RouterConfig(gating="softmax", top_k=8), 256),
        ("sigmoid+bias", mr.RouterConfig(gating="sigmoid", selection="expert_bias", top_k=6, scaling_factor=2.5), 64),
        ("sigmoid+bias", mr.RouterConfig(gating="sigmoid", selection="expert_bias", top_k=8, scaling_factor=2.5), 256),
        ("softmax+lb+z", mr.RouterConfig(gating="softmax", top_k=8, load_balance=1e-2, z_loss=1e-3), 256),
    ]
    print(f"N = {args.tokens}, threads = {args.threads}, device = {args.device}, torch {torch.__version__}")
    print(f"{'case':<14} {'E':>4} {'K':>2} | {'fwd torch':>10} {'fwd lib':>10} {'ratio':>6} | "
          f"{'f+b torch':>10} {'f+b lib':>10} {'ratio':>6}")
    for name, cfg, experts in cases:
        z = torch.randn(args.tokens, experts, generator=gen).to(args.device)
        bias = (0.1 * torch.randn(experts, generator=gen)).to(args.device)
        w = torch.randn(args.tokens, cfg.top_k, generator=gen).to(args.device)
        row = []
        for step in ("fwd", "fwd+bwd"):
            for side, fn in (("torch", torch_route), ("moe_route", library_route)):
                if step == "fwd":
                    def run(fn=fn):
                        with torch.no_grad():
                            fn(z, cfg, bias)
                else:
                    zg = z.clone().requires_grad_(True)

                    def run(fn=fn, zg=zg):
                        _, gates, aux = fn(zg, cfg, bias)
                        ((gates * w).sum() + aux).backward()
                        zg.grad = None
                row.append(timed(run, name, side, step, args.threads))
        ft, fl, bt, bl = row
        print(f"{name:<14} {experts:>4} {cfg.top_k:>2} | {ft * 1e3:>8.2f}ms {fl * 1e3:>8.2f}ms {ft / fl:>5.2f}x | "
              f"{bt * 1e3:>8.2f}ms {bl * 1e3:>8.2f}ms {bt / bl:>5.2f}x")


if __name__ == "__main__":
    main()

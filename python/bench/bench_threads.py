"""Where a second thread pays (issue 17 item 2; docs/performance.md, "Threads: a parked pool and a
minimum by work"): mr.route on 1 and on 2 threads, forward alone and the training step (forward, load
balance and z-loss, backward), for E in {8, 64, 256} and N from 512 to 16384 (--tokens), one process,
the extension as built. Each side is the median over interleaved rounds of one call's wall time, each
call after --gap-ms of idle time (0: back to back). The 2-thread side follows the backend's minimum of
2^16 / (64 + E) tokens per thread, so below twice that both sides run on one thread.

    PYTHONPATH=build/default/python .venv/bin/python python/bench/bench_threads.py [--rounds 41] [--tokens 512 1024 ...] [--gap-ms 1]

Prints one table row per (step, E, N): both times and 1-thread time / 2-thread time (> 1: the second
thread pays)."""

import argparse
import dataclasses
import statistics
import time

import torch

import moe_route as mr

ROUTERS = {  # E -> the router measured at that E
    8: mr.RouterConfig(gating="softmax", top_k=2, normalize=True),  # Mixtral-like
    64: mr.RouterConfig(gating="softmax", top_k=6),  # DeepSeek-V2-Lite-like
    256: mr.RouterConfig(gating="sigmoid", top_k=8, normalize=True),  # DeepSeek-V3-like, ungrouped
}
TOKENS = (512, 1024, 2048, 4096, 8192, 16384)


def one_call_us(fn, gap_s):
    if gap_s:
        time.sleep(gap_s)  # the pool's workers go back to sleep, as between a model's router calls
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


def step_fn(step, z, cfg, threads):
    if step == "forward":
        return lambda: mr.route(z, cfg, threads=threads, with_dispatch=False)
    cfg = dataclasses.replace(cfg, load_balance=0.01, z_loss=0.001)
    leaf = z.clone().requires_grad_(True)

    def train():
        res = mr.route(leaf, cfg, threads=threads, with_dispatch=False)
        (res.gates.sum() + res.aux_loss).backward()

    return train


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--gap-ms", type=float, default=1.0,
                        help="idle time before each timed call (0: calls back to back, workers still spinning)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; median of {args.rounds} interleaved rounds, microseconds per call, "
          f"{args.gap_ms} ms idle before each")
    print("| step | E | N | N·E | 1 thread | 2 threads | 1t / 2t |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for step in ("forward", "training step"):
        for e, cfg in ROUTERS.items():
            for n in args.tokens:
                z = torch.randn(n, e, generator=torch.Generator().manual_seed(n + e))
                sides = {t: step_fn(step, z, cfg, t) for t in (1, 2)}
                for fn in sides.values():
                    for _ in range(3):
                        fn()  # warm up
                times = {t: [] for t in sides}
                for _ in range(args.rounds):
                    for t, fn in sides.items():
                        times[t].append(one_call_us(fn, args.gap_ms / 1e3))
                t1, t2 = (statistics.median(times[t]) for t in (1, 2))
                print(f"| {step} | {e} | {n} | {n * e} | {t1:.1f} | {t2:.1f} | {t1 / t2:.2f} |", flush=True)


if __name__ == "__main__":
    main()

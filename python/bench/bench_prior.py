"""The RPB prior builder as a Python user calls it (issue 17 item 5; docs/performance.md):
mr.prior.build against the same mean of softmax rows written in PyTorch eager (mask, softmax,
index_add_, bincount), one process, CPU, one thread, interleaved rounds. N = 16384 tokens,
S = 64 rows, every 10th token without a row, E in {64, 256}.

    PYTHONPATH=build/default/python .venv/bin/python python/bench/bench_prior.py [--rounds 15]

Prints the median per-call time of each side, their ratio and the largest difference of the
priors. Eager's time depends on glibc's allocator: its 4-16 MB temporaries are pages mapped
afresh and faulted in on every call, unless MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_
(both, e.g. 4000000000) keep them on the heap and mapped."""

import argparse
import statistics
import time

import torch

import moe_route as mr

N, S = 16384, 64


def eager(z, rows, num_rows):
    keep = rows >= 0
    r = rows[keep].long()
    p = torch.softmax(z[keep], dim=1)
    sums = torch.zeros(num_rows, z.shape[1]).index_add_(0, r, p)
    return sums / torch.bincount(r, minlength=num_rows).clamp(min=1).unsqueeze(1)


def per_call(fn, calls=20):
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cpu_isa {mr.cpu_isa()}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), 1 thread")
    for e in (64, 256):
        z = torch.randn(N, e, generator=torch.Generator().manual_seed(1))
        t = torch.arange(N)
        rows = torch.where(t % 10 == 0, torch.full_like(t, -1), t * S // N).to(torch.int32)
        diff = float((mr.prior.build(z, rows, S, threads=1)[0] - eager(z, rows, S)).abs().max())
        lib, ref = [], []
        for _ in range(args.rounds):
            lib.append(per_call(lambda: mr.prior.build(z, rows, S, threads=1)))
            ref.append(per_call(lambda: eager(z, rows, S)))
        lib_us, ref_us = statistics.median(lib), statistics.median(ref)
        print(f"E = {e}: library {lib_us:.0f} us, eager {ref_us:.0f} us, library/eager {lib_us / ref_us:.2f}, "
              f"max |difference| {diff:.1e}")


if __name__ == "__main__":
    main()

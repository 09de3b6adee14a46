"""Call overhead of the operator path (issue 15 item 6; docs/performance.md), one
process, CPU, one thread, interleaved rounds:

  * the decode regime, N in {1, 16, 256} tokens of E = 64 logits, top-6, against a
    bare torch.topk(z, 6) on the same logits: the whole Python call
    mr.select_experts (the inference routing, torch.ops.moe_route.select_experts),
    the whole Python call mr.route (torch.ops.moe_route.route, then .dispatch),
    and the route operator alone, on logits without and with requires_grad
    (the training call, which records the autograd node);
  * N = 16384: the route operator against the direct C++ call of the same router
    (runtime::route with outputs allocated once, _C.direct_route_seconds).

    PYTHONPATH=build/default/python .venv/bin/python python/bench/bench_overhead.py [--rounds 15]

Prints the median per-call time of each side and their ratio."""

import argparse
import statistics

import torch

import moe_route as mr
from moe_route._ops import ops
from timing import interleaved_medians, per_call_us

E, K = 64, 6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = mr.RouterConfig(gating="softmax", top_k=K)
    text = cfg.to_text()
    print(f"torch {torch.__version__}, 1 thread, median of {args.rounds} interleaved rounds (microseconds per call)")
    print("| N | torch.topk | mr.select_experts | route operator | route operator, grad | mr.route | "
          "select_experts / topk | operator / topk | operator, grad / topk | mr.route / topk |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    route_op = lambda z: ops.route(z, text, None, None, None, None, None, 0, None, None, 0, True, "",  # noqa: E731
                                   None, None, None, 1, None, None, None, 1)
    for n in (1, 16, 256):
        z = torch.randn(n, E, generator=torch.Generator().manual_seed(n))
        z_grad = z.clone().requires_grad_()
        sides = {
            "topk": lambda: torch.topk(z, K),
            "select": lambda: mr.select_experts(z, cfg),
            "op": lambda: route_op(z),
            "op_grad": lambda: route_op(z_grad),
            "api": lambda: mr.route(z, cfg, threads=1),
        }
        calls = 20000 if n < 256 else 5000
        for fn in sides.values():
            per_call_us(fn, calls // 10)  # warm up
        m = interleaved_medians(sides, calls, args.rounds)
        print(f"| {n} | {m['topk']:.2f} | {m['select']:.2f} | {m['op']:.2f} | {m['op_grad']:.2f} | {m['api']:.2f} | "
              f"{m['select'] / m['topk']:.2f} | {m['op'] / m['topk']:.2f} | {m['op_grad'] / m['topk']:.2f} | "
              f"{m['api'] / m['topk']:.2f} |")

    n = 16384
    z = torch.randn(n, E, generator=torch.Generator().manual_seed(n))
    op_times, direct_times = [], []
    for _ in range(args.rounds):
        op_times.append(per_call_us(lambda: route_op(z), 20))
        direct_times.append(mr._C.direct_route_seconds(text, z, 20, 1) * 1e6)
    op, direct = statistics.median(op_times), statistics.median(direct_times)
    print(f"\nN = {n}: route operator {op:.1f} us, direct C++ call {direct:.1f} us, operator / direct {op / direct:.3f}")


if __name__ == "__main__":
    main()

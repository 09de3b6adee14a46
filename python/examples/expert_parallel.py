"""Expert parallelism on torch.distributed with the library's operators
(docs/integration.md): a MoE layer whose experts are spread over the ranks.

Each rank owns N tokens of the global batch and E / R experts. A step:
  1. routes its tokens (mr.route) with capacity admission per rank (the ranks
     are the admission groups) and the load balance of the global batch
     (mr.GlobalLoadBalance, all-reduced);
  2. builds the dispatch metadata (mr.dispatch: expert-major rows, the
     assignments bound for each rank);
  3. exchanges the token rows with all_to_all_single (the differentiable one of
     torch's functional collectives, as torchtitan's expert parallelism uses),
     runs its local experts, and sends the outputs back;
  4. combines them with the gates. The loss is sum_t <y_t, c_t> plus the penalties.

The router weight is replicated: its gradient is all-reduced. The step equals
one process running the whole global batch with the ranks as admission groups.

    torchrun --nproc-per-node R python/examples/expert_parallel.py --check

checks that on every rank (outputs, loss, router and expert gradients, within
1e-5); ctest runs it at R = 2 and 4 with the gloo backend on the CPU."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # the differentiable all-to-all torchtitan uses

import moe_route as mr

D, E, K, HIDDEN = 16, 8, 2, 32


def weights(seed):
    """Router [E, D] and experts W1 [E, D, H], W2 [E, H, D], the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, D, generator=g) * 0.5, torch.randn(E, D, HIDDEN, generator=g) / D ** 0.5,
            torch.randn(E, HIDDEN, D, generator=g) / HIDDEN ** 0.5)


def batch(seed, ranks, tokens_per_rank):
    """The global batch: tokens x [R N, D] and loss weights c [R N, D]."""
    g = torch.Generator().manual_seed(seed + 1)
    n = ranks * tokens_per_rank
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def experts(x, w1, w2, expert):
    """Rows x [M, D] through the experts named by expert [M] (indices into w1, w2)."""
    return torch.einsum("mh,mhd->md", torch.relu(torch.einsum("md,mdh->mh", x, w1[expert])), w2[expert])


def config(args, share):
    """The router; `share` = this call's tokens over the global batch's, so the
    per-rank penalties add up to the global batch's."""
    return mr.RouterConfig(gating="softmax", top_k=K, normalize=True, load_balance=1e-2,
                           load_balance_scope="global_batch", z_loss=1e-3 * share)


def single_process(args, ranks):
    """The reference: the whole global batch in one process, ranks as admission groups."""
    router, w1, w2 = (w.clone().requires_grad_() for w in weights(args.seed))
    x, c = batch(args.seed, ranks, args.tokens_per_rank)
    logits = x @ router.t()
    res = mr.route(logits, config(args, 1.0), load_fractions=mr.GlobalLoadBalance(E, K).load_fractions(logits),
                   admission=mr.Admission.capacity_gate(args.capacity_factor),
                   group_ids=torch.arange(x.shape[0]) // args.tokens_per_rank, num_groups=ranks)
    kept = res.indices >= 0
    slots = kept.nonzero()  # (token, j) of every executed assignment
    out = experts(x[slots[:, 0]], w1, w2, res.indices[kept].long())
    y = torch.zeros_like(x).index_add(0, slots[:, 0], out * res.gates[kept].unsqueeze(1))
    loss = (y * c).sum() + res.aux_loss
    loss.backward()
    return y.detach(), loss.detach(), router.grad, w1.grad, w2.grad


def expert_parallel(args):
    """This rank's part of the step: its tokens' outputs, its share of the loss,
    the router gradient (all-reduced) and the gradients of its experts."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    local = E // ranks
    router_all, w1_all, w2_all = weights(args.seed)
    router = router_all.clone().requires_grad_()
    w1 = w1_all[rank * local:(rank + 1) * local].clone().requires_grad_()
    w2 = w2_all[rank * local:(rank + 1) * local].clone().requires_grad_()
    x_all, c_all = batch(args.seed, ranks, args.tokens_per_rank)
    mine = slice(rank * args.tokens_per_rank, (rank + 1) * args.tokens_per_rank)
    x, c = x_all[mine], c_all[mine]

    logits = x @ router.t()
    balance = mr.GlobalLoadBalance(E, K, all_reduce=dist.all_reduce)
    res = mr.route(logits, config(args, 1.0 / ranks), load_fractions=balance.load_fractions(logits.detach()),
                   admission=mr.Admission.capacity_gate(args.capacity_factor),
                   expert_rank=torch.arange(E, dtype=torch.int32) // local, num_ranks=ranks)
    d = res.dispatch
    rows = int(d.rows)  # the split sizes of the exchange are host numbers
    slot = d.permutation[:rows]  # expert-major rows of t * K + j; every row used (align 1)
    token, expert = slot // K, res.indices.reshape(-1)[slot].long()
    send = d.rank_counts.tolist()  # rows bound for each rank, in rank order (expert-major = rank-major)
    recv = torch.empty(ranks, dtype=torch.int64)
    dist.all_to_all_single(recv, d.rank_counts)
    recv = recv.tolist()

    x_in = funcol.all_to_all_single_autograd(x[token], recv, send, dist.group.WORLD)
    e_in = torch.empty(sum(recv), dtype=torch.int64)
    dist.all_to_all_single(e_in, expert, recv, send)
    y_in = experts(x_in, w1, w2, e_in - rank * local)
    y_back = funcol.all_to_all_single_autograd(y_in, send, recv, dist.group.WORLD)
    gates = res.gates.reshape(-1)[slot].unsqueeze(1)
    y = torch.zeros_like(x).index_add(0, token, y_back * gates)
    loss = (y * c).sum() + res.aux_loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    dist.all_reduce(router.grad)
    return y.detach(), total, router.grad, w1.grad, w2.grad


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens-per-rank", type=int, default=12)
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with the single-process run")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    if E % ranks:
        raise SystemExit(f"expert_parallel: the number of ranks ({ranks}) must divide E = {E}")
    torch.set_num_threads(1)
    y, loss, router_grad, w1_grad, w2_grad = expert_parallel(args)
    failed = False
    if args.check:
        want_y, want_loss, want_router, want_w1, want_w2 = single_process(args, ranks)
        local = E // ranks
        mine = slice(rank * args.tokens_per_rank, (rank + 1) * args.tokens_per_rank)
        experts_mine = slice(rank * local, (rank + 1) * local)
        for name, got, want in (("outputs", y, want_y[mine]), ("loss", loss, want_loss),
                                ("router gradient", router_grad, want_router),
                                ("W1 gradient", w1_grad, want_w1[experts_mine]),
                                ("W2 gradient", w2_grad, want_w2[experts_mine])):
            try:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            except AssertionError as e:
                print(f"rank {rank}: {name} differs from the single-process run: {e}", file=sys.stderr)
                failed = True
        if rank == 0 and not failed:
            print(f"expert_parallel: {ranks} ranks equal the single-process run (loss {float(loss):.6f})")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

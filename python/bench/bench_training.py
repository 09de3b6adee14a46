"""Training steps and forwards of the router presets, the extension against the same math
written in PyTorch, eager and under torch.compile, in one process on the same inputs
(issue 17 items 3, 4 and 6; docs/performance.md).

    PYTHONPATH=build/default/python .venv/bin/python python/bench/bench_training.py \
        [--tokens 16384[,N2,...]] [--threads 1] [--presets deepseek_v2_lite,moonlight] [--variants plain,all] \
        [--steps forward,step] [--rounds 5]

A step is the forward with autograd recording, then the backward of sum(w * gates) plus the
penalty values (the extension's aux_loss; PyTorch's sum of the same penalties), as a training
step runs it. The forward is the same call under torch.no_grad(). Presets:

    deepseek_v2_lite  softmax, top-6 of 64, not normalised
    moonlight         sigmoid + expert bias, top-6 of 64, normalised, x2.446
    deepseek_v3       sigmoid + expert bias, 4 of 8 groups (top-2 sum), top-8 of 256, x2.5
    mixtral           softmax over the top-2 of 8 logits

and variants plain, rpb (log prior bias, beta 1, gates from z + beta b), load_balance (1e-3),
z_loss (1e-3), kl_to_base (1e-2), logit_l2 (1e-2), all (rpb and the four penalties). One
token in eight has no prior row. Before timing, each row's indices must agree (float near-ties
between the two sides' scores may flip a few tokens: under 0.1 % of them) and the aux values within
1e-4 · max(1, |aux|). Times are medians over --rounds interleaved rounds (each round times every side
once, a fixed number of calls); the torch.compile side is compiled and warmed first, and its
compile time is not counted.

Each row also reports the extension's cost per token and the machine's floor for the same logits,
timed in the same rounds: torch.exp into a preallocated buffer (one read of the logits, one exp
of each, one write), the least any router must do with them. --tokens takes a list (the N
sweep: cost per token as N grows, decode sizes included).
"""

import argparse

import torch

import moe_route as mr
from timing import interleaved_medians, per_call_us

PRESETS = {
    "deepseek_v2_lite": ("deepseek_v2_lite", 64),
    "moonlight": ("moonlight", 64),
    "deepseek_v3": ("deepseek_v3", 256),
    "mixtral": ("mixtral", 8),
}
VARIANTS = ("plain", "rpb", "load_balance", "z_loss", "kl_to_base", "logit_l2", "all")
COEFFICIENTS = {"load_balance": 1e-3, "z_loss": 1e-3, "kl_to_base": 1e-2, "logit_l2": 1e-2}
PRIOR_ROWS = 512


def config_of(preset, variant):
    cfg = mr.RouterConfig.preset(preset)
    if variant in ("rpb", "all"):
        cfg.prior = "log_prior_bias"
        cfg.prior_beta = 1.0
    for name, coef in COEFFICIENTS.items():
        if variant in (name, "all"):
            setattr(cfg, name, coef)
    return cfg


def torch_step(cfg, z, bias, prior_bias, prior_probs, rows, mask, prior_tokens):
    """The router and its penalties from PyTorch operators (as Hugging Face and Megatron write
    them): routing on z' = z + beta b[r(t)] under the prior, penalties on the unbiased z."""
    n, e = z.shape
    prior_on = cfg.prior == "log_prior_bias"
    b = prior_bias.index_select(0, rows) if (prior_on or cfg.logit_l2) else None
    zp = z + cfg.prior_beta * b if prior_on else z
    if cfg.gating == "sigmoid":
        s = torch.sigmoid(zp)
        key = s + bias
        if cfg.groups > 1:
            size = e // cfg.groups
            group_scores = key.view(n, cfg.groups, size).topk(cfg.per_group_k, dim=-1)[0].sum(-1)
            kept = group_scores.topk(cfg.top_groups, dim=-1)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0)
            key = key.masked_fill(group_mask.repeat_interleave(size, dim=1) == 0, float("-inf"))
        idx = key.topk(cfg.top_k, dim=-1)[1]
        w = s.gather(1, idx)
    elif cfg.gating == "softmax_after_topk":
        top, idx = zp.topk(cfg.top_k, dim=-1)
        w = torch.softmax(top, dim=-1)
    else:
        w, idx = torch.softmax(zp, dim=-1).topk(cfg.top_k, dim=-1)
    if cfg.normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    if cfg.scaling_factor != 1.0:
        w = w * cfg.scaling_factor
    aux = z.new_zeros(())
    if cfg.load_balance or cfg.kl_to_base:
        if cfg.gating == "sigmoid":
            su = torch.sigmoid(z)
            total = su.sum(-1, keepdim=True)
            p = su / total
            logp = torch.nn.functional.logsigmoid(z) - total.log()
        else:
            p = torch.softmax(z, dim=-1)
            logp = torch.log_softmax(z, dim=-1)
    if cfg.load_balance:
        counts = torch.zeros(e, dtype=z.dtype).scatter_add_(0, idx.reshape(-1), torch.ones(n * cfg.top_k, dtype=z.dtype))
        aux = aux + cfg.load_balance * e * (counts / (n * cfg.top_k) * p.mean(0)).sum()
    if cfg.z_loss:
        aux = aux + cfg.z_loss * torch.logsumexp(z, dim=-1).square().mean()
    if cfg.kl_to_base:
        pi = prior_probs.index_select(0, rows)
        kl = (pi * (pi.log() - logp)).sum(-1)
        aux = aux + cfg.kl_to_base * (kl * mask).sum() / prior_tokens
    if cfg.logit_l2:
        d = z - b
        d = d - d.mean(-1, keepdim=True)
        aux = aux + cfg.logit_l2 * (d.square().sum(-1) * mask).sum() / prior_tokens
    return idx, w, aux


class Case:
    def __init__(self, preset, variant, tokens, gen):
        name, experts = PRESETS[preset]
        self.cfg = config_of(name, variant)
        self.label = f"{preset}/{variant}"
        e, k = experts, self.cfg.top_k
        self.z = torch.randn(tokens, e, generator=gen)
        self.bias = 0.1 * torch.randn(e, generator=gen)
        self.w = torch.randn(tokens, k, generator=gen)
        pi = torch.exp(2.0 * torch.randn(PRIOR_ROWS, e, generator=gen))
        prepared = mr.prior.prepare(pi / pi.sum(-1, keepdim=True))
        self.prior_bias, self.prior_probs = prepared.bias, prepared.probs
        rows = torch.randint(0, PRIOR_ROWS, (tokens,), generator=gen, dtype=torch.int32)
        rows[torch.randint(0, 8, (tokens,), generator=gen) == 0] = -1
        self.rows32 = rows
        # PyTorch's side: row -1 reads an appended neutral row (uniform prior, zero bias), masked out.
        self.rows = torch.where(rows < 0, PRIOR_ROWS, rows).to(torch.int64)
        self.mask = (rows >= 0).to(torch.float32)
        self.prior_tokens = float(self.mask.sum())
        self.bias_table = torch.cat([self.prior_bias, torch.zeros(1, e)])
        self.probs_table = torch.cat([self.prior_probs, torch.full((1, e), 1.0 / e)])
        self.compiled = torch.compile(torch_step)

    def library(self, z):
        uses_prior = self.cfg.prior != "none" or self.cfg.kl_to_base or self.cfg.logit_l2
        r = mr.route(z, self.cfg, expert_bias=self.bias if self.cfg.uses_expert_bias else None,
                     prior_bias=self.prior_bias if uses_prior else None,
                     prior_probs=self.prior_probs if uses_prior else None,
                     token_prior_row=self.rows32 if uses_prior else None, with_dispatch=False)
        return r.indices, r.gates, r.aux_loss

    def torch_side(self, fn):
        def run(z):
            return fn(self.cfg, z, self.bias, self.bias_table, self.probs_table, self.rows, self.mask,
                      self.prior_tokens)
        return run

    def sides(self):
        return {"moe_route": self.library, "eager": self.torch_side(torch_step),
                "compile": self.torch_side(self.compiled)}

    def check(self):
        lib_idx, _, lib_aux = self.library(self.z)
        for side in ("eager", "compile"):
            idx, _, aux = self.sides()[side](self.z)
            differ = (idx.to(torch.int64).sort(-1)[0] != lib_idx.to(torch.int64).sort(-1)[0]).any(-1).sum().item()
            if differ > 1e-3 * idx.shape[0]:
                raise SystemExit(f"{self.label}: {side} routes {differ} tokens differently from the extension")
            if abs(float(aux) - float(lib_aux)) > 1e-4 * max(1.0, abs(float(lib_aux))):
                raise SystemExit(f"{self.label}: {side} aux {float(aux)} against the extension's {float(lib_aux)}")

    def callables(self, step):
        out = {}
        floor_out = torch.empty_like(self.z)
        for side, fn in self.sides().items():
            if step == "forward":
                def call(fn=fn):
                    with torch.no_grad():
                        fn(self.z)
            else:
                zg = self.z.clone().requires_grad_(True)

                def call(fn=fn, zg=zg):
                    _, gates, aux = fn(zg)
                    ((gates * self.w).sum() + aux).backward()
                    zg.grad = None
            out[side] = call
        out["floor"] = lambda: torch.exp(self.z, out=floor_out)
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384", help="a comma-separated list of token counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", default="forward,step")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # Every case compiles torch_step anew (its own configuration, with and without grad).
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    gen = torch.Generator().manual_seed(0)
    print(f"threads = {args.threads}, torch {torch.__version__}, moe_route CPU path {mr.cpu_isa()}, "
          f"median of {args.rounds} rounds")
    print("| router / variant | N | call | moe_route ms | moe_route ns/token | eager ms | compile ms | floor ms | "
          "eager / moe_route | compile / moe_route | moe_route / floor |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        for variant in args.variants.split(","):
            for tokens in (int(n) for n in args.tokens.split(",")):
                case = Case(preset, variant, tokens, gen)
                case.check()
                for step in args.steps.split(","):
                    fns = case.callables(step)
                    for fn in fns.values():  # warm-up: compiles the torch.compile side
                        fn()
                        fn()
                    calls = max(1, int(0.2 / (per_call_us(fns["moe_route"], 1) / 1e6 + 1e-9)))
                    m = {side: us / 1e3 for side, us in interleaved_medians(fns, calls, args.rounds).items()}
                    print(f"| {case.label} | {tokens} | {step} | {m['moe_route']:.3f} | "
                          f"{m['moe_route'] * 1e6 / tokens:.1f} | {m['eager']:.3f} | {m['compile']:.3f} | "
                          f"{m['floor']:.3f} | {m['eager'] / m['moe_route']:.2f}x | "
                          f"{m['compile'] / m['moe_route']:.2f}x | {m['moe_route'] / m['floor']:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""The CPU operators' instruction sets (docs/python.md, "Instruction sets"): the
extension is compiled for any x86-64 and runs AVX2 + FMA loops where the CPU has
them; MOE_ROUTE_CPU_ISA forces a path, and every path gives the same bits."""

import os
import subprocess
import sys

import pytest

import moe_route as mr

# One process per path: the variable is read once per process. The script routes
# (forward and backward, every penalty, a prior, admission) on each gating and
# selection, runs expert choice and the prior builder; it prints its path and a
# digest of the bits.
SCRIPT = r"""
import hashlib, torch, moe_route as mr
g = torch.Generator().manual_seed(7)
digest = hashlib.sha256()
def add(*tensors):
    for t in tensors:
        if t is not None:
            digest.update(t.detach().contiguous().numpy().tobytes())
configs = [
    (64, mr.RouterConfig(gating="softmax", top_k=6, load_balance=0.01, z_loss=1e-3)),
    (64, mr.RouterConfig(gating="sigmoid", selection="expert_bias", top_k=6, normalize=True, load_balance=0.01,
                         z_loss=1e-3, logit_l2=0.1, prior="log_prior_bias", prior_beta=0.5)),
    (256, mr.RouterConfig(gating="sigmoid", selection="group_limited_bias", top_k=8, groups=8, top_groups=4,
                          normalize=True, scaling_factor=2.5, kl_to_base=0.2)),
    (8, mr.RouterConfig(gating="softmax_after_topk", top_k=2)),
    (48, mr.RouterConfig(gating="sqrt_softplus", top_k=4, normalize=True, locality=0.1)),
]
for e, cfg in configs:
    z = (torch.randn(700, e, generator=g) * 3).requires_grad_(True)
    kw = {}
    if cfg.selection in ("expert_bias", "group_limited_bias"):
        kw["expert_bias"] = torch.randn(e, generator=g) * 0.1
    if cfg.prior != "none" or cfg.kl_to_base or cfg.logit_l2:
        pi = torch.softmax(torch.randn(3, e, generator=g), -1)
        prepared = mr.prior.prepare(pi)
        kw.update(prior_bias=prepared.bias, prior_probs=prepared.probs,
                  token_prior_row=torch.randint(-1, 3, (700,), generator=g, dtype=torch.int32))
    res = mr.route(z, cfg, admission=mr.Admission.capacity_probs(1.0), threads=2, **kw)
    w = torch.randn(res.gates.shape, generator=g)
    ((res.gates * w).sum() + res.aux_loss).backward()
    add(res.indices, res.gates, res.routed_gates, res.penalty_values, z.grad)
ec = mr.expert_choice(torch.randn(500, 40, generator=g), top_k=3)
add(ec.indices, ec.gates)
for gating in ("softmax", "sigmoid", "sqrt_softplus", "softmax_after_topk"):
    pi, _ = mr.prior.build(torch.randn(900, 72, generator=g) * 3,
                           torch.randint(-1, 5, (900,), generator=g, dtype=torch.int32), 6, gating, threads=2)
    add(pi)
print(mr.cpu_isa(), digest.hexdigest())
"""


def run_with(isa):
    env = dict(os.environ)
    if isa is None:
        env.pop("MOE_ROUTE_CPU_ISA", None)
    else:
        env["MOE_ROUTE_CPU_ISA"] = isa
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)


def cpu_has_avx2_fma():
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx2" in flags and "fma" in flags


def test_every_path_gives_the_same_bits():
    runs = {isa: run_with(isa) for isa in ("baseline", "x86-64-v3" if cpu_has_avx2_fma() else None)}
    for isa, r in runs.items():
        assert r.returncode == 0, (isa, r.stderr)
    paths = {isa: r.stdout.split() for isa, r in runs.items()}
    assert paths["baseline"][0] == "baseline"
    if not cpu_has_avx2_fma():
        pytest.skip("this CPU has no AVX2 + FMA: only the baseline path runs here")
    assert paths["x86-64-v3"][0] == "x86-64-v3"
    assert paths["baseline"][1] == paths["x86-64-v3"][1]


def test_the_extension_takes_the_fast_path_where_the_cpu_has_it():
    # Compiled for any x86-64 (python/setup.py, python/CMakeLists.txt), it still runs x86-64-v3 loops here.
    if os.environ.get("MOE_ROUTE_CPU_ISA"):
        pytest.skip("MOE_ROUTE_CPU_ISA is set for this process")
    assert mr.cpu_isa() == ("x86-64-v3" if cpu_has_avx2_fma() else "baseline")


def test_an_unknown_or_unavailable_path_is_refused_by_name():
    r = run_with("avx9")
    assert r.returncode != 0
    assert "MOE_ROUTE_CPU_ISA is 'avx9'" in r.stderr
    if not cpu_has_avx2_fma():
        r = run_with("x86-64-v3")
        assert r.returncode != 0 and "does not run AVX2 and FMA" in r.stderr

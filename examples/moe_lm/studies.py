#!/usr/bin/env python3
"""The main job of the reference drivers: both studies of issue 6 on the embedded data, from one base.

Pretrains the base model (softmax router, load balancing; reused when OUT/base.pt exists), then runs
the RPB post-training study (study_rpb.py) and the CIPHER admission study (study_cipher.py) on it, a
few runs at a time, with a progress display, and prints both tables. Runs whose JSON is in OUT are
reused, so an interrupted job resumes where it stopped.

    studies.py --moe-lm build/run/examples/moe_lm/moe_lm --out build/run/studies           # reduced grids
    studies.py --moe-lm ... --out ... --full                                               # full grids

Reduced (about 3 minutes on 2 cores after the build): RPB with SFT, LBL, the four soft anchors (RPB,
Router-L2, KL-to-base, logit-L2) and RPB-hard; CIPHER with vanilla, strict, reroute, LocMoE tau 0.01,
expert choice and the fixed router on 4 expert-parallel ranks; seeds 0 1 2, 150 post-training steps on
arithmetic. --full adds z-loss and the shuffled priors (within-soft, within-hard, global-hard), the
whole RPB grid again on the code domain, RPB and within-soft at beta 0.3, LocMoE at five more
thresholds, the locality loss alone and the capacity baselines; then a base for each other router
preset of the driver (Moonlight's sigmoid with expert bias, DeepSeek-V3's group-limited, DeepSeek-V4's
sqrt-softplus, Mixtral's softmax after top-k; the bias presets pretrain aux-loss-free) and the reduced
RPB grid on each (docs/results.md).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import study_cipher  # noqa: E402
import study_rpb  # noqa: E402
from study_common import Job, ensure_base, run_jobs  # noqa: E402

# The driver's other router presets, and whether they pretrain aux-loss-free (expert-bias updates only).
OTHER_PRESETS = [("sigmoid_bias", True), ("group_limited", True), ("sqrt_softplus", True),
                 ("softmax_after_topk", False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-lm", required=True, help="the moe_lm executable")
    ap.add_argument("--out", required=True, help="output directory: base checkpoint, runs, tables, plots")
    ap.add_argument("--full", action="store_true", help="the full grids of both studies")
    ap.add_argument("--pretrain-steps", type=int, default=1500, help="base pretraining steps")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (each uses one thread)")
    a = ap.parse_args()
    start = time.time()
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, "base.pt")
    ensure_base(a.moe_lm, base, "softmax", a.pretrain_steps, "studies")

    common = ["--moe-lm", a.moe_lm, "--base", base, "--jobs", str(a.jobs)] + (["--full"] if a.full else [])
    print("\n== RPB post-training study ==", flush=True)
    rpb = study_rpb.study(study_rpb.parser().parse_args(common + ["--out", os.path.join(a.out, "rpb")]))
    print("\n== CIPHER admission study ==", flush=True)
    cipher = study_cipher.study(study_cipher.parser().parse_args(common + ["--out", os.path.join(a.out, "cipher")]))
    tables = [rpb, cipher]
    if a.full:
        print("\n== RPB study on the code domain ==", flush=True)
        tables.append(study_rpb.study(study_rpb.parser().parse_args(
            common + ["--out", os.path.join(a.out, "rpb_code"), "--domains", "code"])))
        print("\n== RPB and within-soft at beta 0.3 ==", flush=True)
        tables.append(study_rpb.study(study_rpb.parser().parse_args(
            ["--moe-lm", a.moe_lm, "--base", base, "--jobs", str(a.jobs), "--out", os.path.join(a.out, "rpb_beta0.3"),
             "--conditions", "rpb", "within_soft", "--extra", "--beta", "0.3"])))
        print("\n== Router presets: a base each, the reduced RPB grid on it ==", flush=True)
        bases = {p: os.path.join(a.out, f"base_{p}.pt") for p, _ in OTHER_PRESETS}
        run_jobs([Job(f"base_{p}", [a.moe_lm, "--log-every", "250", "pretrain", "--out", bases[p], "--gating", p,
                                    "--steps", str(a.pretrain_steps)] + (["--lbl", "0"] if bias_only else []),
                      os.path.join(a.out, f"base_{p}.json")) for p, bias_only in OTHER_PRESETS], a.jobs, "studies")
        for p, _ in OTHER_PRESETS:
            print(f"\n-- {p} --", flush=True)
            tables.append(study_rpb.study(study_rpb.parser().parse_args(
                ["--moe-lm", a.moe_lm, "--base", bases[p], "--jobs", str(a.jobs), "--gating", p,
                 "--out", os.path.join(a.out, f"rpb_{p}")])))
    print("\n" + "\n\n".join(tables) + f"\n\nstudies: done in {time.time() - start:.0f} s; everything is in {a.out}")


if __name__ == "__main__":
    main()

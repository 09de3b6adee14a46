#!/usr/bin/env python3
"""The main job of the reference drivers: both studies on the embedded data (issues 6 and 19).

Pretrains two bases side by side: the primary one, a Moonlight-like router (sigmoid scores,
aux-loss-free expert bias, the RPB paper's main setting) at E = 64, K = 6, for the RPB post-training
study (study_rpb.py), and the CIPHER study's, the same router at CIPHER's DeepSeek-V3 geometry (E = 256,
K = 8) pretrained without load balancing, for the CIPHER admission study (study_cipher.py). Then runs both studies a few runs at a time,
with a progress display, and prints the tables. Runs whose JSON is in OUT are reused, so an interrupted
job resumes where it stopped.

    studies.py --moe-lm build/run/examples/moe_lm/moe_lm --out build/run/studies           # reduced grids
    studies.py --moe-lm ... --out ... --full                                               # full grids

Reduced: RPB with SFT, SFT with the expert bias frozen, LBL, the four soft anchors (RPB, Router-L2,
KL-to-base, logit-L2) and RPB-hard; CIPHER with vanilla, strict and reroute (capacity factor 8, fill 4,
tau at the base's 0.1-quantile routed cosine), LocMoE tau 0.01, expert choice and the fixed router on 4
expert-parallel ranks; seeds 0 1 2, 150 post-training steps on arithmetic. --full: every RPB condition, z-loss, the shuffles and the beta sweep on arithmetic and
code, on the primary base of seed 0 and a second base of seed 1; the same full grid on the softmax
base (DeepSeek-V2-Lite's router, the paper's scope condition) on arithmetic; the full CIPHER grid; and
a base for each other router preset of the driver (DeepSeek-V3's group-limited, DeepSeek-V4's
sqrt-softplus, Mixtral's softmax after top-k) with the reduced RPB grid on it (docs/results.md).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import study_cipher  # noqa: E402
import study_rpb  # noqa: E402
from study_common import Job, run_jobs  # noqa: E402

PRIMARY = "sigmoid_bias"
# The other router presets of the driver, and whether they pretrain aux-loss-free (expert-bias updates only).
AUX_LOSS_FREE = {"sigmoid_bias": True, "softmax": False, "group_limited": True, "sqrt_softplus": True,
                 "softmax_after_topk": False}
OTHER_PRESETS = ["group_limited", "sqrt_softplus", "softmax_after_topk"]


def pretrain_flags(preset, seed):
    return ["--seed", str(seed)] + (["--lbl", "0"] if AUX_LOSS_FREE[preset] else [])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-lm", required=True, help="the moe_lm executable")
    ap.add_argument("--out", required=True, help="output directory: base checkpoints, runs, tables, plots")
    ap.add_argument("--full", action="store_true", help="the full grids of both studies")
    ap.add_argument("--pretrain-steps", type=int, default=1500, help="base pretraining steps")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (each uses one thread)")
    a = ap.parse_args()
    start = time.time()
    os.makedirs(a.out, exist_ok=True)

    def base_path(preset, seed):
        return os.path.join(a.out, f"base_{preset}_s{seed}.pt")

    def pretrain(name, path, preset, flags):
        """The job that pretrains the checkpoint `path`; a cached JSON without its checkpoint is stale."""
        record = os.path.splitext(path)[0] + ".json"
        if not os.path.exists(path) and os.path.exists(record):
            os.remove(record)
        return Job(name, [a.moe_lm, "--log-every", "250", "pretrain", "--out", path, "--gating", preset,
                          "--steps", str(a.pretrain_steps)] + flags, record)

    # The two bases of the main job side by side: the primary and the CIPHER study's 256-expert base.
    base = base_path(PRIMARY, 0)
    cipher_base = os.path.join(a.out, "base_cipher_e256_unbalanced_s0.pt")
    run_jobs([pretrain(os.path.basename(os.path.splitext(p)[0]), p, preset, flags)
              for p, preset, flags in ((base, PRIMARY, pretrain_flags(PRIMARY, 0)),
                                       (cipher_base, study_cipher.BASE_PRESET, study_cipher.BASE_FLAGS + ["--seed", "0"]))],
             a.jobs, "studies")

    def rpb(label, out, base_file, preset, extra=()):
        print(f"\n== RPB post-training study: {label} ==", flush=True)
        return study_rpb.study(study_rpb.parser().parse_args(
            ["--moe-lm", a.moe_lm, "--base", base_file, "--jobs", str(a.jobs), "--gating", preset, "--label", label,
             "--out", os.path.join(a.out, out)] + list(extra)))

    full = ["--full", "--domains", "arithmetic", "code"] if a.full else []
    tables = [rpb("Moonlight-like base, seed 0", "rpb", base, PRIMARY, full)]
    print("\n== CIPHER admission study ==", flush=True)
    tables.append(study_cipher.study(study_cipher.parser().parse_args(
        ["--moe-lm", a.moe_lm, "--base", cipher_base, "--jobs", str(a.jobs),
         "--out", os.path.join(a.out, "cipher_e256_unbalanced")] + (["--full"] if a.full else []))))
    if a.full:
        bases = [(PRIMARY, 1), ("softmax", 0)] + [(p, 0) for p in OTHER_PRESETS]
        run_jobs([pretrain(f"base_{p}_s{seed}", base_path(p, seed), p, pretrain_flags(p, seed))
                  for p, seed in bases], a.jobs, "studies")
        tables.append(rpb("Moonlight-like base, seed 1", "rpb_base1", base_path(PRIMARY, 1), PRIMARY, full))
        tables.append(rpb("softmax base (DeepSeek-V2-Lite's router)", "rpb_softmax", base_path("softmax", 0),
                          "softmax", ["--full"]))
        for p in OTHER_PRESETS:
            tables.append(rpb(f"{p} base", f"rpb_{p}", base_path(p, 0), p))
    print("\n" + "\n\n".join(tables) + f"\n\nstudies: done in {time.time() - start:.0f} s; everything is in {a.out}")


if __name__ == "__main__":
    main()

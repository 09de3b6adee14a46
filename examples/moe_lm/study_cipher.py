#!/usr/bin/env python3
"""The admission study of CIPHER-MoE (its Table 2) as a loop over `moe_lm posttrain`.

Post-trains a base model on the domain whose routing is most concentrated (read from the base's
per-expert loads on each domain, or given with --domain) under each admission condition: vanilla
(dropless), CIPHER-strict, CIPHER-reroute, LocMoE at each threshold tau, and the fixed router. Every run
uses --pad-experts, so the expert compute it times is the capacity-padded one of expert-parallel training,
where every expert's buffer is as long as the hottest expert's. For each condition the table gives, as
mean +- sd over seeds: the top-1 expert share, peak-to-mean load and dropped rate of the executed
assignments (mean over MoE layers), the padded expert rows and milliseconds per step, the speed-up of
both over vanilla of the same seed, and in-domain / out-of-domain exact match and answer-span loss.
Runs whose JSON already exists are reused, so an interrupted study resumes. Standard library only.

    study_cipher.py --moe-lm build/examples/moe_lm/moe_lm --out cipher_study          # reduced grid
    study_cipher.py --moe-lm ... --out cipher_study --full                            # full grid, 3 seeds
"""

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time

from study_common import cached, mean_sd, run

DOMAINS = ["arithmetic", "code", "words"]
REDUCED_TAUS = [0.01, 0.1]  # the paper's chosen tau and one large enough to bite at this scale
FULL_TAUS = [0.005, 0.01, 0.02, 0.03]
COLUMNS = [("top1", "top-1 share"), ("ptm", "peak/mean"), ("dropped", "dropped"),
           ("rows", "padded rows/step"), ("expert_ms", "expert ms/step"), ("speedup_rows", "speed-up (rows)"),
           ("speedup_ms", "speed-up (ms)"), ("id_acc", "ID acc"), ("ood_acc", "OOD acc"),
           ("id_loss", "ID loss"), ("ood_loss", "OOD loss")]


def conditions_of(full, taus, capacity, fill):
    """(name, posttrain flags) per condition; every run post-trains with plain SFT (no auxiliary loss)."""
    cap = ["--capacity-factor", str(capacity)]
    conds = [("vanilla", ["--admission", "dropless"]),
             ("cipher_strict", ["--admission", "cipher_strict"] + cap),
             ("cipher_reroute", ["--admission", "cipher_reroute", "--fill-factor", str(fill)] + cap)]
    conds += [(f"locmoe_tau{t:g}", ["--admission", "locmoe", "--tau", str(t)] + cap) for t in taus]
    if full:  # the two capacity baselines without affinity, so every admission policy appears in a study
        conds += [("capacity_position", ["--admission", "capacity_position"] + cap),
                  ("capacity_probs", ["--admission", "capacity_probs"] + cap)]
    conds.append(("fixed_router", ["--admission", "dropless", "--fixed-router"]))
    return conds


def layer_mean(result, key):
    layers = result["train"]["layers"]
    return sum(l[key] for l in layers) / len(layers)


def row_of(result):
    s, t = result["summary"], result["train"]
    return {"top1": layer_mean(result, "top1_share"), "ptm": layer_mean(result, "peak_to_mean"),
            "dropped": layer_mean(result, "dropped_rate"), "rows": t["mean_expert_rows"],
            "expert_ms": t["mean_expert_ms"], "step_ms": t["mean_step_ms"],
            "id_acc": s["id"]["accuracy"], "ood_acc": s["ood"]["accuracy"],
            "id_loss": s["id"]["answer_loss"], "ood_loss": s["ood"]["answer_loss"]}


def concentration(probe):
    """Top-1 share and peak-to-mean of the base's routed loads on one domain (mean over layers)."""
    top1, ptm = [], []
    for l in probe["train"]["layers"]:
        loads = l["routed_loads"]
        total = sum(loads)
        top1.append(max(loads) / total)
        ptm.append(max(loads) * len(loads) / total)
    return sum(top1) / len(top1), sum(ptm) / len(ptm)


def plot(out, domain, conditions, seed, runs):
    """Executed load per expert (seed `seed`), experts in vanilla's descending order, one panel per layer."""
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        print("study_cipher: gnuplot not found (gnuplot-nox); no plots", file=sys.stderr)
        return []
    pdir = os.path.join(out, "plots")
    os.makedirs(pdir, exist_ok=True)
    terminal = "pngcairo noenhanced size 1000,450" if subprocess.run(
        [gnuplot, "-e", "set terminal pngcairo"], capture_output=True).returncode == 0 else "png noenhanced size 1000,450"
    layers = len(runs["vanilla"]["train"]["layers"])
    panels = []
    for l in range(layers):
        ref = runs["vanilla"]["train"]["layers"][l]["executed_loads"]
        order = sorted(range(len(ref)), key=lambda j: -ref[j])
        series = []
        for name, _ in conditions:
            layer = runs[name]["train"]["layers"][l]
            # In units of the uniform load of the routed assignments: 1.0 is a perfectly balanced expert
            # without drops, so dropped assignments show as bars below the vanilla line.
            uniform = sum(layer["routed_loads"]) / len(layer["routed_loads"])
            dat = os.path.join(pdir, f"load_{domain}_{name}_l{l}.dat")
            with open(dat, "w") as f:
                f.writelines(f"{rank} {layer['executed_loads'][j] / uniform}\n" for rank, j in enumerate(order))
            series.append(f"'{dat}' using 1:2 with linespoints title '{name}'")
        panels.append(f"set title 'layer {l}'; plot " + ", ".join(series) + ";")
    png = os.path.join(pdir, f"load_per_expert_{domain}.png")
    script = (f"set terminal {terminal}; set output '{png}';"
              f"set multiplot layout 1,{layers} title 'executed load per expert, post-training on {domain} (seed {seed})';"
              f"set xlabel 'expert (ordered by vanilla load)'; set ylabel 'load / uniform load'; set key top right;"
              f"set yrange [0:*]; " + " ".join(panels) + " unset multiplot")
    subprocess.run([gnuplot, "-e", script], check=True)
    return [png]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-lm", required=True, help="the moe_lm executable")
    ap.add_argument("--out", required=True, help="study directory (checkpoint, runs, tables)")
    ap.add_argument("--base", help="a base checkpoint to reuse (default: OUT/base.pt, pretrained if missing)")
    ap.add_argument("--gating", default="softmax", help="base router preset: softmax or sigmoid_bias")
    ap.add_argument("--pretrain-steps", type=int, default=1500)
    ap.add_argument("--domain", default="auto", help="post-training domain (auto: the most concentrated)")
    ap.add_argument("--seeds", nargs="+", type=int, help="default: 0 1 (0 1 2 with --full)")
    ap.add_argument("--steps", type=int, default=150, help="post-training steps")
    ap.add_argument("--capacity-factor", type=float, default=1.25,
                    help="admission capacity as a multiple of the uniform load (CIPHER, LocMoE, capacity_*)")
    ap.add_argument("--fill-factor", type=float, default=4.0, help="CIPHER-reroute fill target")
    ap.add_argument("--taus", nargs="+", type=float,
                    help=f"LocMoE thresholds (default {REDUCED_TAUS}, {FULL_TAUS} with --full)")
    ap.add_argument("--full", action="store_true",
                    help="four LocMoE thresholds, the capacity_position / capacity_probs baselines, three seeds")
    ap.add_argument("--log-every", type=int, default=25, help="training-curve resolution (steps)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further posttrain flags")
    a = ap.parse_args()
    seeds = a.seeds or ([0, 1, 2] if a.full else [0, 1])
    conditions = conditions_of(a.full, a.taus or (FULL_TAUS if a.full else REDUCED_TAUS), a.capacity_factor,
                               a.fill_factor)
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    start = time.time()

    base = a.base or os.path.join(a.out, "base.pt")
    if not os.path.exists(base):
        print(f"pretraining {base} ({a.pretrain_steps} steps, {a.gating}) ...", flush=True)
        cached(os.path.join(a.out, "base.json"), lambda: run(
            [a.moe_lm, "--log-every", "100", "pretrain", "--out", base, "--gating", a.gating, "--steps",
             str(a.pretrain_steps)], os.path.join(a.out, "pretrain.log"), "study_cipher"))

    # The base's routing per domain: a few post-training steps at learning rate 0 leave the model as it
    # is and record the routed loads of that domain's batches (dropless, unpadded).
    skew = {}
    for d in DOMAINS:
        probe = cached(os.path.join(a.out, "runs", f"base_loads_{d}.json"), lambda: run(
            [a.moe_lm, "--log-every", "0", "posttrain", "--base", base, "--domain", d, "--steps", "5",
             "--lr", "0"], os.path.join(a.out, "runs", f"base_loads_{d}.log"), "study_cipher"))
        skew[d] = (concentration(probe), probe)
        print(f"base routing on {d}: top-1 share {skew[d][0][0]:.3f}, peak/mean {skew[d][0][1]:.2f}", flush=True)
    domain = max(DOMAINS, key=lambda d: skew[d][0][1]) if a.domain == "auto" else a.domain
    print(f"post-training domain: {domain}", flush=True)

    total = len(conditions) * len(seeds)
    done = 0
    per_cond = {name: {} for name, _ in conditions}
    for seed in seeds:  # seed-major, so an interrupted reduced run already has complete seeds
        for name, flags in conditions:
            run_name = f"{domain}_{name}_s{seed}"
            path = os.path.join(a.out, "runs", run_name + ".json")
            done += 1
            print(f"[{done}/{total}] {run_name} ({time.time() - start:.0f} s)", flush=True)
            per_cond[name][seed] = cached(path, lambda: run(
                [a.moe_lm, "--log-every", str(a.log_every), "posttrain", "--base", base, "--domain", domain,
                 "--condition", "sft", "--pad-experts", "--seed", str(seed), "--steps", str(a.steps)] + flags
                + a.extra, os.path.join(a.out, "runs", run_name + ".log"), "study_cipher"))

    rows = []  # (condition, {metric: (mean, sd)})
    base_probe = skew[domain][1]
    base_eval = base_probe["eval"]
    others = [d for d in base_eval if d != domain]
    rows.append(("base", {"top1": (skew[domain][0][0], 0.0), "ptm": (skew[domain][0][1], 0.0),
                          "id_acc": (base_eval[domain]["accuracy"], 0.0),
                          "ood_acc": (sum(base_eval[d]["accuracy"] for d in others) / len(others), 0.0),
                          "id_loss": (base_eval[domain]["answer_loss"], 0.0),
                          "ood_loss": (sum(base_eval[d]["answer_loss"] for d in others) / len(others), 0.0)}))
    for name, _ in conditions:
        per_seed = []
        for seed in seeds:
            r = row_of(per_cond[name][seed])
            v = row_of(per_cond["vanilla"][seed])
            r["speedup_rows"] = v["rows"] / r["rows"] if r["rows"] > 0 else None
            r["speedup_ms"] = v["expert_ms"] / r["expert_ms"] if r["expert_ms"] > 0 else None
            per_seed.append(r)
        rows.append((name, {k: mean_sd([r[k] for r in per_seed]) for k in per_seed[0]}))

    keys = [k for k, _ in COLUMNS] + ["step_ms"]
    with open(os.path.join(a.out, "cipher_table.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["domain", "condition", "seeds"] + [f"{k}_{s}" for k in keys for s in ("mean", "sd")])
        for name, m in rows:
            w.writerow([domain, name, 0 if name == "base" else len(seeds)]
                       + [x for k in keys for x in m.get(k, ("", ""))])
    with open(os.path.join(a.out, "cipher_table.json"), "w") as f:
        json.dump({"domain": domain, "seeds": seeds, "steps": a.steps, "capacity_factor": a.capacity_factor,
                   "fill_factor": a.fill_factor,
                   "base_concentration": {d: {"top1": skew[d][0][0], "peak_to_mean": skew[d][0][1]} for d in DOMAINS},
                   "rows": [{"condition": n, **{k: {"mean": v[0], "sd": v[1]} for k, v in m.items()}}
                            for n, m in rows]}, f, indent=1)

    print(f"{'condition':<17}" + "".join(f"{label:>18}" for _, label in COLUMNS))
    for name, m in rows:
        cells = "".join(f"{m[k][0]:>10.3f}±{m[k][1]:<7.3f}" if k in m else f"{'':>18}" for k, _ in COLUMNS)
        print(f"{name:<17}{cells}")
    for png in plot(a.out, domain, conditions, seeds[0], {n: per_cond[n][seeds[0]] for n, _ in conditions}):
        print(png)
    print(f"{total} runs, {time.time() - start:.0f} s; tables in {a.out}/cipher_table.csv and .json")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The admission study of CIPHER-MoE (its Table 2) as a loop over `moe_lm posttrain`.

Post-trains a base model on the domain whose routing is most concentrated (read from the base's
per-expert loads on each domain, or given with --domain) under each admission condition: vanilla
(dropless), CIPHER-strict, CIPHER-reroute, LocMoE at each threshold tau (the two with the locality loss),
expert choice and the fixed router. Every run
uses --pad-experts, so the expert compute it times is the capacity-padded one of expert-parallel training,
where every expert's buffer is as long as the hottest expert's. For each condition the table gives, as
mean +- sd over seeds: the top-1 expert share, peak-to-mean load and dropped rate of the executed
assignments (mean over MoE layers), the padded expert rows and milliseconds per step, the speed-up of
both over vanilla of the same seed, and in-domain / out-of-domain exact match and answer-span loss.
Runs whose JSON already exists are reused, so an interrupted study resumes. Standard library only.

    study_cipher.py --moe-lm build/examples/moe_lm/moe_lm --out cipher_study          # reduced grid
    study_cipher.py --moe-lm ... --out cipher_study --full                            # full grid

The reduced grid (the default, and the second half of the main job, studies.py): vanilla, CIPHER-strict,
CIPHER-reroute, LocMoE at tau 0.01, expert choice and the fixed router on 4 expert-parallel ranks (the
admission groups), seeds 0 1 2, 150 steps. --full adds LocMoE at five more thresholds, the locality loss
alone and the capacity_position / capacity_probs baselines.
"""

import argparse
import csv
import json
import os
import subprocess
import time

from study_common import Job, ensure_base, gnuplot_setup, mean_sd, run_jobs, table_text

DOMAINS = ["arithmetic", "code", "words"]
REDUCED_TAUS = [0.01]  # the paper's choice
FULL_TAUS = [0.005, 0.01, 0.02, 0.03, 0.1, 0.3]  # the paper's sweep and two large enough to bite here
COLUMNS = [("top1", "top-1 share"), ("ptm", "peak/mean"), ("dropped", "dropped"),
           ("rows", "padded rows/step"), ("expert_ms", "expert ms/step"), ("speedup_rows", "speed-up (rows)"),
           ("speedup_ms", "speed-up (ms)"), ("id_acc", "ID acc"), ("ood_acc", "OOD acc"),
           ("id_loss", "ID loss"), ("ood_loss", "OOD loss")]


def conditions_of(full, taus, capacity, fill, locality):
    """(name, posttrain flags) per condition. Every run post-trains with plain SFT (no auxiliary loss); the
    admission policies carry the locality loss as in the paper (lambda_loc 0.01 for CIPHER and LocMoE)."""
    cap = ["--capacity-factor", str(capacity)]
    loc = ["--locality", str(locality)] if locality else []
    conds = [("vanilla", ["--admission", "dropless"]),
             ("cipher_strict", ["--admission", "cipher_strict"] + cap + loc),
             ("cipher_reroute", ["--admission", "cipher_reroute", "--fill-factor", str(fill)] + cap + loc)]
    conds += [(f"locmoe_tau{t:g}", ["--admission", "locmoe", "--tau", str(t)] + cap + loc) for t in taus]
    if full:  # the locality loss alone, and the capacity baselines without affinity
        conds += [("vanilla_locality", ["--admission", "dropless"] + loc),
                  ("capacity_position", ["--admission", "capacity_position"] + cap),
                  ("capacity_probs", ["--admission", "capacity_probs"] + cap)]
    # Expert choice at capacity factor 1: every expert takes N K / E tokens, as many assignments as top-K.
    conds.append(("expert_choice", ["--admission", "dropless", "--expert-choice", "--capacity-factor", "1"]))
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
    setup = gnuplot_setup(out, "1300,500", "study_cipher")
    if setup is None:
        return []
    gnuplot, terminal, pdir = setup
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
        key = "set key outside right;" if l == layers - 1 else "unset key;"  # one legend, beside the last panel
        panels.append(f"set title 'layer {l}'; {key} plot " + ", ".join(series) + ";")
    png = os.path.join(pdir, f"load_per_expert_{domain}.png")
    script = (f"set terminal {terminal}; set output '{png}';"
              f"set multiplot layout 1,{layers} title 'executed load per expert, post-training on {domain} (seed {seed})';"
              f"set xlabel 'expert (ordered by vanilla load)'; set ylabel 'load / uniform load';"
              f"set yrange [0:*]; " + " ".join(panels) + " unset multiplot")
    subprocess.run([gnuplot, "-e", script], check=True)
    return [png]


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-lm", required=True, help="the moe_lm executable")
    ap.add_argument("--out", required=True, help="study directory (checkpoint, runs, tables)")
    ap.add_argument("--base", help="a base checkpoint to reuse (default: OUT/base.pt, pretrained if missing)")
    ap.add_argument("--gating", default="softmax", help="router preset of a base pretrained here (moe_lm pretrain --gating)")
    ap.add_argument("--pretrain-steps", type=int, default=1500)
    ap.add_argument("--domain", default="auto", help="post-training domain (auto: the most concentrated)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150, help="post-training steps")
    ap.add_argument("--capacity-factor", type=float, default=1.25,
                    help="admission capacity as a multiple of the uniform load (CIPHER, LocMoE, capacity_*)")
    ap.add_argument("--fill-factor", type=float, default=4.0, help="CIPHER-reroute fill target")
    ap.add_argument("--groups", type=int, default=4,
                    help="expert-parallel ranks: admission, expert choice and the locality loss work per rank")
    ap.add_argument("--locality", type=float, default=0.01,
                    help="lambda_loc of the locality loss under CIPHER and LocMoE (0: off)")
    ap.add_argument("--taus", nargs="+", type=float,
                    help=f"LocMoE thresholds (default {REDUCED_TAUS}, {FULL_TAUS} with --full)")
    ap.add_argument("--full", action="store_true",
                    help="six LocMoE thresholds, the locality loss alone, the capacity_position / capacity_probs baselines")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (each uses one thread)")
    ap.add_argument("--log-every", type=int, default=25, help="training-curve resolution (steps)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further posttrain flags")
    return ap


def study(a):
    """Runs the study `a` (parsed by parser()) and returns its table as text."""
    seeds = a.seeds
    conditions = conditions_of(a.full, a.taus or (FULL_TAUS if a.full else REDUCED_TAUS), a.capacity_factor,
                               a.fill_factor, a.locality)
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    start = time.time()

    base = a.base or os.path.join(a.out, "base.pt")
    ensure_base(a.moe_lm, base, a.gating, a.pretrain_steps, "study_cipher")

    # The base's routing per domain: a few post-training steps at learning rate 0 leave the model as it
    # is and record the routed loads of that domain's batches (dropless, unpadded).
    probes = run_jobs([Job(f"base_loads_{d}", [a.moe_lm, "--log-every", "0", "posttrain", "--base", base,
                                               "--domain", d, "--steps", "5", "--lr", "0"],
                           os.path.join(a.out, "runs", f"base_loads_{d}.json")) for d in DOMAINS], a.jobs,
                      "study_cipher")
    skew = {d: (concentration(probes[f"base_loads_{d}"]), probes[f"base_loads_{d}"]) for d in DOMAINS}
    for d in DOMAINS:
        print(f"study_cipher: base routing on {d}: top-1 share {skew[d][0][0]:.3f}, peak/mean {skew[d][0][1]:.2f}",
              flush=True)
    domain = max(DOMAINS, key=lambda d: skew[d][0][1]) if a.domain == "auto" else a.domain

    jobs = [Job(f"{domain}_{name}_s{seed}",
                [a.moe_lm, "--log-every", str(a.log_every), "posttrain", "--base", base, "--domain", domain,
                 "--condition", "sft", "--pad-experts", "--groups", str(a.groups), "--seed", str(seed),
                 "--steps", str(a.steps)] + flags
                + a.extra, os.path.join(a.out, "runs", f"{domain}_{name}_s{seed}.json"))
            for seed in seeds for name, flags in conditions]
    print(f"study_cipher: {len(jobs)} post-training runs on {domain} ({len(conditions)} conditions x {len(seeds)}"
          f" seed(s), {a.steps} steps), {a.jobs} at a time", flush=True)
    results = run_jobs(jobs, a.jobs, "study_cipher")
    per_cond = {name: {seed: results[f"{domain}_{name}_s{seed}"] for seed in seeds} for name, _ in conditions}

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
                   "fill_factor": a.fill_factor, "groups": a.groups, "locality": a.locality,
                   "base_concentration": {d: {"top1": skew[d][0][0], "peak_to_mean": skew[d][0][1]} for d in DOMAINS},
                   "rows": [{"condition": n, **{k: {"mean": v[0], "sd": v[1]} for k, v in m.items()}}
                            for n, m in rows]}, f, indent=1)

    text = [f"CIPHER admission study on {domain}: mean ± sd over seeds {' '.join(map(str, seeds))}, {a.steps} steps,"
            f" {a.groups} expert-parallel ranks, capacity {a.capacity_factor:g} x uniform, locality loss {a.locality:g}"
            " under CIPHER/LocMoE, experts capacity-padded",
            table_text(f"{'condition':<17}", rows, COLUMNS, 18)]
    text += plot(a.out, domain, conditions, seeds[0], {n: per_cond[n][seeds[0]] for n, _ in conditions})
    text.append(f"{len(jobs)} runs, {time.time() - start:.0f} s; tables in {a.out}/cipher_table.csv and .json")
    return "\n".join(text)


if __name__ == "__main__":
    print(study(parser().parse_args()))

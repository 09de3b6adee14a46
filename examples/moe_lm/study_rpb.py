#!/usr/bin/env python3
"""The RPB post-training study (RPB Tables 2, 3 and 15) as a loop over `moe_lm posttrain`.

Pretrains a base model (or reuses one), then post-trains it on each chosen domain under each
condition and seed, and aggregates the runs' JSON into one table: in-domain and out-of-domain
exact-match accuracy and answer-span loss, and the bias-free routing retention against the base
(TVD, JSD, top-k overlap, community NMI, Delta Q), as mean +- sd over seeds. Runs whose JSON already
exists are reused, so an interrupted study resumes. Standard library only.

    study_rpb.py --moe-lm build/examples/moe_lm/moe_lm --out rpb_study            # reduced grid
    study_rpb.py --moe-lm ... --out rpb_study --full                              # every condition, 3 seeds
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

ALL_CONDITIONS = ["sft", "lbl", "rpb", "router_l2", "kl_to_base", "logit_l2", "z_loss", "rpb_hard",
                  "within_soft", "within_hard", "global_hard"]
REDUCED_CONDITIONS = ["sft", "lbl", "rpb", "router_l2", "rpb_hard"]
COLUMNS = [("id_acc", "ID acc"), ("ood_acc", "OOD acc"), ("id_loss", "ID loss"), ("ood_loss", "OOD loss"),
           ("tvd", "TVD"), ("jsd", "JSD"), ("topk", "top-k"), ("nmi", "NMI"), ("dq", "dQ")]


def row_of(result):
    s, r = result["summary"], result["retention"]
    return {"id_acc": s["id"]["accuracy"], "ood_acc": s["ood"]["accuracy"], "id_loss": s["id"]["answer_loss"],
            "ood_loss": s["ood"]["answer_loss"], "tvd": r["tvd"], "jsd": r["jsd"], "topk": r["topk_overlap"],
            "nmi": r["nmi"], "dq": r["delta_q"]}


def base_row(base_eval, domain):
    ev = base_eval["eval"]
    others = [d for d in ev if d != domain]
    return {"id_acc": ev[domain]["accuracy"], "ood_acc": sum(ev[d]["accuracy"] for d in others) / len(others),
            "id_loss": ev[domain]["answer_loss"],
            "ood_loss": sum(ev[d]["answer_loss"] for d in others) / len(others)}


def plot(out, domains, conditions, seeds, rows):
    """Training curves (seed 0, window-mean answer loss) and retention against accuracy, with gnuplot."""
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        print("study_rpb: gnuplot not found (gnuplot-nox); no plots", file=sys.stderr)
        return []
    pdir = os.path.join(out, "plots")
    os.makedirs(pdir, exist_ok=True)
    # noenhanced: condition names such as router_l2 are text, not subscripts.
    terminal = "pngcairo noenhanced size 900,600" if subprocess.run(
        [gnuplot, "-e", "set terminal pngcairo"], capture_output=True).returncode == 0 else "png noenhanced size 900,600"
    written = []
    for domain in domains:
        series = []
        for cond in conditions:
            with open(os.path.join(out, "runs", f"{domain}_{cond}_s{seeds[0]}.json")) as f:
                log = json.load(f)["train"]["log"]
            dat = os.path.join(pdir, f"curve_{domain}_{cond}.dat")
            with open(dat, "w") as f:
                f.writelines(f"{e['step']} {e['window_loss']}\n" for e in log)
            series.append(f"'{dat}' using 1:2 with linespoints title '{cond}'")
        png = os.path.join(pdir, f"training_{domain}.png")
        script = (f"set terminal {terminal}; set output '{png}'; set key outside right;"
                  f"set title 'post-training on {domain} (seed {seeds[0]})'; set xlabel 'step';"
                  f"set ylabel 'answer-span loss (window mean)'; plot " + ", ".join(series))
        subprocess.run([gnuplot, "-e", script], check=True)
        written.append(png)

        dat = os.path.join(pdir, f"retention_{domain}.dat")
        with open(dat, "w") as f:
            for d, cond, m, _ in rows:
                if d == domain and cond != "base":
                    f.write(f"{cond} {m['nmi'][0]} {m['topk'][0]} {m['id_acc'][0]} {m['ood_acc'][0]}\n")
        png = os.path.join(pdir, f"retention_vs_accuracy_{domain}.png")
        script = (f"set terminal {terminal}; set output '{png}'; set multiplot layout 1,2 title '{domain}';"
                  f"set xlabel 'community NMI vs base'; set ylabel 'in-domain exact match'; unset key;"
                  f"set xtics rotate by -45 format '%.3f'; set offsets graph 0.1, graph 0.1, graph 0.1, graph 0.1;"
                  f"plot '{dat}' using 2:4 with points pt 7, '' using 2:4:1 with labels offset 0,1;"
                  f"set xlabel 'top-k overlap vs base'; set ylabel 'out-of-domain exact match';"
                  f"plot '{dat}' using 3:5 with points pt 7, '' using 3:5:1 with labels offset 0,1; unset multiplot")
        subprocess.run([gnuplot, "-e", script], check=True)
        written.append(png)
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-lm", required=True, help="the moe_lm executable")
    ap.add_argument("--out", required=True, help="study directory (checkpoint, runs, tables)")
    ap.add_argument("--base", help="a base checkpoint to reuse (default: OUT/base.pt, pretrained if missing)")
    ap.add_argument("--gating", default="softmax", help="base router preset: softmax or sigmoid_bias")
    ap.add_argument("--pretrain-steps", type=int, default=1500)
    ap.add_argument("--domains", nargs="+", default=["arithmetic", "code"])
    ap.add_argument("--conditions", nargs="+", help=f"default: {' '.join(REDUCED_CONDITIONS)} ({' '.join(ALL_CONDITIONS)} with --full)")
    ap.add_argument("--seeds", nargs="+", type=int, help="default: 0 (0 1 2 with --full)")
    ap.add_argument("--steps", type=int, default=300, help="post-training steps")
    ap.add_argument("--full", action="store_true", help="every condition of RPB Table 1 and z-loss, three seeds")
    ap.add_argument("--log-every", type=int, default=50, help="training-curve resolution (steps)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further posttrain flags")
    a = ap.parse_args()
    conditions = a.conditions or (ALL_CONDITIONS if a.full else REDUCED_CONDITIONS)
    seeds = a.seeds or ([0, 1, 2] if a.full else [0])
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    start = time.time()

    base = a.base or os.path.join(a.out, "base.pt")
    if not os.path.exists(base):
        print(f"pretraining {base} ({a.pretrain_steps} steps, {a.gating}) ...", flush=True)
        cached(os.path.join(a.out, "base.json"), lambda: run(
            [a.moe_lm, "--log-every", "100", "pretrain", "--out", base, "--gating", a.gating, "--steps",
             str(a.pretrain_steps)], os.path.join(a.out, "pretrain.log"), "study_rpb"))
    base_eval = cached(os.path.join(a.out, "base_eval.json"),
                       lambda: run([a.moe_lm, "eval", "--model", base], os.path.join(a.out, "base_eval.log"), "study_rpb"))

    rows = []  # (domain, condition, metric dict of (mean, sd), seeds)
    total = len(a.domains) * len(conditions) * len(seeds)
    done = 0
    for domain in a.domains:
        rows.append((domain, "base", {k: (v, 0.0) for k, v in base_row(base_eval, domain).items()}, 0))
        for cond in conditions:
            per_seed = []
            for seed in seeds:
                name = f"{domain}_{cond}_s{seed}"
                path = os.path.join(a.out, "runs", name + ".json")
                done += 1
                print(f"[{done}/{total}] {name} ({time.time() - start:.0f} s)", flush=True)
                per_seed.append(row_of(cached(path, lambda: run(
                    [a.moe_lm, "--log-every", str(a.log_every), "posttrain", "--base", base, "--domain", domain,
                     "--condition", cond, "--seed", str(seed), "--steps", str(a.steps)] + a.extra,
                    os.path.join(a.out, "runs", name + ".log"), "study_rpb"))))
            rows.append((domain, cond, {k: mean_sd([r[k] for r in per_seed]) for k in per_seed[0]}, len(seeds)))

    with open(os.path.join(a.out, "rpb_table.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["domain", "condition", "seeds"] + [f"{k}_{s}" for k, _ in COLUMNS for s in ("mean", "sd")])
        for domain, cond, m, n in rows:
            w.writerow([domain, cond, n] + [x for k, _ in COLUMNS for x in m.get(k, ("", ""))])
    with open(os.path.join(a.out, "rpb_table.json"), "w") as f:
        json.dump([{"domain": d, "condition": c, "seeds": n, **{k: {"mean": v[0], "sd": v[1]} for k, v in m.items()}}
                   for d, c, m, n in rows], f, indent=1)

    header = f"{'domain':<11}{'condition':<13}" + "".join(f"{label:>16}" for _, label in COLUMNS)
    print(header)
    for domain, cond, m, n in rows:
        cells = "".join(f"{m[k][0]:>9.3f}±{m[k][1]:<6.3f}" if k in m else f"{'':>16}" for k, _ in COLUMNS)
        print(f"{domain:<11}{cond:<13}{cells}")
    for png in plot(a.out, a.domains, conditions, seeds, rows):
        print(png)
    print(f"{total} runs, {time.time() - start:.0f} s; tables in {a.out}/rpb_table.csv and .json")


if __name__ == "__main__":
    main()

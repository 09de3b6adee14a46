#!/usr/bin/env python3
"""The RPB post-training study (RPB Tables 2, 3 and 15) as a loop over `moe_lm posttrain`.

Pretrains a base model (or reuses one), then post-trains it on each chosen domain under each
condition and seed, and aggregates the runs' JSON into one table: in-domain and out-of-domain
exact-match accuracy and answer-span loss, and the bias-free routing retention against the base
(TVD, JSD, top-k overlap, community NMI, Delta Q), as mean +- sd over seeds. Runs whose JSON already
exists are reused, so an interrupted study resumes. Standard library only.

    study_rpb.py --moe-lm build/examples/moe_lm/moe_lm --out rpb_study            # reduced grid
    study_rpb.py --moe-lm ... --out rpb_study --full                              # every condition

The reduced grid (the default, and the first half of the main job, studies.py): SFT, LBL, the four soft
anchors (RPB, Router-L2, KL-to-base, logit-L2) and RPB-hard on arithmetic, seeds 0 1 2, 150 steps.
--full: every condition of RPB Table 1 and z-loss.
"""

import argparse
import csv
import json
import os
import subprocess
import time

from study_common import Job, ensure_base, gnuplot_setup, mean_sd, run_jobs, table_text

ALL_CONDITIONS = ["sft", "lbl", "rpb", "router_l2", "kl_to_base", "logit_l2", "z_loss", "rpb_hard",
                  "within_soft", "within_hard", "global_hard"]
REDUCED_CONDITIONS = ["sft", "lbl", "rpb", "router_l2", "kl_to_base", "logit_l2", "rpb_hard"]  # + the four soft anchors
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
    setup = gnuplot_setup(out, "900,600", "study_rpb")
    if setup is None:
        return []
    gnuplot, terminal, pdir = setup
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


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-lm", required=True, help="the moe_lm executable")
    ap.add_argument("--out", required=True, help="study directory (checkpoint, runs, tables)")
    ap.add_argument("--base", help="a base checkpoint to reuse (default: OUT/base.pt, pretrained if missing)")
    ap.add_argument("--gating", default="softmax", help="router preset of a base pretrained here (moe_lm pretrain --gating)")
    ap.add_argument("--pretrain-steps", type=int, default=1500)
    ap.add_argument("--domains", nargs="+", default=["arithmetic"])
    ap.add_argument("--conditions", nargs="+", help=f"default: {' '.join(REDUCED_CONDITIONS)} ({' '.join(ALL_CONDITIONS)} with --full)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150, help="post-training steps")
    ap.add_argument("--full", action="store_true", help="every condition of RPB Table 1 and z-loss")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (each uses one thread)")
    ap.add_argument("--log-every", type=int, default=25, help="training-curve resolution (steps)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further posttrain flags")
    return ap


def study(a):
    """Runs the study `a` (parsed by parser()) and returns its table as text."""
    conditions = a.conditions or (ALL_CONDITIONS if a.full else REDUCED_CONDITIONS)
    seeds = a.seeds
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    start = time.time()

    base = a.base or os.path.join(a.out, "base.pt")
    ensure_base(a.moe_lm, base, a.gating, a.pretrain_steps, "study_rpb")
    base_eval = run_jobs([Job("base_eval", [a.moe_lm, "eval", "--model", base],
                              os.path.join(a.out, "base_eval.json"))], 1, "study_rpb")["base_eval"]

    jobs = [Job(f"{domain}_{cond}_s{seed}",
                [a.moe_lm, "--log-every", str(a.log_every), "posttrain", "--base", base, "--domain", domain,
                 "--condition", cond, "--seed", str(seed), "--steps", str(a.steps)] + a.extra,
                os.path.join(a.out, "runs", f"{domain}_{cond}_s{seed}.json"))
            for domain in a.domains for seed in seeds for cond in conditions]
    print(f"study_rpb: {len(jobs)} post-training runs ({len(a.domains)} domain(s) x {len(conditions)} conditions"
          f" x {len(seeds)} seed(s), {a.steps} steps), {a.jobs} at a time", flush=True)
    results = run_jobs(jobs, a.jobs, "study_rpb")

    rows = []  # (domain, condition, metric dict of (mean, sd), seeds)
    for domain in a.domains:
        rows.append((domain, "base", {k: (v, 0.0) for k, v in base_row(base_eval, domain).items()}, 0))
        for cond in conditions:
            per_seed = [row_of(results[f"{domain}_{cond}_s{seed}"]) for seed in seeds]
            rows.append((domain, cond, {k: mean_sd([r[k] for r in per_seed]) for k in per_seed[0]}, len(seeds)))

    with open(os.path.join(a.out, "rpb_table.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["domain", "condition", "seeds"] + [f"{k}_{s}" for k, _ in COLUMNS for s in ("mean", "sd")])
        for domain, cond, m, n in rows:
            w.writerow([domain, cond, n] + [x for k, _ in COLUMNS for x in m.get(k, ("", ""))])
    with open(os.path.join(a.out, "rpb_table.json"), "w") as f:
        json.dump([{"domain": d, "condition": c, "seeds": n, **{k: {"mean": v[0], "sd": v[1]} for k, v in m.items()}}
                   for d, c, m, n in rows], f, indent=1)

    extra = f", posttrain {' '.join(a.extra)}" if a.extra else ""
    text = [f"RPB post-training study ({a.gating} router{extra}): mean ± sd over seeds {' '.join(map(str, seeds))}, {a.steps} steps"
            " (EM = exact match; retention of the bias-free routing against the base)",
            table_text(f"{'domain':<11}{'condition':<13}", [(f"{d:<11}{c}", m) for d, c, m, _ in rows], COLUMNS, 16)]
    text += plot(a.out, a.domains, conditions, seeds, rows)
    text.append(f"{len(jobs)} runs, {time.time() - start:.0f} s; tables in {a.out}/rpb_table.csv and .json")
    return "\n".join(text)


if __name__ == "__main__":
    print(study(parser().parse_args()))

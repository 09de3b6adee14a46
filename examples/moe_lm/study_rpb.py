#!/usr/bin/env python3
"""The RPB post-training study (RPB Tables 2, 3, 6, 9, 13 and 15) as a loop over `moe_lm posttrain`.

Pretrains a base model (or reuses one), then post-trains it on each chosen domain under each
condition and seed, and aggregates the runs' JSON into tables of mean +- sd over seeds:

- the main table: in-domain and out-of-domain exact-match accuracy and answer-span loss, and the
  bias-free routing retention against the base (TVD, JSD, top-k overlap, community NMI, Delta Q);
- the diagnostics: the co-activation graph's kept edges and isolated experts, NMI at the detector
  seeds 0 1 2 42 (their sd), at rho 0.05 and 0.2 and with Leiden, and the null model's Q and NMI
  margins and the share of layers beating it (RPB Table 9);
- the prior: its form, the spread of the router logits and of the prior bias, and the beta they give;
- with shuffled priors, their prior-side validation (RPB Table 13);
- with rpb_b<beta> conditions, the beta sweep (RPB Table 6).

Study conditions are moe_lm's (--condition) plus sft_frozen (SFT with the expert bias frozen, the
control for the bias updates SFT and the penalties keep) and rpb_b<beta> (RPB at that beta). beta is
calibrated (moe_lm --calibrate-beta): beta 1 makes the prior bias's spread equal the router logits'.
Runs whose JSON already exists are reused, so an interrupted study resumes. Standard library only.

    study_rpb.py --moe-lm build/examples/moe_lm/moe_lm --out rpb_study            # reduced grid
    study_rpb.py --moe-lm ... --out rpb_study --full                              # every condition

The reduced grid (the default): SFT, SFT with the bias frozen, LBL, the four soft anchors (RPB,
Router-L2, KL-to-base, logit-L2) and RPB-hard on arithmetic, seeds 0 1 2, 150 steps. --full: every
condition of RPB Table 1, z-loss and the beta sweep 0 0.25 0.5 0.75 (1 is rpb).
"""

import argparse
import json
import os
import re
import subprocess
import time

from study_common import Job, csv_text, ensure_base, gnuplot_setup, mean_sd, run_jobs, table_text, write_atomic

ALL_CONDITIONS = ["sft", "sft_frozen", "lbl", "rpb", "router_l2", "kl_to_base", "logit_l2", "z_loss", "rpb_hard",
                  "within_soft", "within_hard", "global_hard", "rpb_b0", "rpb_b0.25", "rpb_b0.5", "rpb_b0.75"]
REDUCED_CONDITIONS = ["sft", "sft_frozen", "lbl", "rpb", "router_l2", "kl_to_base", "logit_l2", "rpb_hard"]
SHUFFLES = ["within_soft", "within_hard", "global_hard"]
COLUMNS = [("id_acc", "ID acc"), ("ood_acc", "OOD acc"), ("id_loss", "ID loss"), ("ood_loss", "OOD loss"),
           ("tvd", "TVD"), ("jsd", "JSD"), ("topk", "top-k"), ("nmi", "NMI"), ("dq", "dQ")]
DIAGNOSTICS = [("edges", "kept edges"), ("isolated", "isolated"), ("nmi", "NMI"), ("nmi_seed_sd", "NMI seed sd"),
               ("nmi_rho05", "NMI rho.05"), ("nmi_rho20", "NMI rho.2"), ("nmi_leiden", "NMI Leiden"),
               ("q_margin", "Q margin"), ("nmi_margin", "NMI margin"), ("beats_null", "beats null")]
SHUFFLE_COLUMNS = [("topk_overlap", "top-k overlap"), ("change_rate", "change rate"),
                   ("p90_abs_bias_change", "p90 |d(beta b)|"), ("upper_clamp_fraction", "upper clamp")]
BETA_COLUMNS = [("beta", "beta"), ("id_acc", "ID acc"), ("ood_acc", "OOD acc"), ("topk", "top-k"), ("nmi", "NMI")]
DETECTOR_SEEDS = [0, 1, 2, 42]


def condition_flags(name):
    """The posttrain flags of a study condition."""
    if name == "sft_frozen":
        return ["--condition", "sft", "--freeze-expert-bias"]
    beta = re.fullmatch(r"rpb_b([0-9.]+)", name)
    if beta:
        return ["--condition", "rpb", "--beta", beta.group(1)]
    return ["--condition", name]


def sweep_nmi(retention, detector, rho, seed):
    for x in retention["sweep"]:
        if x["detector"] == detector and abs(x["rho"] - rho) < 1e-12 and x["seed"] == seed:
            return x["nmi"]
    raise KeyError(f"no sweep entry {detector} rho {rho} seed {seed}")


def row_of(result):
    s, r = result["summary"], result["retention"]
    at_seeds = [sweep_nmi(r, "louvain", r["rho"], seed) for seed in DETECTOR_SEEDS]
    row = {"id_acc": s["id"]["accuracy"], "ood_acc": s["ood"]["accuracy"], "id_loss": s["id"]["answer_loss"],
           "ood_loss": s["ood"]["answer_loss"], "tvd": r["tvd"], "jsd": r["jsd"], "topk": r["topk_overlap"],
           "nmi": r["nmi"], "dq": r["delta_q"], "edges": r["edges_base"], "isolated": r["isolated_base"],
           "nmi_seed_sd": mean_sd(at_seeds)[1], "nmi_rho05": sweep_nmi(r, "louvain", 0.05, 0),
           "nmi_rho20": sweep_nmi(r, "louvain", 0.2, 0), "nmi_leiden": sweep_nmi(r, "leiden", r["rho"], 0),
           "q_margin": r["q_margin"], "nmi_margin": r["nmi_margin"], "beats_null": r["beats_null_share"]}
    if result.get("prior", {}).get("beta") is not None:  # a soft prior: the beta the calibration gave
        row["beta"] = result["prior"]["beta"]
        row["logit_sd"] = result["prior"]["logit_sd"]
        row["bias_sd"] = result["prior"]["bias_sd"]
    for k, _ in SHUFFLE_COLUMNS:
        if "shuffle_validation" in result:
            row[k] = result["shuffle_validation"][k]
    return row


def base_row(base_eval, domain):
    ev = base_eval["eval"]
    others = [d for d in ev if d != domain]
    return {"id_acc": ev[domain]["accuracy"], "ood_acc": sum(ev[d]["accuracy"] for d in others) / len(others),
            "id_loss": ev[domain]["answer_loss"],
            "ood_loss": sum(ev[d]["answer_loss"] for d in others) / len(others)}


def structure_text(routing):
    """The base's routing structure on the probe of every domain (RPB Tables 11 and 12)."""
    lines = [f"base routing on the probe of every domain: sharpness ||p - U||_1 {routing['sharpness']:.4f},"
             f" effective expert fraction {routing['effective_fraction']:.4f}; per domain: "
             + ", ".join(f"{d} {v['sharpness']:.4f}" for d, v in routing["domains"].items())]
    for p in routing["domain_pairs"]:
        lines.append(f"  {p['a']}-{p['b']}: ||p_a - p_b||_1 {p['divergence']:.4f}, centroid cosine {p['cosine']:.4f}"
                     f" (Q spans {p['cosine_q']:.4f}, A spans {p['cosine_a']:.4f})")
    return "\n".join(lines)


def plot(out, domains, conditions, seeds, rows):
    """Training curves (seed 0, window-mean answer loss), retention against accuracy and the beta sweep."""
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
            write_atomic(dat, "".join(f"{e['step']} {e['window_loss']}\n" for e in log))
            series.append(f"'{dat}' using 1:2 with linespoints title '{cond}'")
        png = os.path.join(pdir, f"training_{domain}.png")
        script = (f"set terminal {terminal}; set output '{png}'; set key outside right;"
                  f"set title 'post-training on {domain} (seed {seeds[0]})'; set xlabel 'step';"
                  f"set ylabel 'answer-span loss (window mean)'; plot " + ", ".join(series))
        subprocess.run([gnuplot, "-e", script], check=True)
        written.append(png)

        dat = os.path.join(pdir, f"retention_{domain}.dat")
        write_atomic(dat, "".join(f"{cond} {m['nmi'][0]} {m['topk'][0]} {m['id_acc'][0]} {m['ood_acc'][0]}\n"
                                  for d, cond, m, _ in rows if d == domain and cond != "base"))
        png = os.path.join(pdir, f"retention_vs_accuracy_{domain}.png")
        script = (f"set terminal {terminal}; set output '{png}'; set multiplot layout 1,2 title '{domain}';"
                  f"set xlabel 'community NMI vs base'; set ylabel 'in-domain exact match'; unset key;"
                  f"set xtics rotate by -45 format '%.3f'; set offsets graph 0.1, graph 0.1, graph 0.1, graph 0.1;"
                  f"plot '{dat}' using 2:4 with points pt 7, '' using 2:4:1 with labels offset 0,1;"
                  f"set xlabel 'top-k overlap vs base'; set ylabel 'out-of-domain exact match';"
                  f"plot '{dat}' using 3:5 with points pt 7, '' using 3:5:1 with labels offset 0,1; unset multiplot")
        subprocess.run([gnuplot, "-e", script], check=True)
        written.append(png)

        sweep = sorted((beta_of(cond), m) for d, cond, m, _ in rows if d == domain and beta_of(cond) is not None)
        if len(sweep) > 1:
            dat = os.path.join(pdir, f"beta_sweep_{domain}.dat")
            write_atomic(dat, "".join(f"{b} {m['id_acc'][0]} {m['id_acc'][1]} {m['ood_acc'][0]} {m['ood_acc'][1]}"
                                      f" {m['nmi'][0]} {m['nmi'][1]}\n" for b, m in sweep))
            png = os.path.join(pdir, f"beta_sweep_{domain}.png")
            script = (f"set terminal {terminal}; set output '{png}'; set multiplot layout 1,2 title"
                      f" 'beta sweep on {domain} (beta in calibrated units; mean +- sd over seeds)';"
                      f"set xlabel 'beta'; set ylabel 'exact match'; set key bottom right;"
                      f"plot '{dat}' using 1:2:3 with yerrorlines title 'ID', '' using 1:4:5 with yerrorlines"
                      f" title 'OOD'; set ylabel 'community NMI vs base'; unset key;"
                      f"plot '{dat}' using 1:6:7 with yerrorlines; unset multiplot")
            subprocess.run([gnuplot, "-e", script], check=True)
            written.append(png)
    return written


def beta_of(cond):
    """The beta (calibrated units) of an RPB condition of the sweep, or None."""
    if cond == "rpb":
        return 1.0
    m = re.fullmatch(r"rpb_b([0-9.]+)", cond)
    return float(m.group(1)) if m else None


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-lm", required=True, help="the moe_lm executable")
    ap.add_argument("--out", required=True, help="study directory (checkpoint, runs, tables)")
    ap.add_argument("--base", help="a base checkpoint to reuse (default: OUT/base.pt, pretrained if missing)")
    ap.add_argument("--gating", default="sigmoid_bias", help="router preset of a base pretrained here (moe_lm pretrain --gating)")
    ap.add_argument("--pretrain-steps", type=int, default=1500)
    ap.add_argument("--domains", nargs="+", default=["arithmetic"])
    ap.add_argument("--conditions", nargs="+", help=f"default: {' '.join(REDUCED_CONDITIONS)} ({' '.join(ALL_CONDITIONS)} with --full)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150, help="post-training steps")
    ap.add_argument("--full", action="store_true", help="every condition of RPB Table 1, z-loss and the beta sweep")
    ap.add_argument("--uncalibrated", action="store_true", help="beta as given, not in calibrated units")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (each uses one thread)")
    ap.add_argument("--log-every", type=int, default=25, help="training-curve resolution (steps)")
    ap.add_argument("--label", default="", help="names this study in its tables (the base, say)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further posttrain flags")
    return ap


def study(a):
    """Runs the study `a` (parsed by parser()) and returns its tables as text."""
    conditions = a.conditions or (ALL_CONDITIONS if a.full else REDUCED_CONDITIONS)
    seeds = a.seeds
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    start = time.time()

    base = a.base or os.path.join(a.out, "base.pt")
    ensure_base(a.moe_lm, base, a.gating, a.pretrain_steps, "study_rpb")
    base_eval = run_jobs([Job("base_eval", [a.moe_lm, "eval", "--model", base],
                              os.path.join(a.out, "base_eval.json"))], 1, "study_rpb")["base_eval"]

    calibrate = [] if a.uncalibrated else ["--calibrate-beta"]
    jobs = [Job(f"{domain}_{cond}_s{seed}",
                [a.moe_lm, "--log-every", str(a.log_every), "posttrain", "--base", base, "--domain", domain,
                 "--seed", str(seed), "--steps", str(a.steps)] + condition_flags(cond) + calibrate + a.extra,
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
            keys = set().union(*per_seed)
            rows.append((domain, cond, {k: mean_sd([r.get(k) for r in per_seed]) for k in sorted(keys)}, len(seeds)))

    every = [k for k, _ in COLUMNS + DIAGNOSTICS[:2] + DIAGNOSTICS[3:] + SHUFFLE_COLUMNS] + ["beta", "logit_sd", "bias_sd"]
    write_atomic(os.path.join(a.out, "rpb_table.csv"), csv_text(
        [["domain", "condition", "seeds"] + [f"{k}_{s}" for k in every for s in ("mean", "sd")]]
        + [[d, c, n] + [x for k in every for x in m.get(k, ("", ""))] for d, c, m, n in rows]))
    write_atomic(os.path.join(a.out, "rpb_table.json"), json.dumps(
        {"label": a.label, "seeds": seeds, "steps": a.steps, "base_routing": base_eval.get("routing"),
         "rows": [{"domain": d, "condition": c, "seeds": n, **{k: {"mean": v[0], "sd": v[1]} for k, v in m.items()}}
                  for d, c, m, n in rows]}, indent=1))

    head = f"{'domain':<11}{'condition':<13}"
    named = [(f"{d:<11}{c}", m) for d, c, m, _ in rows]
    extra = f", posttrain {' '.join(a.extra)}" if a.extra else ""
    label = f"{a.label}: " if a.label else ""
    text = [f"{label}RPB post-training study ({a.gating} router{extra}): mean ± sd over seeds {' '.join(map(str, seeds))},"
            f" {a.steps} steps (EM = exact match; retention of the bias-free routing against the base)",
            table_text(head, named, COLUMNS, 16),
            f"\n{label}routing diagnostics (detector seed 0, rho {results[jobs[0].name]['retention']['rho']:g}, Louvain,"
            f" {results[jobs[0].name]['retention']['nulls']} null resamples, unless the column says otherwise;"
            f" NMI seed sd: over detector seeds {' '.join(map(str, DETECTOR_SEEDS))})",
            table_text(head, [(n, m) for n, m in named if not n.rstrip().endswith("base")], DIAGNOSTICS, 14)]
    priors = [(n, m) for n, m in named if "beta" in m]
    if priors:
        text.append(f"\n{label}prior ({'beta calibrated: 1 = the bias spread equals the logits' if not a.uncalibrated else 'beta as given'})")
        text.append(table_text(head, priors, [("beta", "beta"), ("logit_sd", "sd(z)"), ("bias_sd", "sd(b)")], 14))
    shuffled = [(n, m) for n, m in named if "topk_overlap" in m]
    if shuffled:
        text.append(f"\n{label}shuffled priors, prior side (RPB Table 13)")
        text.append(table_text(head, shuffled, SHUFFLE_COLUMNS, 18))
    swept = [(f"{d:<11}{c}", dict(m, beta=(beta_of(c), 0.0)) if c != "rpb_hard" else m) for d, c, m, _ in rows
             if beta_of(c) is not None or c == "rpb_hard"]
    if len(swept) > 2:
        text.append(f"\n{label}beta sweep (RPB Table 6; beta in calibrated units)")
        text.append(table_text(head, swept, BETA_COLUMNS, 16))
    if base_eval.get("routing"):
        text.append("\n" + label + structure_text(base_eval["routing"]))
    text += plot(a.out, a.domains, conditions, seeds, rows)
    text.append(f"{len(jobs)} runs, {time.time() - start:.0f} s; tables in {a.out}/rpb_table.csv and .json")
    return "\n".join(text)


if __name__ == "__main__":
    print(study(parser().parse_args()))

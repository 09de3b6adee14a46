#!/usr/bin/env python3
"""The admission study of CIPHER-MoE (its Tables 2 and 3, Theorem 1) as a loop over `moe_lm posttrain`.

Post-trains a base model on the domain whose routing is most concentrated (read from the base's
per-expert loads on each domain, or given with --domain) under each admission condition: vanilla
(dropless), CIPHER-strict, CIPHER-reroute, LocMoE (the three with the locality loss), expert choice and
the fixed router, with the paper's capacity factor 8 and fill factor 4 (App. A.5). The base is the
paper's DeepSeek-V3 / GLM-5 geometry (Table 8: 256 routed experts, top-8, sigmoid gate), pretrained
without load balancing: capacity factor 8 binds only where one expert takes 8 times its uniform share of
a rank's tokens, which neither the driver's 64-expert top-6 bases nor a balanced 256-expert base reach on
any domain, while the unbalanced one does on arithmetic, as the paper's models do under domain SFT
(docs/results.md).

The affinity threshold tau is read from the base's routing on the chosen domain: tau_q is the
q-quantile of the cosine of every routed (token, expert) pair, so tau_0.1 filters a tenth of the
assignments whatever the model's cosine scale; LocMoE also runs at the paper's tau = 0.01. Every
admission run also checks CIPHER's Theorem 1 (moe_lm --witness-margin, analysis::signal_retention): the
high-affinity candidates are those at the base's 0.9-quantile cosine or above, and per (rank, expert)
pool the run reports whether one survives admission, whether natural order at the same capacity would
have kept one (measured and as eq. 19 predicts), and whether the capacity reaches the budget B_e.

Every run uses --pad-experts, so the expert compute it times is the capacity-padded one of
expert-parallel training, where every expert's buffer is as long as the hottest expert's; the whole
training step (forward, backward, optimiser) is timed too. The tables give, as mean +- sd over seeds:
the top-1 expert share, peak-to-mean load and dropped rate of the executed assignments (mean over MoE
layers), the padded expert rows, expert and step milliseconds and the speed-ups of the three over
vanilla of the same seed, in-domain / out-of-domain exact match and answer-span loss; and Theorem 1's
check. Runs whose JSON already exists are reused, so an interrupted study resumes. Standard library only.

    study_cipher.py --moe-lm build/examples/moe_lm/moe_lm --out cipher_study          # reduced grid
    study_cipher.py --moe-lm ... --out cipher_study --full                            # full grid

The reduced grid (the default, and the second half of the main job, studies.py): vanilla, CIPHER-strict
and CIPHER-reroute at tau_0.1, LocMoE at tau = 0.01, expert choice and the fixed router on 4
expert-parallel ranks, seeds 0 1 2, 150 steps. --full adds CIPHER-strict and LocMoE at tau_q for q in
0.05 0.25 0.5, CIPHER-reroute at tau_0.25, the locality loss alone, natural-order (capacity_position)
and probability-ranked (capacity_probs) admission at the same capacity, and CIPHER-strict, CIPHER-reroute
and natural order at capacity factor 2.
"""

import argparse
import json
import os
import subprocess
import time

from study_common import Job, csv_text, ensure_base, gnuplot_setup, mean_sd, run_jobs, table_text, write_atomic

DOMAINS = ["arithmetic", "code", "words"]
# The base of this study: CIPHER Table 8's 256 routed experts, top-8, sigmoid gate, pretrained without
# load balancing (no auxiliary loss, the expert bias never updated), so that its routing on one domain is
# as concentrated as the paper's domain SFT (docs/results.md). Expert hidden 4 keeps the routed experts'
# total width (256 x 4) that of the driver's default (64 x 16).
BASE_PRESET = "sigmoid_bias"
BASE_FLAGS = ["--experts", "256", "--top-k", "8", "--expert-hidden", "4", "--lbl", "0", "--bias-update-rate", "0"]
PAPER_TAU = 0.01  # CIPHER App. A.5's LocMoE threshold
REDUCED_QUANTILES = [0.1]
FULL_QUANTILES = [0.05, 0.1, 0.25, 0.5]
WITNESS_QUANTILE = 0.9  # a routed pair at or above the base's 0.9-quantile cosine is a signal (Theorem 1)
COLUMNS = [("top1", "top-1 share"), ("ptm", "peak/mean"), ("dropped", "dropped"),
           ("rows", "padded rows/step"), ("expert_ms", "expert ms/step"), ("step_ms", "step ms"),
           ("speedup_rows", "speed-up (rows)"), ("speedup_ms", "speed-up (expert)"), ("speedup_step", "speed-up (step)"),
           ("id_acc", "ID acc"), ("ood_acc", "OOD acc"), ("id_loss", "ID loss"), ("ood_loss", "OOD loss")]
THEOREM_COLUMNS = [("retained", "retained"), ("natural", "natural (measured)"), ("predicted", "natural (eq. 19)"),
                   ("natural_capacity", "natural needs C"), ("at_budget", "C >= B_e"),
                   ("retained_at_budget", "retained at B_e"), ("kept", "signals kept")]


def quantile_name(q):
    return f"q{q:g}"


def conditions_of(full, taus, capacity, fill, locality):
    """(name, posttrain flags) per condition; `taus` maps a quantile name to its tau. Every run post-trains
    with plain SFT (no auxiliary loss); the admission policies carry the locality loss as in the paper
    (lambda_loc 0.01 for CIPHER and LocMoE)."""
    loc = ["--locality", str(locality)] if locality else []

    def admit(policy, tau, cf=capacity, extra=()):
        return (["--admission", policy, "--capacity-factor", str(cf)] + ([f"--tau={tau!r}"] if tau is not None else [])
                + list(extra))

    q10 = quantile_name(0.1)
    conds = [("vanilla", ["--admission", "dropless"]),
             (f"cipher_strict_{q10}", admit("cipher_strict", taus[q10]) + loc),
             (f"cipher_reroute_{q10}", admit("cipher_reroute", taus[q10], extra=["--fill-factor", str(fill)]) + loc),
             (f"locmoe_tau{PAPER_TAU:g}", admit("locmoe", PAPER_TAU) + loc)]
    if full:
        for q, tau in taus.items():
            if q != q10:
                conds += [(f"cipher_strict_{q}", admit("cipher_strict", tau) + loc),
                          (f"locmoe_{q}", admit("locmoe", tau) + loc)]
        q25 = quantile_name(0.25)
        conds += [(f"cipher_reroute_{q25}", admit("cipher_reroute", taus[q25], extra=["--fill-factor", str(fill)]) + loc),
                  (f"locmoe_{q10}", admit("locmoe", taus[q10]) + loc),
                  ("vanilla_locality", ["--admission", "dropless"] + loc),
                  ("capacity_position", admit("capacity_position", None)),
                  ("capacity_probs", admit("capacity_probs", None)),
                  (f"cipher_strict_{q10}_cf2", admit("cipher_strict", taus[q10], cf=2.0) + loc),
                  (f"cipher_reroute_{q10}_cf2", admit("cipher_reroute", taus[q10], cf=2.0, extra=["--fill-factor", "1"]) + loc),
                  ("capacity_position_cf2", admit("capacity_position", None, cf=2.0))]
    # Expert choice at capacity factor 1: every expert takes N K / E tokens, as many assignments as top-K.
    conds.append(("expert_choice", ["--admission", "dropless", "--expert-choice", "--capacity-factor", "1"]))
    conds.append(("fixed_router", ["--admission", "dropless", "--fixed-router"]))
    return conds


def admits(flags):
    """Whether a condition runs an admission with a capacity (Theorem 1's check applies)."""
    return "--admission" in flags and flags[flags.index("--admission") + 1] != "dropless"


def layer_mean(result, key):
    layers = result["train"]["layers"]
    return sum(l[key] for l in layers) / len(layers)


def row_of(result):
    s, t = result["summary"], result["train"]
    row = {"top1": layer_mean(result, "top1_share"), "ptm": layer_mean(result, "peak_to_mean"),
           "dropped": layer_mean(result, "dropped_rate"), "rows": t["mean_expert_rows"],
           "expert_ms": t["mean_expert_ms"], "step_ms": t["mean_step_ms"],
           "id_acc": s["id"]["accuracy"], "ood_acc": s["ood"]["accuracy"],
           "id_loss": s["id"]["answer_loss"], "ood_loss": s["ood"]["answer_loss"]}
    counts = [l["signal_retention"] for l in t["layers"] if "signal_retention" in l]
    if counts:  # summed over the layers, as shares of the available pools
        total = {k: sum(c[k] for c in counts) for k in counts[0]}
        avail = total["available"]
        row.update({"retained": total["retained"] / avail, "natural": total["natural_retained"] / avail,
                    "predicted": total["natural_predicted"] / avail,
                    "natural_capacity": total["natural_capacity"] / avail, "at_budget": total["at_budget"] / avail,
                    "retained_at_budget": total["retained_at_budget"] / max(total["at_budget"], 1),
                    "kept": total["discriminative_kept"] / max(total["discriminative"], 1)})
    return row


def concentration(probe):
    """Top-1 share and peak-to-mean of the base's routed loads on one domain (mean over layers)."""
    top1, ptm = [], []
    for l in probe["train"]["layers"]:
        loads = l["routed_loads"]
        total = sum(loads)
        top1.append(max(loads) / total)
        ptm.append(max(loads) * len(loads) / total)
    return sum(top1) / len(top1), sum(ptm) / len(ptm)


def plot(out, domain, conditions, seed, runs, rows, eps):
    """Executed load per expert (seed `seed`) and Theorem 1's retention per condition."""
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
            write_atomic(dat, "".join(f"{rank} {layer['executed_loads'][j] / uniform}\n" for rank, j in enumerate(order)))
            series.append(f"'{dat}' using 1:2 with lines title '{name}'")
        key = "set key outside right;" if l == layers - 1 else "unset key;"  # one legend, beside the last panel
        panels.append(f"set title 'layer {l}'; {key} plot " + ", ".join(series) + ";")
    png = os.path.join(pdir, f"load_per_expert_{domain}.png")
    script = (f"set terminal {terminal}; set output '{png}';"
              f"set multiplot layout 1,{layers} title 'executed load per expert, post-training on {domain} (seed {seed})';"
              f"set xlabel 'expert (ordered by vanilla load)'; set ylabel 'load / uniform load';"
              f"set yrange [0:*]; " + " ".join(panels) + " unset multiplot")
    subprocess.run([gnuplot, "-e", script], check=True)
    written = [png]

    checked = [(name, m) for name, m in rows if "retained" in m]
    if checked:
        dat = os.path.join(pdir, f"theorem1_{domain}.dat")
        write_atomic(dat, "".join(f"{i} {name} {m['retained'][0]} {m['natural'][0]} {m['predicted'][0]}\n"
                                  for i, (name, m) in enumerate(checked)))
        png = os.path.join(pdir, f"theorem1_{domain}.png")
        script = (f"set terminal {terminal}; set output '{png}'; set key outside right; set yrange [0:1.05];"
                  f"set title 'signal retention per (rank, expert) pool on {domain}, mean over seeds';"
                  f"set ylabel 'share of pools offered a signal'; set xtics rotate by -30;"
                  f"set style data histograms; set style fill solid 0.8; set boxwidth 0.9;"
                  f"plot '{dat}' using 3:xtic(2) title 'kept by the admission',"
                  f" '' using 4 title 'natural order, same capacity', '' using 5 title 'natural order, eq. 19',"
                  f" {1 - eps} with lines dt 2 title '1 - eps (Theorem 1)'")
        subprocess.run([gnuplot, "-e", script], check=True)
        written.append(png)
    return written


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-lm", required=True, help="the moe_lm executable")
    ap.add_argument("--out", required=True, help="study directory (checkpoint, runs, tables)")
    ap.add_argument("--base", help="a base checkpoint to reuse (default: OUT/base.pt, pretrained here with the "
                                   "256-expert top-8 geometry if missing)")
    ap.add_argument("--pretrain-steps", type=int, default=1500)
    ap.add_argument("--domain", default="auto", help="post-training domain (auto: the most concentrated)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150, help="post-training steps")
    ap.add_argument("--capacity-factor", type=float, default=8.0,
                    help="admission capacity as a multiple of the uniform load (CIPHER App. A.5: 8)")
    ap.add_argument("--fill-factor", type=float, default=4.0, help="CIPHER-reroute fill target (App. A.5: 4)")
    ap.add_argument("--groups", type=int, default=4,
                    help="expert-parallel ranks: admission, expert choice and the locality loss work per rank")
    ap.add_argument("--locality", type=float, default=0.01,
                    help="lambda_loc of the locality loss under CIPHER and LocMoE (0: off)")
    ap.add_argument("--tau-quantiles", nargs="+", type=float,
                    help=f"tau as quantiles of the base's routed cosines (default {REDUCED_QUANTILES}, {FULL_QUANTILES}"
                         " with --full; 0.1 is always run)")
    ap.add_argument("--full", action="store_true",
                    help="tau sweeps, the locality loss alone, natural-order and probability-ranked admission, "
                         "capacity factor 2")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (each uses one thread)")
    ap.add_argument("--log-every", type=int, default=25, help="training-curve resolution (steps)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further posttrain flags")
    return ap


def study(a):
    """Runs the study `a` (parsed by parser()) and returns its table as text."""
    seeds = a.seeds
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    start = time.time()

    base = a.base or os.path.join(a.out, "base.pt")
    ensure_base(a.moe_lm, base, BASE_PRESET, a.pretrain_steps, "study_cipher", BASE_FLAGS)

    # The base's routing per domain: a few post-training steps at learning rate 0 leave the model as it
    # is and record the routed loads and cosines of that domain's batches (dropless, unpadded).
    probes = run_jobs([Job(f"base_loads_{d}", [a.moe_lm, "--log-every", "0", "posttrain", "--base", base,
                                               "--domain", d, "--steps", "5", "--lr", "0"],
                           os.path.join(a.out, "runs", f"base_loads_{d}.json")) for d in DOMAINS], a.jobs,
                      "study_cipher")
    skew = {d: (concentration(probes[f"base_loads_{d}"]), probes[f"base_loads_{d}"]) for d in DOMAINS}
    for d in DOMAINS:
        print(f"study_cipher: base routing on {d}: top-1 share {skew[d][0][0]:.3f}, peak/mean {skew[d][0][1]:.2f}",
              flush=True)
    domain = max(DOMAINS, key=lambda d: skew[d][0][1]) if a.domain == "auto" else a.domain
    cosines = skew[domain][1]["train"]["affinity_quantiles"]
    levels = sorted(set((a.tau_quantiles or (FULL_QUANTILES if a.full else REDUCED_QUANTILES)) + [0.1]))
    taus = {quantile_name(q): cosines[f"{q:g}"] for q in levels}
    margin = cosines[f"{WITNESS_QUANTILE:g}"]
    print(f"study_cipher: routed cosines on {domain}: " + ", ".join(f"tau_{q} = {t:.4f}" for q, t in taus.items())
          + f"; signal margin (0.9-quantile) {margin:.4f}", flush=True)
    conditions = conditions_of(a.full, taus, a.capacity_factor, a.fill_factor, a.locality)

    witness = [f"--witness-margin={margin!r}"]
    jobs = [Job(f"{domain}_{name}_s{seed}",
                [a.moe_lm, "--log-every", str(a.log_every), "posttrain", "--base", base, "--domain", domain,
                 "--condition", "sft", "--pad-experts", "--groups", str(a.groups), "--seed", str(seed),
                 "--steps", str(a.steps)] + flags + (witness if admits(flags) else []) + a.extra,
                os.path.join(a.out, "runs", f"{domain}_{name}_s{seed}.json"))
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
            for key, of in (("speedup_rows", "rows"), ("speedup_ms", "expert_ms"), ("speedup_step", "step_ms")):
                r[key] = v[of] / r[of] if r[of] > 0 else None
            per_seed.append(r)
        rows.append((name, {k: mean_sd([r.get(k) for r in per_seed]) for k in per_seed[0]}))

    keys = [k for k, _ in COLUMNS + THEOREM_COLUMNS]
    write_atomic(os.path.join(a.out, "cipher_table.csv"), csv_text(
        [["domain", "condition", "seeds"] + [f"{k}_{s}" for k in keys for s in ("mean", "sd")]]
        + [[domain, name, 0 if name == "base" else len(seeds)] + [x for k in keys for x in m.get(k, ("", ""))]
           for name, m in rows]))
    eps = 0.1  # moe_lm's signal_retention options (the paper's illustrative eps and eta)
    write_atomic(os.path.join(a.out, "cipher_table.json"), json.dumps(
        {"domain": domain, "seeds": seeds, "steps": a.steps, "capacity_factor": a.capacity_factor,
         "fill_factor": a.fill_factor, "groups": a.groups, "locality": a.locality, "taus": taus,
         "signal_margin": margin, "base_cosine_quantiles": cosines,
         "base_concentration": {d: {"top1": skew[d][0][0], "peak_to_mean": skew[d][0][1]} for d in DOMAINS},
         "rows": [{"condition": n, **{k: {"mean": v[0], "sd": v[1]} for k, v in m.items()}} for n, m in rows]},
        indent=1))

    text = [f"CIPHER admission study on {domain}: mean ± sd over seeds {' '.join(map(str, seeds))}, {a.steps} steps,"
            f" {a.groups} expert-parallel ranks, capacity {a.capacity_factor:g} x uniform, fill {a.fill_factor:g},"
            f" locality loss {a.locality:g} under CIPHER/LocMoE, experts capacity-padded; tau_q = the q-quantile of"
            " the base's routed cosines (" + ", ".join(f"{q} {t:.4f}" for q, t in taus.items()) + ")",
            table_text(f"{'condition':<24}", rows, COLUMNS, 18),
            f"\nTheorem 1 on {domain}: per (rank, expert) pool offered a signal (a routed cosine >= {margin:.4f}, the"
            f" base's 0.9-quantile), the share where admission kept one, where natural order at the same capacity"
            f" would have (measured; eq. 19), the capacity natural order needed (mean position of the first signal),"
            f" the share with C >= B_e (mu = 0, eps 0.1, eta 0.01) and retention there (Theorem 1: >= {1 - eps:g}),"
            " and the share of all signals kept",
            table_text(f"{'condition':<24}", [(n, m) for n, m in rows if "retained" in m], THEOREM_COLUMNS, 20)]
    text += plot(a.out, domain, conditions, seeds[0], {n: per_cond[n][seeds[0]] for n, _ in conditions}, rows, eps)
    text.append(f"{len(jobs)} runs, {time.time() - start:.0f} s; tables in {a.out}/cipher_table.csv and .json")
    return "\n".join(text)


if __name__ == "__main__":
    print(study(parser().parse_args()))

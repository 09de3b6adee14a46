#!/usr/bin/env python3
"""study_cipher.py's grid and aggregation: the conditions' moe_lm flags (tau as the base's quantiles,
written so a negative one parses, the paper's capacity and fill), which conditions get Theorem 1's
check, and the shares row_of computes from a run's signal-retention counts. Standard library only:

    python3 examples/moe_lm/test_study_cipher.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import study_cipher  # noqa: E402

TAUS = {"q0.05": -0.12, "q0.1": -0.0625, "q0.25": 0.0277, "q0.5": 0.135}


def flags_of(conditions):
    return dict(conditions)


class Conditions(unittest.TestCase):
    def test_reduced_grid(self):
        conds = flags_of(study_cipher.conditions_of(False, {"q0.1": TAUS["q0.1"]}, 8.0, 4.0, 0.01))
        self.assertEqual(list(conds), ["vanilla", "cipher_strict_q0.1", "cipher_reroute_q0.1", "locmoe_tau0.01",
                                       "expert_choice", "fixed_router"])
        self.assertEqual(conds["cipher_strict_q0.1"], ["--admission", "cipher_strict", "--capacity-factor", "8.0",
                                                       "--tau=-0.0625", "--locality", "0.01"])
        self.assertEqual(conds["cipher_reroute_q0.1"], ["--admission", "cipher_reroute", "--capacity-factor", "8.0",
                                                        "--tau=-0.0625", "--fill-factor", "4.0", "--locality", "0.01"])
        self.assertIn("--tau=0.01", conds["locmoe_tau0.01"])
        self.assertEqual(conds["vanilla"], ["--admission", "dropless"])

    def test_full_grid_and_the_check(self):
        conds = flags_of(study_cipher.conditions_of(True, TAUS, 8.0, 4.0, 0.0))
        for q, tau in TAUS.items():
            self.assertIn(f"--tau={tau!r}", conds[f"cipher_strict_{q}"])
            self.assertIn(f"--tau={tau!r}", conds[f"locmoe_{q}"])
        self.assertNotIn("--tau", " ".join(conds["capacity_position"]))  # natural order has no threshold
        self.assertIn("2.0", conds["cipher_strict_q0.1_cf2"])
        self.assertNotIn("--locality", conds["cipher_strict_q0.1"])  # locality 0: off
        checked = {name for name, flags in conds.items() if study_cipher.admits(flags)}
        self.assertEqual(checked, {n for n in conds if n.startswith(("cipher", "locmoe", "capacity"))})


class RowOf(unittest.TestCase):
    def result(self, layers):
        return {"summary": {"id": {"accuracy": 0.1, "answer_loss": 1.0}, "ood": {"accuracy": 0.2, "answer_loss": 1.5}},
                "train": {"mean_expert_rows": 10.0, "mean_expert_ms": 2.0, "mean_step_ms": 5.0, "layers": layers}}

    def test_shares_sum_the_layers_before_dividing(self):
        counts = [dict(pools=10, available=4, retained=4, natural_retained=3, natural_predicted=3.5, natural_capacity=8,
                       at_budget=2, retained_at_budget=2, discriminative=6, discriminative_kept=5),
                  dict(pools=10, available=6, retained=5, natural_retained=3, natural_predicted=2.5, natural_capacity=12,
                       at_budget=0, retained_at_budget=0, discriminative=4, discriminative_kept=3)]
        layers = [dict(top1_share=0.1, peak_to_mean=2.0, dropped_rate=0.1, signal_retention=c) for c in counts]
        row = study_cipher.row_of(self.result(layers))
        self.assertAlmostEqual(row["retained"], 9 / 10)
        self.assertAlmostEqual(row["natural"], 6 / 10)
        self.assertAlmostEqual(row["predicted"], 6.0 / 10)
        self.assertAlmostEqual(row["natural_capacity"], 20 / 10)
        self.assertAlmostEqual(row["at_budget"], 2 / 10)
        self.assertAlmostEqual(row["retained_at_budget"], 2 / 2)
        self.assertAlmostEqual(row["kept"], 8 / 10)
        self.assertEqual(row["step_ms"], 5.0)

    def test_runs_without_admission_have_no_check(self):
        row = study_cipher.row_of(self.result([dict(top1_share=0.1, peak_to_mean=2.0, dropped_rate=0.0)]))
        self.assertNotIn("retained", row)


if __name__ == "__main__":
    unittest.main()

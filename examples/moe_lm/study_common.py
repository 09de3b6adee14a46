"""What study_rpb.py and study_cipher.py share: running the driver, caching
each run's JSON so a study resumes, and mean +- sd over seeds."""

import json
import math
import os
import subprocess
import sys


def run(cmd, log, study):
    """Runs one moe_lm command, its progress lines going to `log`; returns its JSON."""
    with open(log, "w") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if out.returncode != 0:
        sys.exit(f"{study}: {' '.join(cmd)} failed (exit {out.returncode}); see {log}")
    return json.loads(out.stdout)


def cached(path, make):
    """The JSON at `path`, made (and written atomically) if it is not there yet."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    result = make()
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    return result


def mean_sd(values):
    """Mean and sample standard deviation of the values that are not None."""
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, sd

"""What study_rpb.py, study_cipher.py and studies.py share: pretraining the base, running the
driver's jobs a few at a time with a progress display, caching each run's JSON so a study resumes,
and mean +- sd over seeds. Standard library only."""

import contextlib
import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

STEP = re.compile(r"\[(\w+)\] step (\d+)/(\d+)")


class Job:
    """One moe_lm command whose JSON result is cached at `path` (its progress lines go to path.log)."""

    def __init__(self, name, cmd, path):
        self.name, self.cmd, self.path, self.log = name, cmd, path, os.path.splitext(path)[0] + ".log"


def load_result(path):
    """The JSON object in `path`; ValueError saying why when the file holds anything else (a run
    killed mid-write, a damaged disk)."""
    with open(path, encoding="utf-8") as f:
        result = json.load(f)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(result, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(result), "a number")
        raise ValueError(f"{kind}, not a JSON object")
    return result


def write_atomic(path, text):
    """Writes `text` to `path` through a temporary file and a rename, so a reader (or a killed study) never
    sees a half-written table."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def csv_text(rows):
    """The rows (lists) as CSV text."""
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


def last_step(log):
    """'step a/b' of the last progress line in `log`, or '' when there is none yet."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    steps = STEP.findall(tail)
    return f"step {steps[-1][1]}/{steps[-1][2]}" if steps else ""


def run_jobs(jobs, workers, study):
    """Runs the jobs whose JSON is not cached yet, `workers` at a time, and returns {name: result}.

    Prints a line as each job finishes (with the elapsed time and an estimate of what is left) and,
    while they run, a status line with every running job's last training step: rewritten in place on
    a terminal, every 30 s otherwise. A failed job stops the others and ends the study with its log.
    A cached result that cannot be read is said so, removed and run again."""
    results = {}
    for job in jobs:
        if not os.path.exists(job.path):
            continue
        try:
            results[job.name] = load_result(job.path)
        except ValueError as e:
            print(f"{study}: cached {job.path} is unreadable ({e}); running it again", flush=True)
            os.remove(job.path)
    pending = [j for j in jobs if j.name not in results]
    if results:
        print(f"{study}: {len(results)} of {len(jobs)} runs cached in {os.path.dirname(jobs[0].path)}"
              " (delete them to recompute)", flush=True)
    tty = sys.stdout.isatty()
    total, start, last_status, durations = len(pending), time.time(), 0.0, []
    running = []  # (job, process, stdout file, start time)
    try:
        while pending or running:
            while pending and len(running) < workers:
                job = pending.pop(0)
                out = open(job.path + ".out", "w")
                with open(job.log, "w") as err:
                    proc = subprocess.Popen(job.cmd, stdout=out, stderr=err)
                running.append((job, proc, out, time.time()))
            time.sleep(0.5)
            for entry in list(running):
                job, proc, out, began = entry
                if proc.poll() is None:
                    continue
                running.remove(entry)
                out.close()
                if proc.returncode != 0:
                    sys.exit(f"{study}: {' '.join(job.cmd)} failed (exit {proc.returncode}); see {job.log}")
                try:
                    results[job.name] = load_result(job.path + ".out")
                except ValueError as e:
                    sys.exit(f"{study}: {' '.join(job.cmd)} printed no JSON object ({e}); see {job.path}.out")
                os.replace(job.path + ".out", job.path)  # only results that read back are cached
                durations.append(time.time() - began)
                done = len(durations)
                left = sum(durations) / done * (total - done) / workers
                print(("\r\033[K" if tty else "") + f"[{done}/{total}] {job.name} done in {durations[-1]:.0f} s"
                      f"  ({time.time() - start:.0f} s elapsed, about {left:.0f} s left)", flush=True)
            now = time.time()
            if running and (tty or now - last_status >= 30):
                status = ", ".join(f"{j.name} {last_step(j.log)}".rstrip() for j, _, _, _ in running)
                line = f"  running: {status}  ({now - start:.0f} s)"
                print(("\r\033[K" + line[:160]) if tty else line, end="" if tty else "\n", flush=True)
                last_status = now
    finally:
        for job, proc, out, _ in running:
            proc.kill()
            proc.wait()
            out.close()
        if tty:
            print("\r\033[K", end="", flush=True)
    return results


def ensure_base(moe_lm, base, gating, steps, study, extra=()):
    """Pretrains `base` unless it exists (`extra`: further pretrain flags), streaming the driver's progress
    lines; its JSON goes to base.json, a record for the reader that no study reads back (a damaged one does
    not matter)."""
    if os.path.exists(base):
        print(f"{study}: reusing the base checkpoint {base}", flush=True)
        return
    print(f"{study}: pretraining {base} ({steps} steps, {gating} router) ...", flush=True)
    stem = os.path.splitext(base)[0]
    cmd = [moe_lm, "--log-every", "100", "pretrain", "--out", base + ".tmp", "--gating", gating,
           "--steps", str(steps)] + list(extra)
    start = time.time()
    with open(stem + ".json.tmp", "w") as out, open(stem + ".log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr:
            log.write(line)
            if STEP.match(line):
                print(f"  {line.rstrip()}  ({time.time() - start:.0f} s)", flush=True)
        if proc.wait() != 0:
            sys.exit(f"{study}: {' '.join(cmd)} failed (exit {proc.returncode}); see {stem}.log")
    os.replace(stem + ".json.tmp", stem + ".json")
    os.replace(base + ".tmp", base)  # last, so an interrupted pretraining is not mistaken for a base


def mean_sd(values):
    """Mean and sample standard deviation of the values that are not None."""
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, sd


def table_text(head, rows, columns, width):
    """A fixed-width table of mean±sd cells: `head` heads the name column (and sets its width),
    rows are (name, {key: (mean, sd)}), columns (key, label); a missing key leaves its cell blank."""
    left = width // 2 + 1
    lines = [head + "".join(f"{label:>{width}}" for _, label in columns)]
    for name, m in rows:
        lines.append(f"{name:<{len(head)}}" + "".join(
            f"{m[k][0]:>{left}.3f}±{m[k][1]:<{width - left - 1}.3f}" if k in m else " " * width for k, _ in columns))
    return "\n".join(lines)


def gnuplot_setup(out, size, study):
    """(gnuplot, terminal, plot folder) for a study's PNG plots, or None (with a message) without gnuplot.
    noenhanced: condition names such as router_l2 are text, not subscripts."""
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        print(f"{study}: gnuplot not found (gnuplot-nox); no plots", file=sys.stderr)
        return None
    pdir = os.path.join(out, "plots")
    os.makedirs(pdir, exist_ok=True)
    cairo = subprocess.run([gnuplot, "-e", "set terminal pngcairo"], capture_output=True).returncode == 0
    return gnuplot, f"{'pngcairo' if cairo else 'png'} noenhanced size {size}", pdir

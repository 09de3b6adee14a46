"""`moe-route route` killed with SIGKILL at any moment leaves, under each final output name, either
nothing or the complete file (issue 18: nothing half-written). Standard library only (the .npy
files are checked by a reader of its own), so that it runs wherever the CLI tests do.

    route_sigkill.py MOE_ROUTE WORK_DIR

Writes logits [N x E] big enough that a run takes a good fraction of a second, routes them once
to completion (the reference, and the run's duration T), then kills runs at fractions of T (while
reading and routing: the outputs must be absent), as soon as the first staged temporary appears
(while writing), as soon as the permutation's appears (the fifth of six) and as soon as the first
final name appears (while renaming). After each kill every final name must be absent or
byte-identical to the reference, and every leftover temporary must be recognisable as one.
Finally a run into a directory with such leftovers completes."""

import array
import ast
import filecmp
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time

N, E, K = 1 << 22, 8, 2  # 128 MiB of logits in, 128 MiB of outputs: about a second on 2 cores
SHAPES = {"indices.npy": ("<i4", (N, K)), "gates.npy": ("<f4", (N, K)), "counts.npy": ("<i8", (E,)),
          "offsets.npy": ("<i8", (E + 1,)), "permutation.npy": ("<i8", (N * K,))}  # dropless: N K rows
FINAL = list(SHAPES) + ["stats.json"]
ITEMSIZE = {"<i4": 4, "<f4": 4, "<i8": 8}


def npy_header(descr, shape):
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()


def write_logits(path):
    """Gaussian logits; one random block of rows repeated, which routes the same as fresh noise."""
    rng = random.Random(2026)
    rows = 4096
    block = array.array("f", [rng.gauss(0.0, 1.0) for _ in range(rows * E)]).tobytes()
    with open(path, "wb") as f:
        f.write(npy_header("<f4", (N, E)))
        for _ in range(N // rows):
            f.write(block)


def npy_problem(path, descr, shape):
    """Why `path` is not a complete .npy of that dtype and shape, or None."""
    with open(path, "rb") as f:
        head = f.read(10)
        if len(head) < 10 or head[:6] != b"\x93NUMPY":
            return "no .npy magic"
        major = head[6]
        if major == 1:
            length = struct.unpack("<H", head[8:10])[0]
            offset = 10
        else:
            length = struct.unpack("<I", head[8:10] + f.read(2))[0]
            offset = 12
        try:
            h = ast.literal_eval(f.read(length).decode("latin1"))
        except (ValueError, SyntaxError) as e:
            return f"unreadable header ({e})"
    if (h.get("descr"), h.get("fortran_order"), tuple(h.get("shape", ()))) != (descr, False, shape):
        return f"header {h}, expected {descr} {shape}"
    count = 1
    for d in shape:
        count *= d
    size, expected = os.path.getsize(path), offset + length + count * ITEMSIZE[descr]
    return None if size == expected else f"{size} bytes, a complete file has {expected}"


def check_complete(out):
    """Fails unless every final output in `out` is present and valid."""
    for name in FINAL:
        path = os.path.join(out, name)
        if not os.path.exists(path):
            sys.exit(f"route_sigkill: {path} is missing after a completed run")
        if name in SHAPES:
            problem = npy_problem(path, *SHAPES[name])
            if problem:
                sys.exit(f"route_sigkill: {path}: {problem}")
    with open(os.path.join(out, "stats.json")) as f:
        stats = json.load(f)
    if stats.get("tokens") != N or stats.get("experts") != E:
        sys.exit(f"route_sigkill: {out}/stats.json: tokens {stats.get('tokens')}, experts {stats.get('experts')}")


def check_after_kill(out, reference, what):
    """Every final name in `out` absent or identical to the reference; every other file a temporary
    that a reader cannot take for an output. Returns (final names present, leftover temporaries)."""
    names = os.listdir(out) if os.path.isdir(out) else []
    present = [n for n in names if n in FINAL]
    for n in present:
        if not filecmp.cmp(os.path.join(out, n), os.path.join(reference, n), shallow=False):
            sys.exit(f"route_sigkill: {what}: {out}/{n} differs from the completed run's (half-written)")
    leftovers = [n for n in names if n not in FINAL]
    for n in leftovers:
        if n.endswith((".npy", ".json")):
            sys.exit(f"route_sigkill: {what}: leftover {out}/{n} could be taken for an output")
    return present, leftovers


def killed_run(cli, logits, out, when):
    """Starts a route into `out` and kills it once when(elapsed seconds, names in out) holds.
    Returns whether the run finished before that."""
    proc = subprocess.Popen([cli, "route", "--logits", logits, "--k", str(K), "--out", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.monotonic()
    while proc.poll() is None:
        names = os.listdir(out) if os.path.isdir(out) else []
        if when(time.monotonic() - start, names):
            proc.kill()
            break
        time.sleep(0.001)
    proc.wait()
    return proc.returncode == 0


def main():
    cli, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    logits = os.path.join(work, "logits.npy")
    write_logits(logits)

    reference = os.path.join(work, "reference")
    start = time.monotonic()
    subprocess.run([cli, "route", "--logits", logits, "--k", str(K), "--out", reference], check=True,
                   stdout=subprocess.DEVNULL)
    duration = time.monotonic() - start
    check_complete(reference)

    kills = [(f"after {f:.2f} T", lambda t, _, f=f: t >= f * duration) for f in (0.1, 0.3, 0.5, 0.7, 0.9)]
    kills.append(("at the first staged temporary", lambda _, names: any(".tmp." in n for n in names)))
    kills.append(("at the staged permutation", lambda _, names: any(n.startswith(".permutation.npy.tmp") for n in names)))
    kills.append(("at the first final name", lambda _, names: any(n in FINAL for n in names)))
    interrupted, with_leftovers = 0, None
    for i, (what, when) in enumerate(kills):
        out = os.path.join(work, f"killed{i}")
        finished = killed_run(cli, logits, out, when)
        present, leftovers = check_after_kill(out, reference, what)
        interrupted += not present
        print(f"route_sigkill: killed {what}: {'finished first' if finished else 'killed'}, "
              f"{len(present)} of {len(FINAL)} outputs, leftovers {leftovers or 'none'}", flush=True)
        if leftovers and with_leftovers is None:
            with_leftovers = out
        else:
            shutil.rmtree(out, ignore_errors=True)
    if interrupted == 0:
        sys.exit(f"route_sigkill: no kill came before the outputs appeared (a run takes {duration:.2f} s); "
                 "the test proves nothing: make N larger")

    # A run over a killed run's leftovers completes, with the reference's outputs.
    out = with_leftovers or os.path.join(work, "rerun")
    subprocess.run([cli, "route", "--logits", logits, "--k", str(K), "--out", out], check=True,
                   stdout=subprocess.DEVNULL)
    check_complete(out)
    check_after_kill(out, reference, "rerun")
    print(f"route_sigkill: a run takes {duration:.2f} s; {interrupted} of {len(kills)} kills interrupted it "
          f"before any output; the rerun{' over leftovers' if with_leftovers else ''} completed", flush=True)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()

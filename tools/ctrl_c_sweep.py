"""Ctrl-C at many instants of ``hicached serve``'s start: how does each run end?

Starts ``python -m hicached serve`` (its own socket, arena and state dir in a temp dir, L3 off)
again and again, sends SIGINT ``delay`` seconds after the process was started, for ``--runs``
delays spread evenly from ``--first`` to ``--last`` s, and sorts the ends:

  interrupted   ended by SIGINT, the last line on stderr ``hicached: interrupted``, no traceback
                (the start was abandoned: docs/operating.md, Ctrl-C)
  stopped       ended by SIGINT after ``hicached stopped`` (the daemon was up: an orderly stop)
  silent        ended by SIGINT with nothing on stderr (before Python took SIGINT)
  python        Python's own start was cut (``Fatal Python error``: its site import)
  traceback     any other end with a traceback
  abort         ``terminate called`` (an exception thrown into C++), SIGABRT
  exit 130      the one line, then exit status 130 (how hicached ended before: a shell script
                that ran it would go on to its next command)
  hung          still running ``--hung-s`` after the signal: the Ctrl-C was lost (then stopped
                with SIGTERM)
  other         anything else (the status and the last line are shown)

and whether the arena file was left in /dev/shm (it never may be). A run is a fresh process, so
the delays land in the interpreter's start, the imports, the arena's reservation and,
for late delays and small arenas, after ready.

    PYTHONPATH=$PWD python tools/ctrl_c_sweep.py [--runs 40] [--first 0.05] [--last 1.6]
        [--l2-size 2GiB] [--slab-size 1MiB] [--hung-s 60] [--verbose]
        [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def classify(returncode: int, out: str, err: str) -> str:
    lines = err.strip().splitlines()
    if "terminate called" in err or returncode == -signal.SIGABRT:
        return "abort"
    if "Fatal Python error" in err:
        return "python"
    if "Traceback" in err:
        return "traceback"
    if returncode == -signal.SIGINT:
        if "hicached stopped" in out:
            return "stopped"
        if not lines:
            return "silent"
        if lines[-1] == "hicached: interrupted":
            return "interrupted"
    if returncode == 130 and lines and lines[-1] == "hicached: interrupted":
        return "exit 130"  # the one line, but an exit: a shell script running it goes on
    return "other"


def run_once(delay_s: float, l2_size: str, slab_size: str, tmp: str, i: int,
             hung_s: float) -> tuple[str, int, str, bool]:
    arena = f"/dev/shm/hicached-sweep-{os.getpid()}-{i}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHED_")}
    cmd = [sys.executable, "-m", "hicached", "serve", "--l2-size", l2_size, "--slab-size",
           slab_size, "--endpoint", f"ipc://{tmp}/s{i}.sock", "--state-dir", f"{tmp}/state{i}",
           "--arena-path", arena, "--l3-backend", "none"]
    start = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(max(0.0, start + delay_s - time.monotonic()))
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=hung_s)
    except subprocess.TimeoutExpired:  # the signal was lost: the start went on
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
        return "hung", p.returncode, (err.strip().splitlines() or [""])[-1], False
    left = os.path.exists(arena) or os.path.exists(arena + ".presence")
    for path in (arena, arena + ".presence"):  # a leftover is counted, then removed
        if os.path.exists(path):
            os.unlink(path)
    last = (err.strip().splitlines() or [""])[-1]
    return classify(p.returncode, out, err), p.returncode, last, left


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--first", type=float, default=0.05, help="first delay, s")
    ap.add_argument("--last", type=float, default=1.6, help="last delay, s")
    ap.add_argument("--l2-size", default="2GiB")
    ap.add_argument("--slab-size", default="1MiB")
    ap.add_argument("--hung-s", type=float, default=60.0,
                    help="a run still going this long after the signal counts as hung (then "
                    "SIGTERM stops it)")
    ap.add_argument("--verbose", action="store_true", help="one line per run")
    ap.add_argument("--json", action="store_true", help="every run and the counts as JSON")
    args = ap.parse_args()
    step = (args.last - args.first) / max(1, args.runs - 1)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            delay = args.first + i * step
            kind, rc, last, left = run_once(delay, args.l2_size, args.slab_size, tmp, i,
                                             args.hung_s)
            runs.append({"delay_s": round(delay, 3), "kind": kind, "status": rc,
                         "last_line": last, "arena_left": left})
            if args.verbose:
                print(f"{delay:5.2f} s  {kind:11s} status {rc:4d}  {last[:90]}"
                      + ("  ARENA LEFT" if left else ""), flush=True)
    counts = collections.Counter((r["kind"], r["status"]) for r in runs)
    leftovers = sum(r["arena_left"] for r in runs)
    if args.json:
        print(json.dumps({"runs": runs, "counts": {f"{k} {rc}": n for (k, rc), n in
                                                   sorted(counts.items())},
                          "arena_files_left": leftovers}))
        return
    for (kind, rc), n in sorted(counts.items()):
        at = [round(r["delay_s"], 2) for r in runs if (r["kind"], r["status"]) == (kind, rc)]
        print(f"{kind:11s} status {rc:4d}: {n:3d}  at {at}")
    print(f"arena files left in /dev/shm: {leftovers}")


if __name__ == "__main__":
    main()

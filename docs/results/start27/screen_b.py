#!/usr/bin/env python
"""Screen of ``ProbeSpec.start_depth`` on the windows the start rule moved most (the pays
windows that lost > 0.10 at seeds 0-7, seed 9's held-out failure, random-1 at seed 8,
blackwell at seeds 2 and 3): each window replayed with ``rand26/trace_all.py --policy``
for each file given, its oracle fraction next to ``baef2897``'s and ``4c5ff8da``'s eval
runs. From the repository root, venv active, PYTHONPATH=$PWD:

    python docs/results/start27/screen_b.py NAME=FILE ... > docs/results/start27/screen_b.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

BASE = {s: f"/tmp/n26/c_s{s}/results.json" for s in range(8)}
BASE.update({s: f"/tmp/h26/cand_s{s}/results.json" for s in range(8, 16)})
CAND = {s: f"/tmp/s27/cand_s{s}/results.json" for s in range(16)}  # 4c5ff8da
WINDOWS = [(2, "fixed C=64 h100_llama31_8b prior=none"),
           (4, "azure_conv load=1.5 mod=0 random-1 prior=none"),
           (0, "azure_code load=1.5 mod=0.8 random-0 prior=none"),
           (2, "azure_code load=0.5 mod=0.8 h100_llama31_8b prior=none"),
           (9, "fixed C=64 h100_llama31_8b prior=none"),
           (8, "azure_conv load=1.5 mod=0 random-1 prior=none"),
           (8, "azure_conv load=0.5 mod=0 random-1 prior=none"),
           (2, "azure_conv load=1.5 mod=0.8 blackwell_tp8 prior=none"),
           (3, "azure_conv load=1.5 mod=0 blackwell_tp8 prior=none")]


def runs(path: str, label: str) -> tuple[float, float]:
    """The oracle's and ppo's throughput of the window in a results.json."""
    with open(path) as f:
        for s in json.load(f)["scenarios"]:
            if s["scenario"] == label or s["scenario"].startswith(label + " "):
                return s["runs"]["oracle"]["throughput_tok_s"], s["runs"]["ppo"]["throughput_tok_s"]
    raise KeyError(label)


def main() -> None:
    """Print the table."""
    files = dict(arg.split("=", 1) for arg in sys.argv[1:])
    env = dict(os.environ, PYTHONPATH=f"{os.getcwd()}:{os.getcwd()}/scripts")
    print("| seed | window | baef2897 | 4c5ff8da | " + " | ".join(files) + " |")
    print("|---|---|---|---|" + "---|" * len(files))
    for seed, label in WINDOWS:
        best, base = runs(BASE[seed], label)
        row = [f"{base / best:.3f}", f"{runs(CAND[seed], label)[1] / best:.3f}"]
        for path in files.values():
            out = subprocess.run(["nice", "-n", "10", sys.executable,
                                  "docs/results/rand26/trace_all.py", str(seed), label,
                                  "--quiet", "--policy", path], env=env, capture_output=True,
                                 text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("throughput ")]
            if not lines:
                print(out.stdout[-500:], out.stderr[-1500:], file=sys.stderr)
                raise SystemExit(f"no throughput: seed {seed} {label} {path}")
            tok = float(lines[-1].split()[1])
            row.append(f"{tok / best:.3f}")
        print(f"| {seed} | {label} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()

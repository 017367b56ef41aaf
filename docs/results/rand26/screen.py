#!/usr/bin/env python
"""Oracle fraction of the shipped file on no-profile windows under each start rule of
``trace_all.py`` (prototypes in the tool, not in the policy), the oracle's throughput read
from a ``specctl-eval`` results.json at the window's seed. From the repository root, venv
active, PYTHONPATH=$PWD:

    python docs/results/rand26/screen.py [--pays] [RULE ...] > docs/results/rand26/screen_v2.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

RESULTS = {8: "/tmp/h26/cand_s8/results.json"}  # baef2897; the oracle is the same in every run
RESULTS.update({s: f"/tmp/n26/c_s{s}/results.json" for s in range(8)})
WINDOWS = [(8, f"azure_conv load={ld} mod={m} random-1 prior=none")
           for ld in ("0.5", "1.5") for m in ("0", "0.8")]
WINDOWS += [(s, f"azure_conv load={ld} mod={m} blackwell_tp8 prior=none")
            for s in (2, 3) for ld in ("0.5", "1.5") for m in ("0", "0.8")]
# speculation pays here (the rule's cost)
WINDOWS += [(2, f"azure_conv load={ld} mod={m} h100_llama31_8b prior=none")
            for ld in ("0.5", "1.5") for m in ("0", "0.8")]
WINDOWS += [(0, "azure_code load=1.5 mod=0 moe_h200_acc2.5 prior=none"),
            (0, "azure_code load=1.5 mod=0.8 random-0 prior=none"),
            (0, "azure_conv load=0.5 mod=0 h200_llama31_8b prior=none")]
# --pays: seed 1's no-profile load-1.5 azure windows where speculation pays most (no
# speculation at most 0.99 of the oracle), the rule's cost
PAYS = [(1, f"{w} load=1.5 mod={m} {p} prior=none")
        for w, p in (("azure_conv", "h100_llama31_8b"), ("azure_conv", "random-0"),
                     ("azure_code", "h100_llama31_8b"), ("azure_conv", "h200_llama31_8b"))
        for m in ("0", "0.8")] + [(1, "azure_code load=1.5 mod=0.8 h200_llama31_8b prior=none")]
RULES = {"shipped": [], "cap1": ["--first-cap", "1"],
         "mf1": ["--measure-first", "1"],
         "mf1+rh": ["--measure-first", "1", "--release-hold"],
         "mf1+rh+cm": ["--measure-first", "1", "--release-hold", "--count-measurable"],
         "mf1+rh start": ["--measure-first", "1", "--release-hold", "--start-only"],
         "mf1+rh+cap1 start": ["--measure-first", "1", "--release-hold", "--first-cap", "1",
                               "--start-only"]}
ARGS = sys.argv[1:]
if ARGS and ARGS[0] == "--pays":
    WINDOWS, ARGS = PAYS, ARGS[1:]
if ARGS:  # only these rules
    RULES = {name: RULES[name] for name in ARGS}


def oracle(seed: int, label: str) -> tuple[float, float]:
    """The oracle's and the results file's ppo throughput of the window."""
    with open(RESULTS[seed]) as f:
        scenarios = json.load(f)["scenarios"]
    for s in scenarios:
        if s["scenario"].startswith(label + " "):
            return s["runs"]["oracle"]["throughput_tok_s"], s["runs"]["ppo"]["throughput_tok_s"]
    raise KeyError(label)


def main() -> None:
    """Print the table."""
    env = dict(os.environ, PYTHONPATH=f"{os.getcwd()}:{os.getcwd()}/scripts")
    print("| seed | window | eval ppo | " + " | ".join(RULES) + " |")
    print("|---|---|---|" + "---|" * len(RULES))
    for seed, label in WINDOWS:
        best, ppo = oracle(seed, label)
        row = [f"{ppo / best:.3f}"]
        for args in RULES.values():
            out = subprocess.run(["nice", "-n", "10", sys.executable,
                                  "docs/results/rand26/trace_all.py", str(seed), label,
                                  "--quiet", *args], env=env, capture_output=True, text=True)
            tok = float(out.stdout.strip().splitlines()[-1].split()[1])
            row.append(f"{tok / best:.3f}")
        print(f"| {seed} | {label} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""One-off (seventeenth session): the cells one ``specctl-eval`` run met and another did
not (or the reverse), and whether the policy or the reference moved: per cell, the
geometric mean over its windows of the policy's throughput, after over before, and of
the reference's (the better of the oracle and the fixed depths, as ``agents.evaluate``).

    python docs/results/warm17/lost.py BEFORE_RESULTS AFTER_RESULTS
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def reference(runs: dict) -> float:
    """The evaluator's hindsight reference of one window."""
    return max(r["throughput_tok_s"] for name, r in runs.items()
               if name == "oracle" or name.startswith(("no_spec", "static_")))


def geomean(values: list[float]) -> float:
    """Geometric mean."""
    return math.exp(sum(map(math.log, values)) / len(values))


def main(before_path: str, after_path: str) -> None:
    """Print one line per cell lost or gained."""
    before = json.loads(Path(before_path).read_text())
    after = json.loads(Path(after_path).read_text())
    b_runs = {s["scenario"]: s for s in before["scenarios"]}
    a_runs = {s["scenario"]: s for s in after["scenarios"]}
    b_cells, a_cells = before["checks"]["cells"], after["checks"]["cells"]
    for cell in sorted(b_cells):
        was, now = b_cells[cell]["met"], a_cells[cell]["met"]
        if bool(was) == bool(now):
            continue
        keys = [k for k, s in b_runs.items() if k in a_runs
                and f"{s['family']}/{s['workload']}/{s['prior_mode']}" == cell]
        policy = [a_runs[k]["runs"]["ppo"]["throughput_tok_s"]
                  / b_runs[k]["runs"]["ppo"]["throughput_tok_s"] for k in keys]
        ref = [reference(a_runs[k]["runs"]) / reference(b_runs[k]["runs"]) for k in keys]
        print(f"{'LOST' if was else 'GAINED'} {cell}: fraction "
              f"{b_cells[cell]['oracle_fraction']} -> {a_cells[cell]['oracle_fraction']}; "
              f"policy x{geomean(policy):.3f} (min {min(policy):.3f}), "
              f"reference x{geomean(ref):.3f} (max {max(ref):.3f})")


if __name__ == "__main__":
    main(*sys.argv[1:])

#!/usr/bin/env python
"""One-off (seventeenth session): ``specctl-eval`` results before / after the re-entry
warm-up, per seed.

    python docs/results/warm17/tabulate.py REFERENCE_RESULTS RESULTS [RESULTS ...]

Per results file: cells met (of those with a target), never-pays windows (the oracle off
on >= 95% of steps; the policy off on >= 90% of them), the mean oracle fraction over
cells with a target, and two numbers that do not depend on the oracle (which the warm-up
changes: it now prices coming back on, where before it could stay off for good): over
REFERENCE's never-pays windows, how many the policy is off on >= 90% of the steps; and
over every window, the policy's geometric-mean throughput against no speculation and
against static 3. Warm-ups: the policy's decisions that ran as a warm-up, summed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from agents.evaluate import NEVER_PAYS_MARGIN, speculation_pays_in_latency


def windows(results: dict) -> dict[str, dict]:
    """Scenario label -> its runs per policy."""
    return {s["scenario"]: s["runs"] for s in results["scenarios"]}


def row(path: str, reference: set[str]) -> str:
    """One markdown row."""
    results = json.loads(Path(path).read_text())
    checks = results["checks"]
    cells = checks["cells"]
    fractions = [c["oracle_fraction"] for c in cells.values() if c["met"] is not None]
    never = checks["never_pays"]
    runs = windows(results)
    ppo_off = sum(runs[w]["ppo"]["off_share"] >= 0.9 for w in reference if w in runs)
    ref_n = sum(w in runs for w in reference)
    logs_nospec, logs_static = [], []
    for by_policy in runs.values():
        ppo = by_policy["ppo"]["throughput_tok_s"]
        if ppo > 0 and by_policy["no_spec"]["throughput_tok_s"] > 0:
            logs_nospec.append(math.log(ppo / by_policy["no_spec"]["throughput_tok_s"]))
            logs_static.append(math.log(ppo / by_policy["static_3"]["throughput_tok_s"]))
    warmups = sum(by_policy["ppo"].get("warmups", 0) for by_policy in runs.values())
    return (f"| {Path(path).parent.name} | {checks['cells_met']} of {checks['cells_with_target']}"
            f" | {never['at_least_90pct_off']} of {never['scenarios']} | "
            f"{sum(fractions) / len(fractions):.4f} | {ppo_off} of {ref_n} | "
            f"{math.exp(sum(logs_nospec) / len(logs_nospec)):.4f} | "
            f"{math.exp(sum(logs_static) / len(logs_static)):.4f} | {warmups} |")


def main(reference_path: str, paths: list[str]) -> None:
    """Print the table."""
    reference = json.loads(Path(reference_path).read_text())
    # agents.evaluate's never-pays windows: the oracle off on >= 95% of the steps, no
    # speculation within NEVER_PAYS_MARGIN of the reference, no depth paying in latency
    ref_windows = {d["scenario"] for d in reference["scenarios"]
                   if d["runs"]["oracle"]["off_share"] >= 0.95
                   and (d["runs"]["no_spec"].get("oracle_fraction") or 0.0)
                   >= 1.0 - NEVER_PAYS_MARGIN
                   and not speculation_pays_in_latency(d["runs"])}
    print("| run | cells met | never-pays (own oracle) | mean oracle fraction | "
          "reference never-pays >= 90% off | geo-mean vs no spec | vs static 3 | warm-ups |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        print(row(path, ref_windows))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

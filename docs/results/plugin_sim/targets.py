#!/usr/bin/env python
"""Issue 9's targets per ``specctl-eval`` results file: cells met per target kind, the
never-pays windows (the policy off on >= 90% of the steps, per window), its mean off share
over them (per window, then averaged), the worst missed window against no speculation, and
how many windows the evaluation left out as empty (the oracle served nothing or decided
under 50 times: no window counts as a pass for being empty).

    python docs/results/plugin_sim/targets.py LABEL=RESULTS.json [LABEL=RESULTS.json ...]

Reads ``checks`` (``agents.evaluate.target_checks``) as ``specctl-eval`` wrote it.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

KINDS = (("held-out", "held-out"), ("perturbed", "perturbed profile"),
         ("none", "none profile"), ("in-distribution", "in-distribution"))


def row(label: str, path: str) -> str:
    """One markdown row of ``path``'s targets."""
    checks = json.loads(Path(path).read_text())["checks"]
    met: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for cell in checks["cells"].values():
        if cell["met"] is None:
            continue
        kind = next(k for k, prefix in KINDS if cell["target"].startswith(prefix))
        met[kind][0] += bool(cell["met"])
        met[kind][1] += 1
    never = checks["never_pays"]
    missed = [m["vs_no_spec"] for m in never["missed_windows"] if m["vs_no_spec"] is not None]
    share = never["at_least_90pct_off"] / max(never["scenarios"], 1)
    return (f"| {label} | {checks['cells_met']} of {checks['cells_with_target']} | "
            + " | ".join(f"{met[k][0]} of {met[k][1]}" for k, _ in KINDS)
            + f" | {never['at_least_90pct_off']} of {never['scenarios']} ({share:.0%}) | "
            f"{never['mean_off_share']:.3f} | "
            f"{f'{min(missed):.3f}x' if missed else '-'} | {checks['left_out_empty_windows']} |")


def main(args: list[str]) -> None:
    print("| run | cells met | held-out exact (>= 0.95, >= 0.99x best) | perturbed (>= 0.90) "
          "| no profile (>= 0.90) | in-distribution (>= 0.967) | never-pays windows "
          "(>= 90% off) | mean off share | worst missed window | windows left out as empty |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arg in args:
        label, _, path = arg.partition("=")
        print(row(label, path))


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python
"""A candidate's ``specctl-eval`` results against the shipped file's, seed by seed: cells
met per target kind, the cells gained and lost, never-pays windows (off on >= 90% of
steps), and whether the candidate counts (gains cells, loses no target kind at any seed,
never-pays >= 90% at every seed).

    python docs/results/cells19/compare.py 'BASE_{seed}/results.json' \
        'CANDIDATE_{seed}/results.json' [SEEDS]

``{seed}`` in each pattern is replaced by each seed (default 0-7).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KINDS = ("held-out", "in-distribution", "perturbed", "none")


def _kind(target: str) -> str:
    return next(k for k in KINDS if target.startswith(k))


def summary(path: str) -> dict:
    """Cells met (the set, and per kind) and never-pays counts of one results file."""
    checks = json.loads(Path(path).read_text())["checks"]
    cells = {k: c for k, c in checks["cells"].items() if c["met"] is not None}
    per_kind = {k: [0, 0] for k in KINDS}
    for cell in cells.values():
        per_kind[_kind(cell["target"])][0] += bool(cell["met"])
        per_kind[_kind(cell["target"])][1] += 1
    never = checks["never_pays"]
    return {"met": {k for k, c in cells.items() if c["met"]}, "cells": cells,
            "per_kind": per_kind, "never": (never["at_least_90pct_off"], never["scenarios"])}


def compare(base: str, candidate: str, seeds: list[int]) -> str:
    """The markdown table and the verdict."""
    out = ["| seed | cells met (shipped -> candidate) | held-out | in-distribution "
           "| perturbed | none | never-pays (shipped -> candidate) "
           "| mean oracle fraction (shipped -> candidate) | changed most | gained | lost |",
           "|---" * 11 + "|"]
    gained_total = lost_total = 0
    kind_lost = never_bad = False
    for seed in seeds:
        b = summary(base.format(seed=seed))
        c = summary(candidate.format(seed=seed))
        gained = sorted(c["met"] - b["met"])
        lost = sorted(b["met"] - c["met"])
        gained_total += len(gained)
        lost_total += len(lost)
        kinds = []
        for k in KINDS:
            (bm, n), (cm, _) = b["per_kind"][k], c["per_kind"][k]
            kinds.append(f"{bm} -> {cm} of {n}")
            kind_lost |= cm < bm
        (bn, bs), (cn, cs) = b["never"], c["never"]
        never_bad |= cn < 0.9 * cs
        keys = sorted(b["cells"])
        delta = {k: c["cells"][k]["oracle_fraction"] - b["cells"][k]["oracle_fraction"]
                 for k in keys}
        moved = max(keys, key=lambda k: abs(delta[k]))
        mean_b = sum(b["cells"][k]["oracle_fraction"] for k in keys) / len(keys)
        mean_c = sum(c["cells"][k]["oracle_fraction"] for k in keys) / len(keys)
        out.append(f"| {seed} | {len(b['met'])} -> {len(c['met'])} | " + " | ".join(kinds)
                   + f" | {bn}/{bs} ({bn / bs:.0%}) -> {cn}/{cs} ({cn / cs:.0%}) | "
                   f"{mean_b:.4f} -> {mean_c:.4f} | {moved} {delta[moved]:+.3f} | "
                   f"{', '.join(gained) or '-'} | {', '.join(lost) or '-'} |")
    counts = gained_total > lost_total and not kind_lost and not never_bad
    out += ["", f"Cells gained {gained_total}, lost {lost_total}; a target kind lost at some "
            f"seed: {kind_lost}; never-pays below 90% at some seed: {never_bad}; "
            f"counts as a candidate: {counts}."]
    return "\n".join(out)


def main(args: list[str]) -> None:
    """``BASE_PATTERN CANDIDATE_PATTERN [SEEDS]``."""
    seeds = [int(s) for s in args[2].split(",")] if len(args) > 2 else list(range(8))
    print(compare(args[0], args[1], seeds))


if __name__ == "__main__":
    main(sys.argv[1:])

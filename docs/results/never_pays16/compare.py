#!/usr/bin/env python
"""One-off: a candidate's ``specctl-eval`` run against the shipped file's, same seed.

    python docs/results/never_pays16/compare.py SHIPPED_RESULTS CANDIDATE_RESULTS

Prints cells met (and which are lost / gained), never-pays windows, the mean oracle
fraction over cells with a target, the worst missed never-pays window against no
speculation, the never-pays windows met by one only, and every cell moved by 0.005 of
the oracle or more.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summary(checks: dict) -> tuple[int, int, int, float, float | None]:
    """Cells met, never-pays windows, those >= 90% off, mean fraction, worst missed."""
    cells = checks["cells"]
    fractions = [c["oracle_fraction"] for c in cells.values() if c["met"] is not None]
    never = checks["never_pays"]
    worst = min((m["vs_no_spec"] for m in never["missed_windows"]
                 if m["vs_no_spec"] is not None), default=None)
    return (checks["cells_met"], never["scenarios"], never["at_least_90pct_off"],
            sum(fractions) / len(fractions), worst)


def main(shipped_path: str, candidate_path: str) -> None:
    """Print the comparison."""
    ship = json.loads(Path(shipped_path).read_text())["checks"]
    cand = json.loads(Path(candidate_path).read_text())["checks"]
    for name, checks in (("shipped", ship), ("candidate", cand)):
        met, windows, off, mean, worst = summary(checks)
        print(f"{name}: cells {met}, never-pays {off} of {windows}, mean {mean:.4f}, "
              f"worst missed {worst}")
    met = {k for k, c in ship["cells"].items() if c["met"]}
    met_c = {k for k, c in cand["cells"].items() if c["met"]}
    print("lost:", sorted(met - met_c) or "none", "gained:", sorted(met_c - met) or "none")
    missed = {m["scenario"]: m["vs_no_spec"] for m in ship["never_pays"]["missed_windows"]}
    missed_c = {m["scenario"]: m["vs_no_spec"] for m in cand["never_pays"]["missed_windows"]}
    for label in sorted(set(missed) - set(missed_c)):
        print(f"  never-pays window now met: {label} (was {missed[label]}x no spec)")
    for label in sorted(set(missed_c) - set(missed)):
        print(f"  never-pays window now missed: {label} ({missed_c[label]}x no spec)")
    for key, c in sorted(ship["cells"].items()):
        new = cand["cells"][key]["oracle_fraction"]
        if abs(new - c["oracle_fraction"]) >= 0.005:
            print(f"  moved {key}: {c['oracle_fraction']:.4f} -> {new:.4f} ({c['target']})")


if __name__ == "__main__":
    main(*sys.argv[1:])

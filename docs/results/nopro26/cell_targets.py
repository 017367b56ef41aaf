#!/usr/bin/env python
"""Per seed, issue 9's cells of two ``specctl-eval`` result sets compared: cells met by each,
the cells whose target status changed, and every cell (targeted or report-only) whose
oracle fraction moved by more than ``--tol`` (default 0.01) either way.

    python docs/results/nopro26/cell_targets.py '/tmp/e25/cd2_s{seed}' '/tmp/n26/d15_s{seed}'
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cells(path: Path) -> dict:
    """The results' ``checks`` cells (name -> dict)."""
    return json.loads((path / "results.json").read_text())["checks"]["cells"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--tol", type=float, default=0.01)
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.seeds.split("-"))
    drops = 0
    for seed in range(lo, hi + 1):
        b_path, a_path = Path(args.before.format(seed=seed)), Path(args.after.format(seed=seed))
        if not (a_path / "results.json").exists():
            print(f"seed {seed}: no results at {a_path}")
            continue
        before, after = cells(b_path), cells(a_path)
        met_b = sum(bool(c["met"]) for c in before.values())
        met_a = sum(bool(c["met"]) for c in after.values())
        print(f"seed {seed}: cells met {met_b} -> {met_a}")
        for name in sorted(before):
            x, y = before[name], after.get(name)
            if y is None:
                continue
            delta = y["oracle_fraction"] - x["oracle_fraction"]
            status = "" if x["met"] == y["met"] else f" met {x['met']} -> {y['met']}"
            if abs(delta) > args.tol or status:
                drops += delta < -args.tol
                print(f"  {name:<45} {x['oracle_fraction']:.4f} -> {y['oracle_fraction']:.4f}"
                      f" ({delta:+.4f}){status}")
    print(f"cells whose oracle fraction dropped by more than {args.tol}: {drops}")


if __name__ == "__main__":
    main()

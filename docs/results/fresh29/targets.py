#!/usr/bin/env python
"""The shipped file's issue-9 targets per seed, as the README's targets table counts them
(met of targeted, per target class, never-pays windows off on >= 90% of their windows),
from one ``specctl-eval`` result set.

    PYTHONPATH=docs/results/startprobe28 python docs/results/fresh29/targets.py \\
        '/tmp/s28/base_s{seed}' --seeds 32-47
"""

from __future__ import annotations

import argparse

from compare import TARGETS, load, seed_range


def row(results: dict) -> list[str]:
    """``met of targeted`` for every cell, each target class, and the never-pays windows."""
    checks = results["checks"]
    cells = [c for c in checks["cells"].values() if c["met"] is not None]
    out = [f"{checks['cells_met']} of {checks['cells_with_target']}"]
    for _, prefix in TARGETS:
        mine = [c for c in cells if c["target"].startswith(prefix)]
        out.append(f"{sum(bool(c['met']) for c in mine)} of {len(mine)}")
    never = checks["never_pays"]
    out.append(f"{never['at_least_90pct_off']} of {never['scenarios']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a result folder pattern with {seed}")
    parser.add_argument("--seeds", default="0-7")
    args = parser.parse_args()
    names = ["cells met", *(short for short, _ in TARGETS), "never-pays off >= 90%"]
    print("| seed | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for seed in seed_range(args.seeds):
        print(f"| {seed} | " + " | ".join(row(load(args.results, seed))) + " |")


if __name__ == "__main__":
    main()

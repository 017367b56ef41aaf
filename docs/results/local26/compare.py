"""Per ``specctl-eval`` cell, the PPO result of a candidate against the shipped file's
(same seed), split by the cell's prior mode: how many are identical (every PPO number
equal), and the no-profile cells' oracle fractions and off shares before and after.

    python docs/results/local26/compare.py SHIPPED/results.json CANDIDATE/results.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def _cells(path: str) -> dict:
    return {d["scenario"]: d for d in json.load(open(path))["scenarios"]}


def main(before_path: str, after_path: str) -> None:
    before, after = _cells(before_path), _cells(after_path)
    same, moved = defaultdict(int), defaultdict(list)
    for name, cell in before.items():
        mode = cell["prior_mode"]
        x, y = cell["runs"]["ppo"], after[name]["runs"]["ppo"]
        if x == y:
            same[mode] += 1
        else:
            moved[mode].append((y["oracle_fraction"] / max(x["oracle_fraction"], 1e-9), name,
                                x["oracle_fraction"], y["oracle_fraction"],
                                x.get("off_share"), y.get("off_share")))
    for mode in sorted(set(same) | set(moved)):
        rows = sorted(moved[mode])
        print(f"prior={mode}: {same[mode]} identical, {len(rows)} changed")
        if rows:
            ratios = [r[0] for r in rows]
            print(f"  changed: mean ratio {sum(ratios) / len(ratios):.4f}, "
                  f"min {min(ratios):.3f}, max {max(ratios):.3f}, "
                  f"{sum(r > 1.02 for r in ratios)} up > 2%, "
                  f"{sum(r < 0.98 for r in ratios)} down > 2%")
        for ratio, name, was, now, off_was, off_now in rows:
            if abs(ratio - 1) > 0.02:
                print(f"  {ratio:.3f} {name:<70} {was:.3f} -> {now:.3f} "
                      f"off {off_was:.2f} -> {off_now:.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

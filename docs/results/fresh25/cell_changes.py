"""The cells whose PPO oracle fraction moved by more than 2% between two ``specctl-eval``
results (same seed), worst first, with the off share before and after.

    python docs/results/fresh25/cell_changes.py BEFORE/results.json AFTER/results.json
"""

from __future__ import annotations

import json
import sys


def _runs(path: str) -> dict:
    return {d["scenario"]: d["runs"] for d in json.load(open(path))["scenarios"]}


def main(before_path: str, after_path: str) -> None:
    before, after = _runs(before_path), _runs(after_path)
    rows = []
    for name, runs in before.items():
        if name not in after:
            continue
        x, y = runs["ppo"], after[name]["ppo"]
        ratio = y["oracle_fraction"] / max(x["oracle_fraction"], 1e-9)
        if abs(ratio - 1) > 0.02:
            rows.append((ratio, name, x["oracle_fraction"], y["oracle_fraction"],
                         x.get("off_share"), y.get("off_share")))
    rows.sort()
    for ratio, name, was, now, off_was, off_now in rows:
        print(f"{ratio:.3f} {name:<70} {was:.3f} -> {now:.3f} off {off_was:.2f} -> {off_now:.2f}")
    print(f"{len(rows)} cells moved > 2%, {sum(r[0] > 1 for r in rows)} of them up")


if __name__ == "__main__":
    main(*sys.argv[1:3])

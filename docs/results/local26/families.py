"""Per server family, the no-profile cells' mean PPO oracle fraction and off share: the
shipped file and each candidate, per seed (``specctl-eval`` results files).

    python docs/results/local26/families.py SEED:LABEL=RESULTS.json ...
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(args: list[str]) -> None:
    table: dict = defaultdict(dict)
    labels = []
    for arg in args:
        key, _, path = arg.partition("=")
        labels.append(key)
        with open(path) as handle:
            cells = json.load(handle)["scenarios"]
        for cell in cells:
            if cell["prior_mode"] != "none":
                continue
            ppo = cell["runs"]["ppo"]
            table[cell["family"]].setdefault(key, []).append(
                (ppo["oracle_fraction"], ppo["off_share"]))
    print("family".ljust(18) + "".join(f"{label:>22}" for label in labels))
    for family in sorted(table):
        row = family.ljust(18)
        for label in labels:
            runs = table[family].get(label, [])
            if runs:
                frac = sum(r[0] for r in runs) / len(runs)
                off = sum(r[1] for r in runs) / len(runs)
                row += f"{frac:>14.3f} ({off:.2f})"
            else:
                row += " " * 22
        print(row)


if __name__ == "__main__":
    main(sys.argv[1:])

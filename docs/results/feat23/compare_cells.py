"""Two ``specctl-eval`` results cell by cell: every cell and policy whose throughput differs
by more than ``TOL`` (relative) between them, and issue 9's targets met in each (per cell:
``targets.py``'s rows for both).

    python docs/results/feat23/compare_cells.py A=RESULTS.json B=RESULTS.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOL = 1e-3


def main(first: str, second: str) -> None:
    """Print the cells where ppo (or any policy both results ran) moved by more than TOL."""
    (la, pa), (lb, pb) = (item.partition("=")[::2] for item in (first, second))
    a, b = (json.loads(Path(p).read_text())["cells"] for p in (pa, pb))
    print(f"| cell | policy | {la} tok/s | {lb} tok/s | ratio | {la} off | {lb} off |")
    print("|---|---|---|---|---|---|---|")
    same = 0
    for name in sorted(set(a) & set(b)):
        for policy in sorted(set(a[name]) & set(b[name])):
            x, y = a[name][policy], b[name][policy]
            if not (isinstance(x, dict) and "throughput_tok_s" in x):
                continue
            ratio = y["throughput_tok_s"] / max(x["throughput_tok_s"], 1e-9)
            if abs(ratio - 1.0) <= TOL:
                same += 1
                continue
            print(f"| {name} | {policy} | {x['throughput_tok_s']:,.1f} "
                  f"| {y['throughput_tok_s']:,.1f} | {ratio:.4f} "
                  f"| {x.get('off_share', float('nan')):.3f} "
                  f"| {y.get('off_share', float('nan')):.3f} |")
    print(f"\n{same} cell-policy pairs within {TOL:.1%}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

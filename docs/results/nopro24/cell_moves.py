"""Issue 9's cells whose PPO oracle fraction moved between two ``specctl-eval`` results
(by more than 0.0005), with the targets met or lost.

    python docs/results/nopro24/cell_moves.py BASE/results.json OTHER/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(base_path: str, other_path: str) -> None:
    """Print one line per moved cell: base -> other, and LOST / GAINED where the target
    changed."""
    base = json.loads(Path(base_path).read_text())["checks"]["cells"]
    other = json.loads(Path(other_path).read_text())["checks"]["cells"]
    for name in sorted(base):
        a, b = base[name], other[name]
        if abs(a["oracle_fraction"] - b["oracle_fraction"]) <= 0.0005 and a["met"] == b["met"]:
            continue
        change = {(True, False): " LOST", (False, True): " GAINED"}.get((a["met"], b["met"]), "")
        print(f"- {name}: {a['oracle_fraction']:.3f} -> {b['oracle_fraction']:.3f}{change}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

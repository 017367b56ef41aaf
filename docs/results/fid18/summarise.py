#!/usr/bin/env python
"""One-off (eighteenth session): per run set and variant, from ``compare.py`` outputs
``DIR/<set>_<variant>/fidelity_<model>.json``: cells within 10% on throughput and TPOT,
mean |TPOT error| over every cell and over the ``ppo`` cells.

    python docs/results/fid18/summarise.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

SETS = ("r31_36", "r37_39", "r40_43", "r44_45")
VARIANTS = (("before", "every depth, no hold, no warm-up (before)"),
            ("all_warm", "every depth, no hold, warm-up (warm17)"),
            ("served_nowarm", "server's steps, no hold, no warm-up"),
            ("served_warm", "server's steps, no hold, warm-up"),
            ("hold_nowarm", "server's steps, hold, no warm-up"),
            ("hold_warm", "server's steps, hold, warm-up"))


def main(folder: str) -> None:
    """Print one markdown row per (run set, model, variant)."""
    root = Path(folder)
    print("| runs | model | variant | within 10% | mean abs TPOT error | ppo cells: mean abs "
          "(signed) | ppo cells |")
    print("|---|---|---|---|---|---|---|")
    for s in SETS:
        for model in ("moe", "dense"):
            for key, label in VARIANTS:
                path = root / f"{s}_{key}" / f"fidelity_{model}.json"
                if not path.exists():
                    continue
                cells = json.loads(path.read_text())["cells"]
                within = sum(abs(c["tok_s_error"]) <= 0.1 and abs(c["tpot_error"]) <= 0.1
                             for c in cells)
                err = np.array([c["tpot_error"] for c in cells])
                ppo = np.array([c["tpot_error"] for c in cells if c["policy"] == "ppo"])
                ppo_text = (f"{100 * np.abs(ppo).mean():.2f}% ({100 * ppo.mean():+.2f}%)"
                            if ppo.size else "-")
                print(f"| {s[1:].replace('_', '-')} | {model} | {label} | {within} of "
                      f"{len(cells)} | {100 * np.abs(err).mean():.2f}% | {ppo_text} | "
                      f"{ppo.size} |")


if __name__ == "__main__":
    main(sys.argv[1])

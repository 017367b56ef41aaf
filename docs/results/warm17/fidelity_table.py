#!/usr/bin/env python
"""One-off (seventeenth session): per-cell fidelity before (``--no-reentry-warmup``) and
after (the warm-up simulated) from two ``compare.py`` outputs of the same runs.

    python docs/results/warm17/fidelity_table.py BEFORE_DIR AFTER_DIR [MODEL]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    """Print one markdown row per cell: errors before and after, simulated warm-ups."""
    before_dir, after_dir = Path(sys.argv[1]), Path(sys.argv[2])
    model = sys.argv[3] if len(sys.argv) > 3 else "moe"
    before = json.loads((before_dir / f"fidelity_{model}.json").read_text())["cells"]
    after = json.loads((after_dir / f"fidelity_{model}.json").read_text())["cells"]
    print("| cell | source | TPOT ms measured | before | after | TPOT error before | after "
          "| tok/s error before | after | warm-ups sim. |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, a in zip(before, after, strict=True):
        assert (b["cell"], b["source"]) == (a["cell"], a["source"])
        print(f"| {a['cell']} | {a['source'].split(':')[0]} | {a['measured_tpot_ms']:.1f} | "
              f"{b['simulated_tpot_ms']:.2f} | {a['simulated_tpot_ms']:.2f} | "
              f"{100 * b['tpot_error']:+.1f}% | {100 * a['tpot_error']:+.1f}% | "
              f"{100 * b['tok_s_error']:+.1f}% | {100 * a['tok_s_error']:+.1f}% | "
              f"{b['simulated_warmups']} / {a['simulated_warmups']} |")


if __name__ == "__main__":
    main()

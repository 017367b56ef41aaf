"""Every targeted cell of the held-out seeds 8-15 (``heldout_run.sh``'s results): the
shipped file's oracle fraction per seed, the file before's after the slash where they
differ, a miss marked ``*``; cells without a target (swapped profiles) are left out, as is
a cell whose windows were all left out as empty (``-``). Last row: the windows each seed
left out as empty (counted, never passed).

    python docs/results/nopro26/heldout_percell.py /tmp/h26 \\
        > docs/results/nopro26/heldout_percell.md

Other runs: ``heldout_percell.py FOLDER FIRST-LAST SHIPPED BEFORE`` (the results of seed
``s`` in ``FOLDER/SHIPPED_s<s>`` and ``FOLDER/BEFORE_s<s>``); the twenty-seventh
session's held-out seeds: ``heldout_percell.py /tmp/s27b 16-23 cand base``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEEDS = range(8, 16)
#: the shipped file (baef2897) and the file before (c66f698d), as heldout_run.sh named them
SHIPPED, BEFORE = "cand", "ship"


def checks(folder: Path, name: str, seed: int) -> dict:
    return json.loads((folder / f"{name}_s{seed}" / "results.json").read_text())["checks"]


def main() -> None:
    folder = Path(sys.argv[1])
    seeds, shipped_name, before_name = SEEDS, SHIPPED, BEFORE
    if len(sys.argv) > 2:
        lo, hi = (int(x) for x in sys.argv[2].split("-"))
        seeds, shipped_name, before_name = range(lo, hi + 1), sys.argv[3], sys.argv[4]
    shipped = {s: checks(folder, shipped_name, s) for s in seeds}
    before = {s: checks(folder, before_name, s) for s in seeds}
    names = sorted({n for c in shipped.values() for n, cell in c["cells"].items()
                    if cell.get("met") is not None})
    print("| cell | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("|---|" + "---|" * len(seeds))
    for name in names:
        row = []
        for s in seeds:
            cell = shipped[s]["cells"].get(name)
            if cell is None or cell.get("met") is None:
                row.append("-")
                continue
            text = f"{cell['oracle_fraction']:.3f}" + ("" if cell["met"] else "*")
            old = before[s]["cells"].get(name, {})
            if old.get("oracle_fraction") is not None and (
                    round(old["oracle_fraction"], 3) != round(cell["oracle_fraction"], 3)):
                text += f" / {old['oracle_fraction']:.3f}" + ("" if old["met"] else "*")
            row.append(text)
        print(f"| {name} | " + " | ".join(row) + " |")
    print("| windows left out as empty | "
          + " | ".join(str(shipped[s]["left_out_empty_windows"]) for s in seeds) + " |")


if __name__ == "__main__":
    main()

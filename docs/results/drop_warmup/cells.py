"""Per cell (server family / workload / handed profile), two ``specctl-eval`` results of
one seed: the cells whose target status differs or whose oracle fraction moved by
>= 0.005, and each run's windows left out as empty.

    PYTHONPATH=$PWD python docs/results/drop_warmup/cells.py REFERENCE/results.json \\
        CANDIDATE/results.json

Reads ``checks.cells`` (``agents.evaluate.target_checks``) and ``left_out_empty``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MOVED = 0.005


def main(reference_path: str, candidate_path: str) -> None:
    reference, candidate = (json.loads(Path(p).read_text())
                            for p in (reference_path, candidate_path))
    before, after = reference["checks"]["cells"], candidate["checks"]["cells"]
    print(f"windows left out as empty: {len(reference['left_out_empty'])} / "
          f"{len(candidate['left_out_empty'])}")
    print(f"cells met: {reference['checks']['cells_met']} / {candidate['checks']['cells_met']}"
          f" of {candidate['checks']['cells_with_target']}")
    print("| cell | target | oracle fraction before | after | met before | after |")
    print("|---|---|---|---|---|---|")
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if old is None or new is None:
            print(f"| {key} | only in {'candidate' if old is None else 'reference'} | | | | |")
            continue
        moved = abs(new["oracle_fraction"] - old["oracle_fraction"])
        if old["met"] != new["met"] or moved >= MOVED:
            print(f"| {key} | {new['target']} | {old['oracle_fraction']:.3f} "
                  f"| {new['oracle_fraction']:.3f} | {old['met']} | {new['met']} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""Whether two ``specctl-eval`` results files agree in everything but the policy's path
(every workload, cell, scenario, sweep, check and policy map), and if not, which top-level
keys differ.

    python docs/results/clip20/identical.py REFERENCE/results.json CANDIDATE/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(reference_path: str, candidate_path: str) -> None:
    reference, candidate = (json.loads(Path(p).read_text())
                            for p in (reference_path, candidate_path))
    keys = sorted((set(reference) | set(candidate)) - {"policy"})
    differing = [k for k in keys if reference.get(k) != candidate.get(k)]
    print(f"{candidate_path}: " + ("identical to the reference but for the policy's path"
                                   if not differing else f"differs in {differing}"))


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""The twenty-sixth session's candidate: the shipped file (``c66f698d``, every array and
field) with the cost probe's ``ProbeSpec.cost_doubt`` (2 shipped) set to the number given
(default 1.5: no cost probe where depth 3 would not pay even at two thirds of its predicted
price). The cost probe runs only without a cost profile, so exact, perturbed and swapped
cells cannot move. Writes ``policy_<sha8>.npz`` here and prints its sha (1.5:
``e3c2b6c6``; 2 gives the shipped ``c66f698d`` back, byte for byte).

    PYTHONPATH=$PWD python docs/results/nopro26/make_policy.py 1.5
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "costprobe25/policy_c66f698d.npz"


def candidate(cost_doubt: float, source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with ``cost_doubt``."""
    policy = ExportedPolicy.load(source)
    return dataclasses.replace(policy, probe=dataclasses.replace(policy.probe,
                                                                 cost_doubt=cost_doubt))


if __name__ == "__main__":
    doubt = float(sys.argv[1]) if len(sys.argv) > 1 else 1.5
    path = candidate(doubt).save_named_by_hash(HERE)
    print("nopro26 cost_doubt", doubt, hashlib.sha256(path.read_bytes()).hexdigest(), path.name)

"""The twenty-sixth session's candidates: the shipped file (``c66f698d``, every array and
field) with, for a stream without a cost profile only, the cost probe's
``ProbeSpec.cost_doubt`` (2 shipped) and the off probe's ``ProbeSpec.off_unprofiled`` (1
shipped: ``off_share`` 0.2 as with a profile) set to the numbers given. Both act only
without a profile (the cost probe never runs with one), so exact, perturbed and swapped
cells cannot move. Writes ``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD python docs/results/nopro26/make_policy.py 1.5       # e3c2b6c6
    PYTHONPATH=$PWD python docs/results/nopro26/make_policy.py 2 0.5
    PYTHONPATH=$PWD python docs/results/nopro26/make_policy.py 1.5 0.5

(``2 1`` gives the shipped ``c66f698d`` back, byte for byte.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "costprobe25/policy_c66f698d.npz"


def candidate(cost_doubt: float, off_unprofiled: float = 1.0,
              source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with ``cost_doubt`` and ``off_unprofiled``."""
    policy = ExportedPolicy.load(source)
    probe = dataclasses.replace(policy.probe, cost_doubt=cost_doubt,
                                off_unprofiled=off_unprofiled)
    return dataclasses.replace(policy, probe=probe)


if __name__ == "__main__":
    doubt = float(sys.argv[1]) if len(sys.argv) > 1 else 1.5
    off = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    path = candidate(doubt, off).save_named_by_hash(HERE)
    print("nopro26 cost_doubt", doubt, "off_unprofiled", off,
          hashlib.sha256(path.read_bytes()).hexdigest(), path.name)

"""The twenty-seventh session's candidate: the shipped file (``baef2897``, every array and
field) with the start rule on, ``ProbeSpec.start_off`` set to the number given (6 by
default): in a stream without a cost profile, while no speculative depth holds a cost
sample, once one speculative step decided has run, every decision is off until a
speculative sample arrives, for at most that many decisions; no decision of that phase is
held by the plugin's switch hold. It acts only without a profile, so exact, perturbed and
swapped cells cannot move. Writes ``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD python docs/results/start27/make_policy.py [START_OFF]

(``0`` gives the shipped ``baef2897`` back, byte for byte.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "nopro26/policy_baef2897.npz"


def candidate(start_off: int, source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with ``start_off``."""
    policy = ExportedPolicy.load(source)
    return dataclasses.replace(policy, probe=dataclasses.replace(policy.probe,
                                                                 start_off=start_off))


if __name__ == "__main__":
    start_off = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    out = HERE if start_off else Path("/tmp")
    path = candidate(start_off).save_named_by_hash(out)
    print("start27 start_off", start_off, hashlib.sha256(path.read_bytes()).hexdigest(),
          path.name)

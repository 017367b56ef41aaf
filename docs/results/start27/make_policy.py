"""The twenty-seventh session's candidate: the shipped file (``baef2897``, every array and
field) with the start rule on, ``ProbeSpec.start_off`` set to the number given (6 by
default): in a stream without a cost profile, while no speculative depth holds a cost
sample, once one speculative step decided has run, every decision is off until a
speculative sample arrives, for at most that many decisions; no decision of that phase is
held by the plugin's switch hold. It acts only without a profile, so exact, perturbed and
swapped cells cannot move. Writes ``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD python docs/results/start27/make_policy.py [START_OFF [START_DEPTH]]

(``0`` gives the shipped ``baef2897`` back, byte for byte. ``START_DEPTH``, 0 by default
(``4c5ff8da``), sets ``ProbeSpec.start_depth``: the rule turns off only after an unmeasured
step at that depth or deeper; shallower ones run and are held as without the rule.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "nopro26/policy_baef2897.npz"


def candidate(start_off: int, start_depth: int = 0, source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with ``start_off`` and ``start_depth``."""
    policy = ExportedPolicy.load(source)
    return dataclasses.replace(policy, probe=dataclasses.replace(
        policy.probe, start_off=start_off, start_depth=start_depth))


if __name__ == "__main__":
    start_off = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    start_depth = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    out = HERE if start_off else Path("/tmp")
    path = candidate(start_off, start_depth).save_named_by_hash(out)
    print("start27 start_off", start_off, "start_depth", start_depth,
          hashlib.sha256(path.read_bytes()).hexdigest(), path.name)

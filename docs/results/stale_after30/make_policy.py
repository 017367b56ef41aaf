"""The thirtieth session's candidates: the shipped file (``3ff099d0``: its weights, features,
guard and every other probe field) with ``ProbeSpec.stale_after`` set, so that the
acceptance probe measures again sooner after the last measured acceptance. Writes
``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD python docs/results/stale_after30/make_policy.py 300
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[2] / "controller/data/default_policy.npz"


def candidate(stale_after: int, source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with ``ProbeSpec.stale_after`` = ``stale_after``."""
    policy = ExportedPolicy.load(source)
    return dataclasses.replace(policy, probe=dataclasses.replace(policy.probe,
                                                                 stale_after=stale_after))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stale_after", type=int, help="decode steps, >= 0")
    path = candidate(parser.parse_args().stale_after).save_named_by_hash(HERE)
    print("stale_after30", hashlib.sha256(path.read_bytes()).hexdigest(), path.name)

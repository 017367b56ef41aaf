"""The thirtieth session's candidate: the shipped file (``3ff099d0``: its weights, features,
guard and every other probe field) with ``ProbeSpec.stale_batch_ratio`` set, so that the
acceptance probe also measures again once the batch has grown this many times past the
batch of the last step that measured acceptance. Writes ``policy_<sha8>.npz`` here and
prints its sha.

    PYTHONPATH=$PWD python docs/results/batch_stale30/make_policy.py 4
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[2] / "controller/data/default_policy.npz"


def candidate(ratio: float, source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with ``ProbeSpec.stale_batch_ratio`` = ``ratio``."""
    policy = ExportedPolicy.load(source)
    return dataclasses.replace(policy, probe=dataclasses.replace(policy.probe,
                                                                 stale_batch_ratio=ratio))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ratio", type=float, help="0 (off) or a number above 1")
    path = candidate(parser.parse_args().ratio).save_named_by_hash(HERE)
    print("batch_stale30", hashlib.sha256(path.read_bytes()).hexdigest(), path.name)

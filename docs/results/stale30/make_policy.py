"""The thirtieth session's candidates: the shipped file (``3ff099d0``: its weights, probes,
guard and every other feature field) with ``FeatureSpec.accept_stale_weight`` set, so that
requests whose draft KV is stale (``StepRecord.stale_drafts``) count less, or not at all, in
the acceptance estimate. Writes ``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD python docs/results/stale30/make_policy.py 0.0
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[2] / "controller/data/default_policy.npz"


def candidate(weight: float, source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with ``accept_stale_weight`` = ``weight``."""
    policy = ExportedPolicy.load(source)
    spec = dataclasses.replace(policy.feature_spec, accept_stale_weight=weight)
    return dataclasses.replace(policy, feature_spec=spec)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weight", type=float, help="accept_stale_weight, in [0, 1]")
    path = candidate(parser.parse_args().weight).save_named_by_hash(HERE)
    print("stale30", hashlib.sha256(path.read_bytes()).hexdigest(), path.name)

"""The twenty-sixth session's local26 candidate: the shipped file (``c66f698d``: its
weights, guard, probes and every other feature field) with the local measured-cost
correction run without a cost profile (``FeatureSpec.latency_local_unprofiled``: its base
the latency regression's own prediction). With a profile the field does nothing. Writes
``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD python docs/results/local26/make_policy.py [samples, default 2.0]
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[2] / "controller/data/default_policy.npz"


def candidate(samples: float = 2.0, source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with ``latency_local_unprofiled`` = ``samples``."""
    policy = ExportedPolicy.load(source)
    spec = dataclasses.replace(policy.feature_spec, latency_local_unprofiled=samples)
    return dataclasses.replace(policy, feature_spec=spec)


if __name__ == "__main__":
    samples = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    path = candidate(samples).save_named_by_hash(HERE)
    print("local26", samples, hashlib.sha256(path.read_bytes()).hexdigest(), path.name)

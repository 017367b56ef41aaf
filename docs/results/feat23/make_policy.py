"""The twenty-third session's feature candidate as a servable file: the shipped file
(``65d4fb99`` = ``5c3d9060`` + ``latency_off_ceiling`` 0.1, its weights, guard and probe)
with ``FeatureSpec.latency_off_ceiling_batch`` 24 (the ceiling bounds off's price only at
batch >= 24). Writes ``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD python docs/results/feat23/make_policy.py
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[2] / "controller/data/default_policy.npz"  # 65d4fb99
#: The batch size from which the ceiling applies (the grid value 24: README.md here).
CEILING_BATCH = 24.0


def main() -> None:
    """Write the candidate next to this script and print its sha256."""
    shipped = ExportedPolicy.load(SHIPPED)
    spec = dataclasses.replace(shipped.feature_spec, latency_off_ceiling_batch=CEILING_BATCH)
    policy = dataclasses.replace(shipped, feature_spec=spec)
    scratch = HERE / "feat23.npz"
    policy.save(scratch)
    sha = hashlib.sha256(scratch.read_bytes()).hexdigest()
    path = scratch.rename(HERE / f"policy_{sha[:8]}.npz")
    print("feat23", sha, path.name)


if __name__ == "__main__":
    main()

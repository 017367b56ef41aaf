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
SHIPPED = HERE.parent / "gpu22/policy_65d4fb99.npz"  # shipped since the twenty-third session
#: The batch size from which the ceiling applies (the grid value 24: README.md here).
CEILING_BATCH = 24.0


def main() -> None:
    """Write the candidate next to this script and print its sha256."""
    shipped = ExportedPolicy.load(SHIPPED)
    spec = dataclasses.replace(shipped.feature_spec, latency_off_ceiling_batch=CEILING_BATCH)
    path = dataclasses.replace(shipped, feature_spec=spec).save_named_by_hash(HERE)
    print("feat23", hashlib.sha256(path.read_bytes()).hexdigest(), path.name)


if __name__ == "__main__":
    main()

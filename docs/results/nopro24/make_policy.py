"""The twenty-fourth session's no-profile candidates as servable files: the shipped file
(``3f47437c``: its weights, features, guard and probe) with ``ProbeSpec.start_records``
set (the decisions made before a no-profile stream's first decode records are folded
speculate at the probe's depth instead of going off) and, optionally,
``FeatureSpec.speculation_prior_fraction`` (the no-profile prior's cost of speculating,
a fraction of off's step; the shipped 0.05). Writes ``policy_<sha8>.npz`` here and prints
its sha.

    PYTHONPATH=$PWD python docs/results/nopro24/make_policy.py [START_RECORDS [FRACTION]]
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "offceil24/policy_3f47437c.npz"  # shipped since the 24th session
#: Decode records a stream's start probes for: the plugin's hold (min_switch_steps 4), so
#: the first decisions the policy makes with measurements are its own.
START_RECORDS = 4


def main(argv: list[str]) -> None:
    """Write the candidate next to this script and print its sha256."""
    start = int(argv[0]) if argv else START_RECORDS
    shipped = ExportedPolicy.load(SHIPPED)
    probe = dataclasses.replace(shipped.probe, start_records=start)
    spec = shipped.feature_spec
    if len(argv) > 1:
        spec = dataclasses.replace(spec, speculation_prior_fraction=float(argv[1]))
    policy = dataclasses.replace(shipped, probe=probe, feature_spec=spec)
    path = policy.save_named_by_hash(HERE)
    print("nopro24", start, spec.speculation_prior_fraction,
          hashlib.sha256(path.read_bytes()).hexdigest(), path.name)


if __name__ == "__main__":
    main(sys.argv[1:])

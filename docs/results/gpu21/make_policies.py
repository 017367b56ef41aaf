"""The policy files of runs 65-67 (twenty-first session, the dense model at acceptance 3.0):

* ``adm``: the shipped policy with ``FeatureSpec.latency_drop_before_prefill`` on: the
  latency of a decode step whose next record is a prefill (it carries that prefill's
  launch under SGLang's overlap scheduler) left out of the cost estimates; the network,
  guard and probe unchanged.
* ``m20``: the shipped policy with a stricter goodput guard, margin -0.2 (shipped -0.02):
  a depth runs only where the features price it at least 1.2x off's goodput; the network,
  features and acceptance probe unchanged.
* ``m20e``: that, and ``max_profile_error`` 1.0 (the guard acts however far the measured
  costs sit from the handed profile's; in runs 61-64 they sat 1.3-1.75x above it at
  batch >= 24, near the shipped 0.5's edge).
* ``cap24``: a hand-written reference, not a product candidate: depth 3 below 24 running
  requests, off from 24 (a linear layer on the observation's ``log_batch_size`` alone,
  no guard, no probe). Runs 57-64 measured depth 3 paying below 24 and losing above at
  12 req/s on this server; the rule says how much a policy that knew that would gain.

Writes ``policy_<sha8>.npz`` here and prints label, sha and what changed.

    PYTHONPATH=$PWD python docs/results/gpu21/make_policies.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import numpy as np

from controller.policy_file import ExportedPolicy
from env.features import FeatureSpec
from env.guard import NO_GUARD
from env.probe import NO_PROBE

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "off_probe/policy_3dd256a8.npz"  # the shipped file's kept copy
#: label -> the shipped file's guard fields changed
GUARDS = {"m20": {"margin": -0.2}, "m20e": {"margin": -0.2, "max_profile_error": 1.0}}
#: cap24: the observation's log_batch_size where depth 3 gives way to off (between the
#: batch grid's 16 and 24, so rows 1-16 run depth 3 and rows 24 and up run off).
CAP_BATCH = 20
SHARPNESS = 100.0


def cap_policy(spec: FeatureSpec) -> ExportedPolicy:
    """Depth 3 below the grid row 24, off from it: logits ``x @ W + b`` with only the
    ``log_batch_size`` column of ``W`` set."""
    weights = np.zeros((spec.size, spec.max_depth + 1), np.float32)
    threshold = math.log1p(CAP_BATCH) / math.log1p(spec.batch_scale)
    column = spec.names().index("log_batch_size")
    weights[column, 0], weights[column, 3] = SHARPNESS, -SHARPNESS
    bias = np.full(spec.max_depth + 1, -1e3, np.float32)
    bias[0], bias[3] = -SHARPNESS * threshold, SHARPNESS * threshold
    return ExportedPolicy([weights], [bias], list(range(spec.max_depth + 1)), spec,
                          name="cap24", probe=NO_PROBE, guard=NO_GUARD)


def save(policy: ExportedPolicy, label: str) -> Path:
    """``policy`` as ``policy_<sha8>.npz`` here."""
    scratch = HERE / f"{label}.npz"
    policy.save(scratch)
    sha = hashlib.sha256(scratch.read_bytes()).hexdigest()
    path = scratch.rename(HERE / f"policy_{sha[:8]}.npz")
    print(label, sha, path.name)
    return path


def main() -> None:
    shipped = ExportedPolicy.load(SHIPPED)
    spec = dataclasses.replace(shipped.feature_spec, latency_drop_before_prefill=True)
    save(dataclasses.replace(shipped, feature_spec=spec, name="ppo_adm"), "adm")
    for label, fields in GUARDS.items():
        guard = dataclasses.replace(shipped.guard, **fields)
        save(dataclasses.replace(shipped, guard=guard, name=f"ppo_{label}"), label)
    save(cap_policy(shipped.feature_spec), "cap24")


if __name__ == "__main__":
    main()

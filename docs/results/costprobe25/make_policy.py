"""The twenty-fifth session's candidate: the shipped file (``3f47437c``: its weights, guard,
the acceptance and off probes, every other feature field) for a stream without a cost
profile: ``FeatureSpec.latency_model`` 2 (model 3 is model 2 with a profile, so profiled
streams are unchanged) with ``token_prior_fraction`` 0 (model 2's no-profile prior then
prices every depth as model 1's did before anything is measured: the stream's first
decisions unchanged), and the cost probe at depth 3 (``ProbeSpec.cost_depth`` 3,
``cost_share`` 0.2, ``cost_doubt`` 2: no profile only). Writes ``policy_<sha8>.npz`` here
and prints its sha (``cost_doubt`` 0 gives ``21229d3c``, the file evaluated first).

    PYTHONPATH=$PWD python docs/results/costprobe25/make_policy.py
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "offceil24/policy_3f47437c.npz"


def candidate(source: Path = SHIPPED) -> ExportedPolicy:
    """``source`` with the no-profile changes above."""
    policy = ExportedPolicy.load(source)
    spec = dataclasses.replace(policy.feature_spec, latency_model=2, token_prior_fraction=0.0)
    probe = dataclasses.replace(policy.probe, cost_depth=3, cost_share=0.2, cost_doubt=2.0)
    return dataclasses.replace(policy, feature_spec=spec, probe=probe)


if __name__ == "__main__":
    path = candidate().save_named_by_hash(HERE)
    print("costprobe25", hashlib.sha256(path.read_bytes()).hexdigest(), path.name)

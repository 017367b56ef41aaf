"""The twenty-second session's retrain (helper ``retrain22``) as a servable file: the
weights ``specctl-train`` exported to /tmp/retrain22/policy.npz (the shipped recipe on
today's simulator, with ``drop_warmup_latency``, ``warmup_restarts_draft``,
``warmup_flag`` and ``latency_drop_before_prefill``; RETRAIN.md) with the shipped file's
goodput guard (margin -0.02), off probe and ``latency_outlier_ratio`` 3, as the shipped
file carries them on its own weights. Every other feature field is the trained file's.

Writes ``policy_<sha8>.npz`` here and prints its sha.

    PYTHONPATH=$PWD python docs/results/gpu22/make_retrain.py [/tmp/retrain22/policy.npz]
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parent / "gpu21/policy_5c3d9060.npz"  # shipped when this ran


def main(trained_path: str = "/tmp/retrain22/policy.npz") -> None:
    shipped = ExportedPolicy.load(SHIPPED)
    trained = ExportedPolicy.load(trained_path)
    spec = dataclasses.replace(trained.feature_spec,
                               latency_outlier_ratio=shipped.feature_spec.latency_outlier_ratio)
    policy = dataclasses.replace(trained, feature_spec=spec, guard=shipped.guard,
                                 probe=shipped.probe, name="ppo_rt22")
    path = policy.save_named_by_hash(HERE)
    print("rt22", hashlib.sha256(path.read_bytes()).hexdigest(), path.name)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Runs 61-74 (every serving ``lockin_eval.py`` cuts, and run 74's four): each serving's
telemetry replayed open loop (``replay_decisions.replay``) through the shipped file
(5c3d9060), the shipped file with the retrain's warm-up fields (``drop_warmup_latency``,
``warmup_restarts_draft``, ``warmup_flag``: the same weights, probe and guard) and the
retrain ``policy_abbd0f23.npz`` (RETRAIN.md), at batch 8-23 and >= 24 (``band_summary``).
One JSON line per serving and file; ``retrain_replay_table.py`` tabulates them.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu22/retrain_replay.py > docs/results/gpu22/retrain_replay.txt
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lockin_eval import RUNS as LOCKIN_RUNS
from lockin_eval import SHIPPED, replay_servings
from servings_70_74 import RUNS as RUNS_70_74

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
RUNS = {**LOCKIN_RUNS, 74: RUNS_70_74[74]}
WARMUP_FIELDS = {"drop_warmup_latency": True, "warmup_restarts_draft": True, "warmup_flag": True}


def main() -> None:
    shipped = ExportedPolicy.load(SHIPPED)
    policies = {
        "shipped": shipped,
        "shipped_warmup": dataclasses.replace(
            shipped, feature_spec=dataclasses.replace(shipped.feature_spec, **WARMUP_FIELDS)),
        "rt22": ExportedPolicy.load(HERE / "policy_abbd0f23.npz"),
    }
    for line in replay_servings(RUNS, policies):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

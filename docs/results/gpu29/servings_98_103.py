"""Runs 98-103 (twenty-ninth session): the shipped file ``3ff099d0`` served with **no
profile** (plan and prediction: ``docs/results/h200/offswitch/prediction_run98.md``), per
serving as ``gpu26/servings_91_97.py`` (depth shares per batch band, warm-ups, measured
latency per depth, the telemetry replayed open loop through the served file, the hooks).

Run 98: the MoE without speculation, 6 requests/s. Run 99: the MoE at 2.5: ``ppo``,
static 3, ``ppo``. Run 100: the dense model without speculation, 12 requests/s. Run 101:
dense at 3.0, 12 requests/s: ``ppo``, static 3, ``ppo``. Run 102: the MoE without
speculation again (the host's drift within the lease). Run 103 (not in the plan; a fresh
machine after the first was taken back): the MoE at 1.1, ``ppo``.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22:$R/gpu26 \\
        python docs/results/gpu29/servings_98_103.py > docs/results/gpu29/servings_98_103.txt
"""

from __future__ import annotations

from pathlib import Path

from servings import RAMP
from servings_91_97 import report

HERE = Path(__file__).resolve().parent
#: run -> (model tag, trace file's tag, servings in order after the ramp)
RUNS = {
    99: ("moe_acc2.5", "noprofile_ppo_s3_ppo", [*RAMP, "ppo r6", "static_3 r6", "ppo_2 r6"]),
    101: ("dense_acc3.0", "noprofile_r12_ppo_s3_ppo",
          [*RAMP, "ppo r12", "static_3 r12", "ppo_2 r12"]),
    103: ("moe_acc1.1", "noprofile_ppo", [*RAMP, "ppo r6"]),
}
#: run -> no speculation's replay file
NOSPEC = {98: "moe_nospec_replay_r6_run98.json", 100: "dense_nospec_replay_r12_run100.json",
          102: "moe_nospec_replay_r6_run102.json"}

if __name__ == "__main__":
    report(RUNS, NOSPEC, HERE / "hooks")

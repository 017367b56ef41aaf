"""Runs 104-107 (thirtieth session): the shipped file ``3ff099d0`` served with **no
profile** on the dense model at 3.0 (plan and prediction: ``plan.md`` here), per serving as
``gpu26/servings_91_97.py`` (depth shares per batch band, warm-ups, measured latency per
depth, the telemetry replayed open loop through the served file, the hooks).

Run 104: the dense model without speculation, 8 then 12 requests/s. Run 105: dense at
3.0, 8 requests/s: ``ppo``, static 3, ``ppo``. Run 106: dense at 3.0, 12 requests/s:
``ppo``, ``ppo``. Run 107: run 104 again (the host's drift within the lease).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22:$R/gpu26 \\
        python docs/results/gpu30/servings_104_107.py > docs/results/gpu30/servings_104_107.txt
"""

from __future__ import annotations

from pathlib import Path

from servings import RAMP
from servings_91_97 import report

HERE = Path(__file__).resolve().parent
#: run -> (model tag, trace file's tag, servings in order after the ramp)
RUNS = {
    105: ("dense_acc3.0", "noprofile_r8_ppo_s3_ppo", [*RAMP, "ppo r8", "static_3 r8", "ppo_2 r8"]),
    106: ("dense_acc3.0", "noprofile_r12_ppo_ppo", [*RAMP, "ppo r12", "ppo_2 r12"]),
}
#: (run, rate) -> no speculation's replay file
NOSPEC = {"104 r8": "dense_nospec_replay_r8_run104.json",
          "107 r8": "dense_nospec_replay_r8_run107.json",
          "104 r12": "dense_nospec_replay_r12_run104.json",
          "107 r12": "dense_nospec_replay_r12_run107.json"}

if __name__ == "__main__":
    report(RUNS, NOSPEC, HERE / "hooks")

"""Runs 75-77 (twenty-third session, one lease): per serving, as ``servings_70_74.py``.

Run 75: the dense model without speculation at 12 and 8 requests/s. Run 76: the dense model
at acceptance 3.0, the shipped file (``ppo``) and ``ceil`` (the shipped file with
``latency_off_ceiling`` 0.1) at 12 then 8. Run 77: the MoE at 2.5, ``ppo`` and ``ceil`` at
6 requests/s twice.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu23/servings_75_77.py > docs/results/gpu23/servings_75_77.txt
"""

from __future__ import annotations

from servings import RAMP
from servings_70_74 import report

RUNS = {
    76: ("dense_acc3.0", "h200_llama31_8b_recorded", "r12r8",
         [*RAMP, "ppo r12", "ceil r12", "ppo r8", "ceil r8"]),
    77: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6",
         [*RAMP, "ppo r6", "ceil r6", "ppo r6_2", "ceil r6_2"]),
}

if __name__ == "__main__":
    report(RUNS, {75: "dense_nospec_replay_r*_run75.json"})

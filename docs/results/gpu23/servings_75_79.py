"""Runs 75-79 (twenty-third session, two leases): per serving, as ``servings_70_74.py``.

Run 75: the dense model without speculation at 12 and 8 requests/s. Run 76: the dense model
at acceptance 3.0, the shipped file (``ppo``) and ``ceil`` (the shipped file with
``latency_off_ceiling`` 0.1) at 12 then 8. Run 77: the MoE at 2.5, ``ppo`` and ``ceil`` at
6 requests/s twice. Second lease: run 78, the MoE without speculation at 6; run 79, the MoE at
2.5, the shipped file (``ppo``, now ``65d4fb99``: the off ceiling) at 6 twice, hook timing on.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu23/servings_75_79.py > docs/results/gpu23/servings_75_79.txt
"""

from __future__ import annotations

from servings import RAMP
from servings_70_74 import FILES, report

RUNS = {
    76: ("dense_acc3.0", "h200_llama31_8b_recorded", "r12r8",
         [*RAMP, "ppo r12", "ceil r12", "ppo r8", "ceil r8"]),
    77: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6",
         [*RAMP, "ppo r6", "ceil r6", "ppo r6_2", "ceil r6_2"]),
}
#: Run 79 served the shipped file under the name ``ppo``: the off ceiling's file.
RUN_79 = {79: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6", [*RAMP, "ppo r6", "ppo r6_2"])}

if __name__ == "__main__":
    report(RUNS, {75: "dense_nospec_replay_r*_run75.json",
                  78: "moe_nospec_replay_r6_run78.json"})
    report(RUN_79, {}, {"ppo": FILES["ceil"]})

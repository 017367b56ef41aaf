"""Runs 80-84 (twenty-fourth session, one lease): per serving, as ``servings_70_74.py``.

Run 80: the dense model without speculation at 8 and 12 requests/s. Run 81: the dense model
at acceptance 3.0, the controller handed the off-cheap profile
(``offceil24/offcheap_h200_llama31_8b_recorded.yaml``), the shipped file (``ppo``,
``65d4fb99``: the bare off ceiling) and ``rising`` (``latency_off_ceiling_samples`` 2) at 8,
12, 8. Run 82: the same with the dense model's own profile at 12 then 8. Run 83: the MoE at
2.5, its own profile, ``ppo`` and ``rising`` at 6 twice. Run 84: the MoE without speculation
at 6.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu24/servings_80_84.py > docs/results/gpu24/servings_80_84.txt
"""

from __future__ import annotations

from pathlib import Path

from servings import RAMP
from servings_70_74 import FILES, report

RESULTS = Path(__file__).resolve().parents[1]
OFFCHEAP = str(RESULTS / "offceil24/offcheap_h200_llama31_8b_recorded.yaml")
RUNS = {
    81: ("dense_acc3.0", OFFCHEAP, "r8r12r8",
         [*RAMP, "ppo r8", "rising r8", "ppo r12", "rising r12", "ppo r8_2", "rising r8_2"]),
    82: ("dense_acc3.0", "h200_llama31_8b_recorded", "r12r8",
         [*RAMP, "ppo r12", "rising r12", "ppo r8", "rising r8"]),
    83: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6",
         [*RAMP, "ppo r6", "rising r6", "ppo r6_2", "rising r6_2"]),
}
#: What each serving's label ran: ``ppo`` was the shipped file, the bare ceiling.
SERVED = {"ppo": FILES["ceil"], "rising": RESULTS / "offceil24/policy_3f47437c.npz"}

if __name__ == "__main__":
    report(RUNS, {80: "dense_nospec_replay_r*_run80.json", 84: "moe_nospec_replay_r6_run84.json"},
              SERVED)

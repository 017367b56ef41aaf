"""Runs 85-89 (twenty-fifth session, one lease, the MoE at 6 requests/s): per serving, as
``gpu22/servings_70_74.py`` (depth shares per batch band, warm-ups, measured latency per
depth, the telemetry replayed open loop through the file that served it), the controller's
profile per run: none (runs 86-87), the MoE's own (88), the off-cheap one (89).

Run 85: no speculation. Run 86: acceptance 2.5, no profile: the shipped file (``ppo``,
``3f47437c``) then static 3. Run 87: acceptance 1.1, no profile: ``ppo``. Run 88: 2.5, the
MoE's profile: ``ppo`` twice. Run 89: 2.5, ``offceil24/offcheap_h200_qwen3_30b_a3b.yaml``:
``ppo`` twice.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu25/servings_85_89.py > docs/results/gpu25/servings_85_89.txt
"""

from __future__ import annotations

import json
from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary
from servings import OFFSWITCH, RAMP, headline_servings

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

RESULTS = Path(__file__).resolve().parents[1]
SHIPPED = RESULTS / "offceil24/policy_3f47437c.npz"
OFFCHEAP = str(RESULTS / "offceil24/offcheap_h200_qwen3_30b_a3b.yaml")
#: run -> (model tag, profile or None, trace file's tag, servings in order after the ramp)
RUNS = {
    86: ("moe_acc2.5", None, "noprofile_ppo_s3", [*RAMP, "ppo r6", "static_3 r6"]),
    87: ("moe_acc1.1", None, "noprofile_ppo", [*RAMP, "ppo r6"]),
    88: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6", [*RAMP, "ppo r6", "ppo r6_2"]),
    89: ("moe_acc2.5", OFFCHEAP, "offcheap_r6r6", [*RAMP, "ppo r6", "ppo r6_2"]),
}


def main() -> None:
    shipped = ExportedPolicy.load(SHIPPED)
    replay = json.loads((OFFSWITCH / "moe_nospec_replay_r6_run85.json").read_text())
    print(json.dumps({"run": 85, "serving": "nospec r6",
                      "mean_tpot_ms": round(replay["headline"]["mean_tpot_ms"], 2),
                      "mean_ttft_ms": round(replay["headline"]["mean_ttft_ms"], 1)}))
    for run, (model, profile, tag, names) in RUNS.items():
        prior = load_profile(profile) if profile else None
        for policy, steps, row in headline_servings(model, run, tag, names):
            if policy == "ppo":  # the constant policies have nothing to replay
                replayed = rd.replay(steps, shipped, prior)
                row["replayed_8-23"] = band_summary(replayed, 8, 24)
                row["replayed_>=24"] = band_summary(replayed, 24, 10**9)
            print(json.dumps(row))


if __name__ == "__main__":
    main()

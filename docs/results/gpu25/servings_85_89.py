"""Runs 85-89 (twenty-fifth session, one lease, the MoE at 6 requests/s): per serving, as
``gpu22/servings_70_74.py`` (depth shares per batch band, warm-ups, measured latency per
depth, the telemetry replayed open loop through the file that served it), the controller's
profile per run: none (runs 86-87), the MoE's own (88), the off-cheap one (89).

Run 85: no speculation. Run 86: acceptance 2.5, no profile: the shipped file (``ppo``,
``3f47437c``) then static 3. Run 87: acceptance 1.1, no profile: ``ppo``. Run 88: 2.5, the
MoE's profile: ``ppo`` twice. Run 89: 2.5, ``offceil24/offcheap_h200_qwen3_30b_a3b.yaml``:
``ppo`` twice. Run 90: 2.5, no profile: the candidate ``m2`` (``gpu25/policy_fb63f66c.npz``,
``latency_model`` 2), ``ppo``, ``m2`` (the first ``m2`` serving's TPOT and TTFT from its log
line, ``moe_acc2.5_replay_r6_m2_first_run90.txt``: the run file kept the second under the
same key).

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
FILES = {"ppo": SHIPPED, "m2": RESULTS / "gpu25/policy_fb63f66c.npz"}
#: Run 90's first m2 serving as its log line has it (see the docstring).
FIRST_M2 = {"mean_tpot_ms": 19.39, "mean_ttft_ms": 111.5}
OFFCHEAP = str(RESULTS / "offceil24/offcheap_h200_qwen3_30b_a3b.yaml")
#: run -> (model tag, profile or None, trace file's tag, servings in order after the ramp)
RUNS = {
    86: ("moe_acc2.5", None, "noprofile_ppo_s3", [*RAMP, "ppo r6", "static_3 r6"]),
    87: ("moe_acc1.1", None, "noprofile_ppo", [*RAMP, "ppo r6"]),
    88: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6", [*RAMP, "ppo r6", "ppo r6_2"]),
    89: ("moe_acc2.5", OFFCHEAP, "offcheap_r6r6", [*RAMP, "ppo r6", "ppo r6_2"]),
    90: ("moe_acc2.5", None, "noprofile_m2_ppo_m2", [*RAMP, "m2 r6", "ppo r6", "m2 r6"]),
}


def main() -> None:
    policies = {label: ExportedPolicy.load(path) for label, path in FILES.items()}
    replay = json.loads((OFFSWITCH / "moe_nospec_replay_r6_run85.json").read_text())
    print(json.dumps({"run": 85, "serving": "nospec r6",
                      "mean_tpot_ms": round(replay["headline"]["mean_tpot_ms"], 2),
                      "mean_ttft_ms": round(replay["headline"]["mean_ttft_ms"], 1)}))
    for run, (model, profile, tag, names) in RUNS.items():
        prior = load_profile(profile) if profile else None
        for i, (policy, steps, row) in enumerate(headline_servings(model, run, tag, names)):
            if run == 90 and i == 0:
                row.update(FIRST_M2)
            if policy in policies:  # the constant policies have nothing to replay
                replayed = rd.replay(steps, policies[policy], prior)
                row["replayed_8-23"] = band_summary(replayed, 8, 24)
                row["replayed_>=24"] = band_summary(replayed, 24, 10**9)
            print(json.dumps(row))


if __name__ == "__main__":
    main()

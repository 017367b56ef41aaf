"""Runs 61-73 (every serving the gpu20/gpu21/gpu22 scripts cut, dense and MoE): each
serving's telemetry replayed open loop (``replay_decisions.replay``) through the shipped
file (5c3d9060) as it is and with the candidate feature-spec changes of ``VARIANTS``
(the same weights, probe and guard), at batch 8-23 and >= 24: replayed off share against
recorded, the features' median off / depth-3 price against the measured medians
(``band_prices.band_summary``). Usage (``VARIANTS`` names as arguments, default all)::

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu22/lockin_eval.py > docs/results/gpu22/lockin_eval.txt
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary
from servings import OFFSWITCH, RAMP, cut_servings

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

#: The file shipped when these tables were made (``5c3d9060``). Not
#: ``controller/data/default_policy.npz``: that is ``65d4fb99`` (the ceiling) since the
#: twenty-third session, and would change the "shipped" rows.
SHIPPED = Path(__file__).resolve().parents[1] / "gpu21/policy_5c3d9060.npz"
DENSE = ("dense_acc3.0", "h200_llama31_8b_recorded")
MOE = ("moe_acc2.5", "h200_qwen3_30b_a3b")
PROBE = ["probe static_0", "probe static_3"]
#: run -> (model tag, profile, trace's rate tag, servings in order after the first reload);
#: as gpu20/servings_61_64.py, gpu21/servings_65_69.py and gpu22/servings_70_74.py cut them.
RUNS = {
    61: (*DENSE, "r12r8r12", [*RAMP, "c1ec_w1 r12", "ppo r12", "c1ec_w1 r8", "ppo r8",
                              "c1ec_w1 r12_2", "ppo r12_2", *PROBE]),
    63: (*DENSE, "r12", [*RAMP, "static_0 r12", "c1ec_w1 r12", "static_3 r12"]),
    64: (*DENSE, "r12r12", [*RAMP, "ppo r12", "c1ec_w1 r12", "ppo r12_2", "c1ec_w1 r12_2"]),
    65: (*DENSE, "r12r8", [*RAMP, "adm r12", "ppo r12", "cap24 r12", "adm r8", "ppo r8",
                           "cap24 r8"]),
    67: (*DENSE, "r12r12", [*RAMP, "ppo r12", "adm r12", "cap24 r12", "ppo r12_2", "adm r12_2",
                            "cap24 r12_2"]),
    68: (*DENSE, "r8r12", [*RAMP, "static_3 r8", "adm r8", "static_3 r12", "adm r12"]),
    69: (*MOE, "r8", [*RAMP, "adm r8", "ppo r8"]),
    71: (*MOE, "r6r6", [*RAMP, "ppo r6", "old r6", "ppo r6_2", "old r6_2"]),
    72: (*DENSE, "r12r12", [*RAMP, "ppo r12", "ppo r12_2"]),
    73: (*MOE, "r6r6", [*RAMP, "old r6", "ppo r6", "old r6_2", "ppo r6_2"]),
}
#: Candidate feature-spec changes to the shipped file (name -> FeatureSpec fields).
VARIANTS = {
    "shipped": {},
    # the existing warm-up fields: every trace of runs 61-73 flags its warm-ups
    "warmup_flag": {"drop_warmup_latency": True, "warmup_flag": True},
    # FeatureSpec.latency_off_outlier_ratio (twenty-second session)
    "off_clip_1.25": {"latency_off_outlier_ratio": 1.25},
    "off_clip_1.5": {"latency_off_outlier_ratio": 1.5},
    # FeatureSpec.latency_off_ceiling (twenty-second session)
    "off_ceiling_0.1": {"latency_off_ceiling": 0.1},
    "off_ceiling_0.2": {"latency_off_ceiling": 0.2},
    # FeatureSpec.latency_off_ceiling_batch (twenty-third session): the ceiling at batch >= 24
    "off_ceiling_0.1_from24": {"latency_off_ceiling": 0.1, "latency_off_ceiling_batch": 24.0},
}


def variant(policy: ExportedPolicy, changes: dict) -> ExportedPolicy:
    """``policy`` with its feature spec's fields ``changes`` set."""
    if not changes:
        return policy
    return dataclasses.replace(policy, feature_spec=dataclasses.replace(policy.feature_spec,
                                                                        **changes))


def replay_servings(runs: Mapping[int, tuple], policies: Mapping[str, ExportedPolicy]
                    ) -> Iterator[dict]:
    """Every serving of ``runs`` (``RUNS``'s form; ramps and probes left out) replayed open
    loop through each of ``policies``, in order: one dict per serving and policy (run,
    model "dense" or "MoE", serving, policy label, ``band_summary`` at 8-23 and >= 24)."""
    for run, (model, profile, tag, names) in runs.items():
        prior = load_profile(profile)
        for name, steps in cut_servings(OFFSWITCH / f"{model}_trace_{tag}_run{run}.tar.gz",
                                        OFFSWITCH / f"{model}_controller_run{run}.log", names):
            if name.startswith(("ramp", "probe")):
                continue
            for label, policy in policies.items():
                rows = rd.replay(steps, policy, prior)
                yield {"run": run, "model": "MoE" if "moe" in model else "dense",
                       "serving": name, "through": label, "8-23": band_summary(rows, 8, 24),
                       ">=24": band_summary(rows, 24, 10**9)}


def main() -> None:
    chosen = sys.argv[1:] or list(VARIANTS)
    shipped = ExportedPolicy.load(SHIPPED)
    policies = {name: variant(shipped, VARIANTS[name]) for name in chosen}
    for line in replay_servings(RUNS, policies):
        del line["model"]  # (this table's lines never had it)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

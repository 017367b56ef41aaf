"""Runs 91-97 (twenty-sixth session, one lease): the shipped file (``c66f698d``: latency
model 2 and the cost probe without a profile) served with **no profile**, per serving as
``gpu25/servings_85_89.py`` (depth shares per batch band, warm-ups, measured latency per
depth, the telemetry replayed open loop through the served file), and each plugin server's
hooks (``SPECCTL_HOOK_TIMING``, the server's whole life: the warm-up ramp and every serving).

Run 91: the MoE without speculation, 6 requests/s. Run 92: the MoE at 2.5: ``ppo``,
static 3, ``ppo``. Run 93: the MoE at 1.1: ``ppo``. Run 94: the dense model without
speculation, 8 requests/s. Run 95: dense at 3.0, 8 requests/s: ``ppo``, static 3, ``ppo``.
Run 96: dense without speculation, 12 requests/s. Run 97: dense at 3.0, 12 requests/s:
``ppo``, static 3.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu26/servings_91_97.py > docs/results/gpu26/servings_91_97.txt
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary
from servings import OFFSWITCH, RAMP, headline_servings

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[2] / "controller/data/default_policy.npz"
#: the servings of the shipped file (a second serving is keyed ``ppo_2`` in the run file)
PPO = ("ppo", "ppo_2")
#: run -> (model tag, trace file's tag, servings in order after the ramp)
RUNS = {
    92: ("moe_acc2.5", "noprofile_ppo_s3_ppo", [*RAMP, "ppo r6", "static_3 r6", "ppo_2 r6"]),
    93: ("moe_acc1.1", "noprofile_ppo", [*RAMP, "ppo r6"]),
    95: ("dense_acc3.0", "noprofile_ppo_s3_ppo", [*RAMP, "ppo r8", "static_3 r8", "ppo_2 r8"]),
    97: ("dense_acc3.0", "noprofile_r12_ppo_s3", [*RAMP, "ppo r12", "static_3 r12"]),
}
#: run -> (no speculation's replay file, the plugin run it compares with)
NOSPEC = {91: "moe_nospec_replay_r6_run91.json", 94: "dense_nospec_replay_r8_run94.json",
          96: "dense_nospec_replay_r12_run96.json"}


def hook_summary(run: int, hooks: Path = HERE / "hooks") -> dict:
    """The hooks' time per step (us): as measured, and less the instrument's in-situ
    excess (``sglang_hooks/timing.py``; README's issue 12 table reports both)."""
    data = json.loads((hooks / f"run{run}.json").read_text())
    less = data["instrument_in_situ"]["step_us_less_excess"]
    return {"run": run, "hook_steps": data["steps"],
            "p50_p90_p99_us": [round(data[f"p{q}_us"], 1) for q in (50, 90, 99)],
            "less_excess": [round(less[f"p{q}"], 1) for q in (50, 90, 99)],
            "excess_per_step_us": round(data["instrument_in_situ"]["excess_per_step_us"], 1)}


def served_policy(model: str, run: int, rate: str) -> Path:
    """The ``ppo`` file a run served, by the sha256 its run file records, among the kept
    ``docs/results/*/policy_*.npz`` (the shipped file changes after a run)."""
    replay = json.loads((OFFSWITCH / f"{model}_replay_{rate}_run{run}.json").read_text())
    sha = replay["policy_sha256"]
    for path in [*sorted(HERE.parent.glob("*/policy_*.npz")), SHIPPED]:
        if hashlib.sha256(path.read_bytes()).hexdigest() == sha:
            return path
    raise SystemExit(f"run {run}: the served policy {sha[:8]} is not kept under docs/results")


def report(runs: dict, nospec: dict, hooks: Path = HERE / "hooks") -> None:
    """One JSON line per serving: no speculation's replays (``nospec``: run -> file),
    then each plugin run's servings (``runs``: run -> (model, trace tag, servings)) with
    ``ppo``'s telemetry replayed open loop through the file it served, then its hooks."""
    for run, name in nospec.items():
        replay = json.loads((OFFSWITCH / name).read_text())
        print(json.dumps({"run": run, "serving": "nospec",
                          "mean_tpot_ms": round(replay["headline"]["mean_tpot_ms"], 2),
                          "mean_ttft_ms": round(replay["headline"]["mean_ttft_ms"], 1)}))
    for run, (model, tag, names) in runs.items():
        rate = names[-1].split()[-1]
        path = served_policy(model, run, rate)
        served = ExportedPolicy.load(path)
        print(json.dumps({"run": run, "served": path.name}))
        for policy, steps, row in headline_servings(model, run, tag, names):
            if policy in PPO:  # the constant policies have nothing to replay
                replayed = rd.replay(steps, served, None)
                row["replayed_8-23"] = band_summary(replayed, 8, 24)
                row["replayed_>=24"] = band_summary(replayed, 24, 10**9)
            print(json.dumps(row))
        print(json.dumps(hook_summary(run, hooks)))


if __name__ == "__main__":
    report(RUNS, NOSPEC)

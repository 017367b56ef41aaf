"""Runs 57, 58 and 60 (nineteenth session, the dense model at acceptance 3.0): per
serving, the decode steps' depth shares per batch band, re-entry warm-ups per 1,000 decode
steps and the measured step latency per depth at batch >= 24 (``servings.serving_rows``).

    PYTHONPATH=$PWD:docs/results/drop_warmup python docs/results/gpu19/dense_servings.py \
        > docs/results/gpu19/dense_servings.txt
"""

from __future__ import annotations

import json

from servings import OFFSWITCH, RAMP, cut_servings, serving_rows

#: run -> (trace file's rate tag, servings in order after the first reload)
RUNS = {
    57: ("r8r12", [*RAMP, "static_3 r8", "ppo r8", "static_3 r12", "ppo r12"]),
    58: ("r12r8", [*RAMP, "static_0 r12", "ppo r12", "static_0 r8", "ppo r8"]),
    60: ("r12", [*RAMP, "ppo r12"]),
}


def servings(run: int):
    """``(serving name, its records)`` for each serving of ``run`` (``RUNS``)."""
    tag, names = RUNS[run]
    return cut_servings(OFFSWITCH / f"dense_acc3.0_trace_{tag}_run{run}.tar.gz",
                        OFFSWITCH / f"dense_acc3.0_controller_run{run}.log", names)


def main() -> None:
    for run in RUNS:
        replays = {rate: json.loads(path.read_text()) for rate in ("r8", "r12")
                   if (path := OFFSWITCH / f"dense_acc3.0_replay_{rate}_run{run}.json").exists()}
        for name, steps in servings(run):
            if name.startswith("ramp"):
                continue
            policy, rate = name.split()
            tpot = replays[rate][f"headline_{policy}"]["mean_tpot_ms"]
            print(json.dumps({"run": run, "serving": name, "mean_tpot_ms": round(tpot, 2),
                              **serving_rows(steps)}))

if __name__ == "__main__":
    main()

"""Runs 61, 63 and 64 (twentieth session, the dense model at acceptance 3.0, profile
h200_llama31_8b_recorded): per serving, the mean TPOT, the decode steps' depth shares per
batch band, re-entry warm-ups per 1,000 decode steps and the measured step latency per
depth at batch >= 24 (``servings.serving_rows``), plus the batch sizes the serving ran at.
``c1ec_w1`` is ``policy_e1ff08ab.npz`` here, ``ppo`` the shipped file (3dd256a8).

    PYTHONPATH=$PWD:docs/results/drop_warmup python docs/results/gpu20/servings_61_64.py \
        > docs/results/gpu20/servings_61_64.txt
"""

from __future__ import annotations

import json

import numpy as np
from servings import OFFSWITCH, RAMP, cut_servings, serving_rows

PROBE = ["probe static_0", "probe static_3"]
#: run -> (trace file's rate tag, servings in order after the first reload)
RUNS = {
    61: ("r12r8r12", [*RAMP, "c1ec_w1 r12", "ppo r12", "c1ec_w1 r8", "ppo r8",
                      "c1ec_w1 r12_2", "ppo r12_2", *PROBE]),
    63: ("r12", [*RAMP, "static_0 r12", "c1ec_w1 r12", "static_3 r12"]),
    64: ("r12r12", [*RAMP, "ppo r12", "c1ec_w1 r12", "ppo r12_2", "c1ec_w1 r12_2"]),
}


def replayed_servings():
    """``(run, serving name, its records)`` for every serving of ``RUNS`` but the ramp's
    and the prefill probe's, cut at the controller's reloads."""
    for run, (tag, names) in RUNS.items():
        for name, records in cut_servings(
                OFFSWITCH / f"dense_acc3.0_trace_{tag}_run{run}.tar.gz",
                OFFSWITCH / f"dense_acc3.0_controller_run{run}.log", names):
            if not name.startswith(("ramp", "probe")):
                yield run, name, records


def main() -> None:
    replays = {(run, rate): json.loads(path.read_text()) for run in RUNS
               for rate in ("r8", "r12", "r12_2")
               if (path := OFFSWITCH / f"dense_acc3.0_replay_{rate}_run{run}.json").exists()}
    for run, name, steps in replayed_servings():
        policy, rate = name.split()
        tpot = replays[run, rate][f"headline_{policy}"]["mean_tpot_ms"]
        batch = [r.batch_size for r in steps if r.is_decode]
        print(json.dumps({"run": run, "serving": name, "mean_tpot_ms": round(tpot, 2),
                          "batch_p50_p90_max": [int(np.percentile(batch, 50)),
                                                int(np.percentile(batch, 90)), max(batch)],
                          **serving_rows(steps)}))


if __name__ == "__main__":
    main()

"""One stalled step in a fresh stream's first ten: the shipped file against the same file
with ``latency_outlier_warmup: 1`` (``policy_0f7e6c6c.npz``), replayed open loop through
the daemon's decision code over every ``ppo`` serving of runs 46-60 (the MoE @ 2.5 and
the dense model @ 3.0).

The outlier clip (``FeatureSpec.latency_outlier_ratio``: a decode step over 3x the
profile's price enters the estimators at 3x) is armed only after
``latency_outlier_warmup`` measured steps. A policy reload with another feature spec
starts the stream's features afresh (``controller.server``), as does a new server; the
first ``ppo`` serving after the load generator's ramp (runs 49, 51, 60) met an 83-210 ms
depth-5 step at record 3, before the clip was armed, and priced depth 3 far above its
measured cost for hundreds of steps. Per serving: the decode steps whose replayed depth
differs, the off share each way, and at batch 8-23 and >= 24 the predicted depth-3 ms
each way against the measured.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu19 \\
        python docs/results/stall19/replay.py > docs/results/stall19/replay.txt
"""

from __future__ import annotations

from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary, policy_servings
from dense_band_prices import PROFILE, ppo_servings
from servings import RUNS

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

CANDIDATE = Path(__file__).resolve().parent / "policy_0f7e6c6c.npz"
BANDS = (("8-23", 8, 24), (">=24", 24, 10**9))


def servings():
    """``(run, serving, records, prior)`` of every ``ppo`` serving, MoE then dense."""
    for run in RUNS:
        for name, records, prior in policy_servings(run):
            if name.startswith("ppo"):
                yield run, name, records, prior
    dense_prior = load_profile(PROFILE)
    for run, name, records in ppo_servings():
        yield run, name, records, dense_prior


def main() -> None:
    shipped, candidate = ExportedPolicy.load(rd.SHIPPED), ExportedPolicy.load(CANDIDATE)
    print("| run | serving | decode steps | differing | off share (shipped / w1) | "
          "depth-3 ms 8-23 (shipped / w1 / measured) | depth-3 ms >= 24 |")
    print("|---|---|---|---|---|---|---|")
    for run, name, records, prior in servings():
        a, b = rd.replay(records, shipped, prior), rd.replay(records, candidate, prior)
        differing = sum(x["replayed"] != y["replayed"] for x, y in zip(a, b, strict=True))
        off = [sum(r["replayed"] == 0 for r in rows) / max(len(rows), 1) for rows in (a, b)]
        cells = []
        for _, lo, hi in BANDS:
            sa, sb = band_summary(a, lo, hi), band_summary(b, lo, hi)
            if not sa:
                cells.append("-")
                continue
            cells.append(f"{sa['pred_ms_off_d3'][1]} / {sb['pred_ms_off_d3'][1]} / "
                         f"{sa['meas_ms_off_d3'][1]}")
        print(f"| {run} | {name} | {len(a)} | {differing} | {off[0]:.3f} / {off[1]:.3f} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

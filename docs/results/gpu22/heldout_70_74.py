"""The launch booking held out: runs 71-74 (served after the fit, with the plugin's
``before_prefill`` flag) against the model fitted on runs 46-69.

* table 1: per model and depth, the decode steps the plugin flagged ``before_prefill``
  (and, apart, those not flagged whose next record is a prefill): their measured extra over
  their own cost (``prefill_launch.read``: the median of the plain steps of the same run,
  depth and batch) against ``CostProfile.prefill_launch_booked_s`` of the shipped profile
  at that own cost, per own-cost bin; and L per run at the shipped h;
* table 2: every headline serving of runs 71-74 in the simulator as ``compare.py`` replays
  it (``--reentry-warmup``; the plugin flagged, so the simulator's flags stay on), before
  (``dense_spec.yaml``, ``moe_real_spec.yaml``) and after (the ``_launch`` copies here)
  the booking: mean TPOT against measured.

    R=docs/results; P=$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu20:$R/gpu21:$R/adm21_moe:$R/gpu22
    PYTHONPATH=$PWD:$PWD/scripts/h200:$P \\
        python docs/results/gpu22/heldout_70_74.py > docs/results/gpu22/heldout_70_74.txt
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import compare
import numpy as np
import prefill_launch as pl
import servings_70_74
from measured_runs import read_run_dir
from omegaconf import OmegaConf
from servings import OFFSWITCH

from env.sim.cost_model import load_profile

HERE = Path(__file__).resolve().parent
FIDELITY = HERE.parent / "h200/fidelity"
SHIPPED = {"dense": load_profile("h200_llama31_8b_recorded"),
           "moe": load_profile("h200_qwen3_30b_a3b")}
SERVERS = {"before": {"dense": FIDELITY / "dense_spec.yaml",
                      "moe": FIDELITY / "moe_spec.yaml",
                      "moe.real": FIDELITY / "moe_real_spec.yaml",
                      "moe.nospec": FIDELITY / "moe_real_nospec.yaml"},
           "after": {"dense": HERE / "dense_spec_launch.yaml",
                     "moe": FIDELITY / "moe_spec.yaml",
                     "moe.real": HERE / "moe_real_spec_launch.yaml",
                     "moe.nospec": FIDELITY / "moe_real_nospec.yaml"}}


def sources():
    for run, (prefix, _profile, tag, names) in servings_70_74.RUNS.items():
        yield "moe" if prefix.startswith("moe") else "dense", run, tag, prefix, names


def table_model(steps) -> None:
    print("## Table 1: the extra of the steps before a prefill, measured against the shipped "
          "model (ms, means)\n")
    for model in ("dense", "moe"):
        profile = SHIPPED[model]
        launch, hidden = profile.prefill_launch_s * 1e3, profile.prefill_launch_hidden
        print(f"**{model}** (L {launch:.1f} ms, h {hidden}):\n")
        print("| steps | depth | own ms | n | measured | predicted |")
        print("|---|---|---|---|---|---|")
        flagged = [s for s in steps if s.model == model and s.flag and s.extra < pl.OUTLIER_MS]
        missed = [s for s in steps if s.model == model and s.flag is False and s.next_prefill
                  and s.extra < pl.OUTLIER_MS]
        plain = [s for s in steps if s.model == model and s.flag is False
                 and not s.next_prefill]
        for label, rows in (("flagged", flagged), ("not flagged, next a prefill", missed),
                            ("not flagged, next a decode step", plain)):
            for depth in sorted({s.depth for s in rows}):
                for lo, hi in ((0, 10), (10, 17), (17, 25), (25, 10**9), (0, 10**9)):
                    sel = [s for s in rows if s.depth == depth and lo <= s.own < hi]
                    if len(sel) < 10:
                        continue
                    measured = np.mean([s.extra for s in sel])
                    predicted = 1e3 * np.mean([profile.prefill_launch_booked_s(s.own / 1e3)
                                               for s in sel]) if label == "flagged" else 0.0
                    span = "all" if (lo, hi) == (0, 10**9) else (
                        f"[{lo}, {hi if hi < 10**9 else 'up'})")
                    print(f"| {label} | {depth} | {span} | {len(sel)} | {measured:.2f} "
                          f"| {predicted:.2f} |")
        print(f"\nL per run at h = {hidden}:\n")
        print("| run | flagged steps | L ms |")
        print("|---|---|---|")
        for run in sorted({s.run for s in flagged}):
            sel = [s for s in flagged if s.run == run]
            fit = pl.fit_hidden(np.array([s.extra for s in sel]),
                                np.array([s.own for s in sel]), hidden)
            print(f"| {run} | {len(sel)} | {fit[0]} |")
        print()


def table_fidelity() -> None:
    print("## Table 2: mean TPOT ms, measured against simulated before / after\n")
    print("| run | cell | measured | before | error | after | error |")
    print("|---|---|---|---|---|---|---|")
    client = OmegaConf.load(FIDELITY / "client.yaml")
    policies = compare.known_policies(None)
    profiles = {label: {k: load_profile(v) for k, v in keys.items()}
                for label, keys in SERVERS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for run in servings_70_74.RUNS:
            for path in OFFSWITCH.glob(f"*_replay_*_run{run}.json"):
                (Path(tmp) / path.name).symlink_to(path)
        for run in (70,):
            for path in OFFSWITCH.glob(f"*_replay_*_run{run}.json"):
                (Path(tmp) / path.name).symlink_to(path)
        cells, _skipped = read_run_dir(tmp)
    for cell in sorted(cells, key=lambda c: c.source):
        if cell.workload != "headline":
            continue
        tpot = {}
        for label in SERVERS:
            profile = compare.profile_for(cell, profiles[label])
            prior = load_profile(cell.prior or "h200_llama31_8b_recorded")
            tpot[label] = compare.simulate(
                cell, profile, prior, client,
                policy_path=compare.policy_of(cell, policies, None),
                sim_overrides={"reentry_warmup": True})["mean_tpot_ms"]
        m = cell.mean_tpot_ms
        print(f"| {cell.source.split('_run')[1].split('.')[0]} | {cell.key()} | {m:.2f} | "
              + " | ".join(f"{tpot[k]:.2f} | {compare.rel(tpot[k], m):+.1%}" for k in SERVERS)
              + " |")


def main() -> None:
    steps, _prefills = pl.read(sources())
    table_model(steps)
    table_fidelity()


if __name__ == "__main__":
    main()

"""Runs 61-68 (the dense model at acceptance 3.0) in the simulator, without and with the
prefill's launch booked on the decode step before it (``CostProfile.prefill_launch_s``).

Each headline serving of ``docs/results/h200/offswitch/dense_*_run6[1-8].json`` is replayed
as ``scripts/h200/compare.py`` does (``--reentry-warmup``, the plugin's depth mask and
switch hold, finish lag 1, the policy file each serving recorded, the prior it was handed)
on the GPU server's fitted profile ``docs/results/h200/fidelity/dense_spec.yaml``
("before") and on the same with the launch booking of ``env/sim/calibration/prefill_launch``
(``dense_spec_launch.yaml`` here, "after"). The plugin that served runs 61-68 did not flag
a step ``before_prefill`` (its features held a decode record until the next one), so the
simulator's flags are taken off its records before the features see them; "flagged" is
"after" with them left on (the features fold a flagged record at once: the plugin since
main's 9a18ff9). It prints

* table 1: per serving, the measured mean TPOT against the two simulations;
* table 2: per policy kind and rate, pooled over its servings, the decode steps' latency
  at depth 0 (off) and depth 3 by batch band (< 24, >= 24): mean, median and p90 ms, the
  share of steps whose next record is a prefill and their mean ms, measured (the traces,
  ``servings.cut_servings``) against the two simulations (every decode record of the
  replays, the warm-up steps left out as in the traces' ``warmup`` flag).

    R=docs/results
    PYTHONPATH=$PWD:$PWD/scripts/h200:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu20:$R/gpu21 \\
        python docs/results/gpu22/fidelity_61_68.py > docs/results/gpu22/fidelity_61_68.txt
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import compare
import numpy as np
import servings_61_64
import servings_65_69
from measured_runs import read_run_dir
from omegaconf import OmegaConf
from servings import OFFSWITCH, RAMP, cut_servings

from env.sim.cost_model import load_profile
from env.sim.simulator import Simulator

HERE = Path(__file__).resolve().parent
FIDELITY = HERE.parent / "h200/fidelity"
PROFILES = {"before": FIDELITY / "dense_spec.yaml", "after": HERE / "dense_spec_launch.yaml"}
NOSPEC = FIDELITY / "dense_nospec.yaml"
RUNS = (61, 62, 63, 64, 65, 66, 67, 68)
BANDS = (("<24", 0, 24), (">=24", 24, 10**9))

#: Every record the simulator emits, in order.
_RECORDED: list = []
#: Whether the simulator's ``before_prefill`` flags reach the features (runs 61-68's
#: plugin had none).
_FLAGS = {"on": False}


def _recording() -> None:
    """Wrap the simulator's stepping so every record it returns is kept (and its
    ``before_prefill`` flag taken off unless ``_FLAGS["on"]``)."""
    decode, advance = Simulator.decode, Simulator.advance

    def keep_decode(self, depth):
        record = decode(self, depth)
        if not _FLAGS["on"]:
            record.before_prefill = None
        _RECORDED.append(record)
        return record

    def keep_advance(self):
        records = advance(self)
        if not _FLAGS["on"]:
            for record in records:
                record.before_prefill = None
        _RECORDED.extend(records)
        return records

    Simulator.decode, Simulator.advance = keep_decode, keep_advance


def cells() -> list:
    """The headline cells of runs 61-68 (dense, spec_off and nospec)."""
    with tempfile.TemporaryDirectory() as tmp:
        for run in RUNS:
            for path in OFFSWITCH.glob(f"dense_*_replay_*_run{run}.json"):
                (Path(tmp) / path.name).symlink_to(path)
        found, _skipped = read_run_dir(tmp)
    return [c for c in found if c.workload == "headline"]


def serving_key(cell) -> tuple[int, str]:
    """``(run, "policy rate")`` of a cell, as the servings are named."""
    file = cell.source.split(":")[0]
    run = int(file.rsplit("_run", 1)[1].split(".")[0])
    rate = file.split("_replay_", 1)[1].rsplit("_run", 1)[0]
    return run, f"{cell.policy} {rate}"


def measured_servings() -> dict[tuple[int, str], list]:
    """The traces' records per ``(run, serving name)``."""
    out = {}
    for run, name, records in servings_61_64.replayed_servings():
        out[run, name] = records
    for run, (model, _profile, tag, names) in servings_65_69.RUNS.items():
        if not model.startswith("dense"):
            continue
        for name, records in cut_servings(OFFSWITCH / f"{model}_trace_{tag}_run{run}.tar.gz",
                                          OFFSWITCH / f"{model}_controller_run{run}.log",
                                          names):
            if name not in RAMP:
                out[run, name] = records
    return out


def decode_rows(records: list) -> list[tuple[int, int, float, bool]]:
    """``(depth, batch, ms, next is a prefill)`` of every decode record but warm-ups and the
    last."""
    return [(r.steps_used, r.batch_size, 1e3 * r.step_latency_s, not n.is_decode)
            for r, n in pairwise(records) if r.is_decode and not r.warmup]


def summary(rows: list) -> str:
    if not rows:
        return "| | | | | |"
    ms = np.array([r[2] for r in rows])
    before = np.array([r[3] for r in rows])
    pre = f"{ms[before].mean():.2f}" if before.any() else ""
    return (f"| {ms.mean():.2f} | {np.median(ms):.2f} | {np.percentile(ms, 90):.2f} "
            f"| {100 * before.mean():.0f}% | {pre} |")


def main() -> None:
    _recording()
    client = OmegaConf.load(FIDELITY / "client.yaml")
    policies = compare.known_policies(None)
    profiles = {k: load_profile(v) for k, v in PROFILES.items()}
    nospec = load_profile(NOSPEC)
    priors: dict[str, object] = {}
    measured = measured_servings()
    sim_rows: dict[tuple[str, tuple], list] = {}
    print("## Table 1: mean TPOT ms, measured against simulated (before / after)\n")
    print("| run | serving | measured | before | error | after | error | flagged | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in sorted(cells(), key=lambda c: (serving_key(c)[1].split()[1],
                                               serving_key(c))):
        key = serving_key(cell)
        prior_name = cell.prior or "h200_llama31_8b_recorded"
        if prior_name not in priors:
            priors[prior_name] = load_profile(prior_name)
        tpot = {}
        for label, profile in (*profiles.items(), ("flagged", profiles["after"])):
            _RECORDED.clear()
            _FLAGS["on"] = label == "flagged"
            result = compare.simulate(
                cell, nospec if cell.server == "nospec" else profile, priors[prior_name],
                client, policy_path=compare.policy_of(cell, policies, None),
                sim_overrides={"reentry_warmup": True})
            tpot[label] = result["mean_tpot_ms"]
            if label in profiles:
                sim_rows[label, key] = decode_rows(_RECORDED)
        m = cell.mean_tpot_ms
        print(f"| {key[0]} | {key[1]} | {m:.2f} | "
              + " | ".join(f"{tpot[k]:.2f} | {compare.rel(tpot[k], m):+.1%}"
                           for k in ("before", "after", "flagged")) + " |")
    print("\n## Table 2: decode step latency ms by depth and batch band, pooled per policy "
          "and rate (mean | median | p90 | share before a prefill | mean of those)\n")
    print("| policy, rate | servings | depth | band | source | mean | median | p90 "
          "| before a prefill | their mean |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    groups: dict[str, list[tuple]] = defaultdict(list)
    for label, key in sim_rows:
        if label == "before" and key in measured:
            groups[key[1].replace("r12_2", "r12")].append(key)
    for group, keys in sorted(groups.items()):
        sources = {"measured": [row for k in keys for row in decode_rows(measured[k])],
                   **{label: [row for k in keys for row in sim_rows[label, k]]
                      for label in profiles}}
        for depth in (0, 3):
            for band, lo, hi in BANDS:
                for source, rows in sources.items():
                    sel = [r for r in rows if r[0] == depth and lo <= r[1] < hi]
                    if len(sel) < 20 and source == "measured":
                        break
                    print(f"| {group} | {len(keys)} | {depth} | {band} | {source} "
                          f"{summary(sel)}")


if __name__ == "__main__":
    main()

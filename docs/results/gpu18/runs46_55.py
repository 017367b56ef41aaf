#!/usr/bin/env python
"""Runs 46-55 (the MoE @ 2.5 replay at 8 and 6 req/s; the shipped file ``ppo`` and the
candidates served as ``EXTRA_POLICIES``: ``dw`` = ``policy_c45d9410.npz``, ``c585`` =
``policy_58513820.npz``) simulated four ways (``WAYS``): with and without the plugin's
re-entry warm-up (``SchedulerConfig.reentry_warmup``), and with the policy free to run
any depth, or masked to the depths the server offered (0, 1, 3, 5; ``Cell.candidates``,
as the daemon masks them) and held 4 steps after a switch as the plugin holds it
(``compare.py``'s defaults since fid18), against the measured mean TPOT. Usage::

    mkdir -p /tmp/r46 && cp docs/results/h200/offswitch/*run4[6-9]*.json \\
        docs/results/h200/offswitch/*run5[0-5]*.json /tmp/r46/
    PYTHONPATH=$PWD python docs/results/gpu18/runs46_55.py /tmp/r46 \\
        > docs/results/gpu18/runs46_55.md
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts/h200"))

import compare  # noqa: E402
from measured_runs import read_run_dir  # noqa: E402

from env.sim.cost_model import load_profile  # noqa: E402

P = ROOT / "docs/results/h200/fidelity"
#: (label, SchedulerConfig overrides, masked to the server's candidates): the simulator
#: before this session; the policy free but the warm-up simulated (warm17's, opt-in);
#: the server's depths and the plugin's 4-step hold (fid18's, compare.py's default now);
#: those and the warm-up.
WAYS = (("old", {"reentry_warmup": False, "min_switch_steps": 0}, False),
        ("warm-up", {"reentry_warmup": True, "min_switch_steps": 0}, False),
        ("masked+hold", {"reentry_warmup": False}, True),
        ("masked+hold+warm-up", {"reentry_warmup": True}, True))


def main(run_dir: str) -> None:
    """One markdown row per policy cell: measured TPOT, each way's simulated TPOT and error,
    and the off share of the decisions in the last way."""
    profiles = {"moe": load_profile(P / "moe_spec.yaml"),
                "moe.real": load_profile(P / "moe_real_spec.yaml"),
                "moe.nospec": load_profile(P / "moe_real_nospec.yaml")}
    client = OmegaConf.load(P / "client.yaml")
    known = compare.known_policies()
    cells, _ = read_run_dir(run_dir)
    heads = " | ".join(f"{w} ms | err" for w, _, _ in WAYS)
    print(f"| file | policy | prior | measured ms | {heads} | off share (last) |")
    print("|---|---|---|---|" + "---|---|" * len(WAYS) + "---|")
    errors: dict[str, list[float]] = {w: [] for w, _, _ in WAYS}
    for cell in cells:
        if cell.policy != "ppo" and not cell.extra_policy:  # dw, c585: EXTRA_POLICIES files
            continue
        label = cell.policy
        profile = compare.profile_for(cell, profiles)
        prior = load_profile(cell.prior or "h200_llama31_8b_recorded")
        path = compare.policy_of(cell, known, None)
        row = []
        for way, overrides, masked in WAYS:
            run = cell if masked else dataclasses.replace(cell, candidates=None)
            out = compare.simulate(run, profile, prior, client, policy_path=path,
                                   sim_overrides=overrides)
            error = 100 * (out["mean_tpot_ms"] / cell.mean_tpot_ms - 1)
            errors[way].append(error)
            row.append(f"{out['mean_tpot_ms']:.2f} | {error:+.1f}%")
        chosen = out["steps_chosen"]
        print(f"| {cell.source.split(':')[0]} | {label} | {cell.prior} | "
              f"{cell.mean_tpot_ms:.2f} | {' | '.join(row)} | "
              f"{chosen[0] / max(sum(chosen), 1):.2f} |", flush=True)
    print()
    for way, errs in errors.items():
        mean_abs = sum(abs(e) for e in errs) / len(errs)
        print(f"* {way}: mean |TPOT error| {mean_abs:.2f}%, signed {sum(errs) / len(errs):+.2f}%"
              f" over {len(errs)} cells")


if __name__ == "__main__":
    main(sys.argv[1])

#!/usr/bin/env python
"""One-off (seventeenth session): runs 46-50 (the MoE @ 2.5 replay at 6 and 8 req/s, the
shipped file ``ppo`` and ``dw`` = ``docs/results/drop_warmup/policy_c45d9410.npz``, the
shipped file with ``drop_warmup_latency``) simulated with and without the re-entry
warm-up, against the measured mean TPOT. ``compare.py`` skips ``dw`` (an EXTRA_POLICIES
name); here it runs as a ``ppo`` cell with its recorded file and guard. Usage::

    mkdir -p /tmp/r46 && cp docs/results/h200/offswitch/*run4[6-9]*.json \
        docs/results/h200/offswitch/*run50*.json /tmp/r46/
    PYTHONPATH=$PWD python docs/results/warm17/runs46_50.py /tmp/r46
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts/h200"))

import compare  # noqa: E402
from measured_runs import read_run_dir  # noqa: E402

from env.sim.cost_model import load_profile  # noqa: E402

P = ROOT / "docs/results/h200/fidelity"


def main(run_dir: str) -> None:
    """Print one markdown row per simulable cell: measured TPOT, simulated without and
    with the warm-up, the errors, the simulated off share and warm-ups (with)."""
    profiles = {"moe": load_profile(P / "moe_spec.yaml"),
                "moe.real": load_profile(P / "moe_real_spec.yaml"),
                "moe.nospec": load_profile(P / "moe_real_nospec.yaml")}
    client = OmegaConf.load(P / "client.yaml")
    known = compare.known_policies()
    cells, _ = read_run_dir(run_dir)
    print("| file | policy | prior | TPOT ms measured | sim. no warm-up | with | error no "
          "warm-up | with | off share with | warm-ups with |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        if not (compare.simulable(cell.policy) or cell.extra_policy):  # dw: EXTRA_POLICIES
            continue
        label = cell.policy
        profile = compare.profile_for(cell, profiles)
        prior = load_profile(cell.prior or "h200_llama31_8b_recorded")
        path = compare.policy_of(cell, known, None)
        out = {}
        for name, overrides in (("before", {"reentry_warmup": False}), ("after", None)):
            out[name] = compare.simulate(cell, profile, prior, client, policy_path=path,
                                         sim_overrides=overrides)
        after = out["after"]
        chosen = after["steps_chosen"]
        measured = cell.mean_tpot_ms
        print(f"| {cell.source.split(':')[0]} | {label} | {cell.prior} | {measured:.2f} | "
              f"{out['before']['mean_tpot_ms']:.2f} | {after['mean_tpot_ms']:.2f} | "
              f"{100 * (out['before']['mean_tpot_ms'] / measured - 1):+.1f}% | "
              f"{100 * (after['mean_tpot_ms'] / measured - 1):+.1f}% | "
              f"{chosen[0] / max(sum(chosen), 1):.2f} | {after['warmups']} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

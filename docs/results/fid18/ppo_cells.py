#!/usr/bin/env python
"""One-off (eighteenth session): every policy-file cell of runs 37-50 (the MoE @ 2.5
replay at 8 and 6 req/s on ``offswitch.py``'s plugin servers: the shipped file ``ppo``,
and in runs 46-50 ``dw`` = ``docs/results/drop_warmup/policy_c45d9410.npz``) simulated
six ways: every depth of the policy (as before this session) or only the steps the
server offered (``Cell.candidates``: 0, 1, 3, 5), with or without the plugin's hold
between depth switches (``SchedulerConfig.min_switch_steps`` 4), each without and with
the re-entry warm-up; mean TPOT against the measured, the simulated off share and
depth-2 share of the decisions, each the mean over simulator seeds ``0..SEEDS-1`` (the
acceptance draws: the policy's path depends on them). ``dw`` runs as a ``ppo`` cell with
its recorded file and guard (``compare.py`` skips EXTRA_POLICIES names), as
``docs/results/warm17/runs46_50.py``. Usage::

    O=docs/results/h200/offswitch; mkdir -p /tmp/r37
    cp $O/*run3[7-9]*.json $O/*run4[0-9]*.json $O/*run50*.json /tmp/r37/
    PYTHONPATH=$PWD python docs/results/fid18/ppo_cells.py /tmp/r37 [SEEDS] \\
        > docs/results/fid18/ppo_cells[_seedsN].md
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts/h200"))

import compare  # noqa: E402
from measured_runs import read_run_dir  # noqa: E402

from env.sim.cost_model import load_profile  # noqa: E402

P = ROOT / "docs/results/h200/fidelity"
#: (label, the server's steps only, the plugin's switch hold, reentry_warmup)
VARIANTS = (("every depth (before)", False, False, False),
            ("every depth, warm-up (warm17)", False, False, True),
            ("served", True, False, False), ("served, warm-up", True, False, True),
            ("served, hold", True, True, False), ("served, hold, warm-up", True, True, True))


def main(run_dir: str, seeds: int = 1) -> None:
    """One markdown row per policy-file cell, then the mean |TPOT error| per variant."""
    profiles = {"moe": load_profile(P / "moe_spec.yaml"),
                "moe.real": load_profile(P / "moe_real_spec.yaml"),
                "moe.nospec": load_profile(P / "moe_real_nospec.yaml")}
    client = OmegaConf.load(P / "client.yaml")
    known = compare.known_policies()
    cells, _ = read_run_dir(run_dir)
    head = " | ".join(f"{v[0]}: TPOT / error / off / 2" for v in VARIANTS)
    print(f"| run | rate | file | prior | measured TPOT ms | {head} |")
    print("|---" * (5 + len(VARIANTS)) + "|")
    errors: dict[str, dict[str, list[float]]] = {}
    for cell in cells:
        if cell.policy not in ("ppo", "dw"):  # dw: an EXTRA_POLICIES file (Cell.extra_policy)
            continue
        label = cell.policy
        run = re.search(r"_run(\d+)", cell.source)[1]
        profile = compare.profile_for(cell, profiles)
        prior = load_profile(cell.prior or "h200_llama31_8b_recorded")
        path = compare.policy_of(cell, known, None)
        parts = []
        for name, served, hold, warm in VARIANTS:
            c = cell if served else dataclasses.replace(cell, candidates=None)
            overrides = {"reentry_warmup": warm,
                         "min_switch_steps": compare.PLUGIN_MIN_SWITCH_STEPS if hold else 0}
            tpot, off, two = [], [], []
            for seed in range(seeds):
                out = compare.simulate(c, profile, prior, client, seed=seed, policy_path=path,
                                       sim_overrides=overrides)
                chosen = out["steps_chosen"]
                total = max(sum(chosen), 1)
                tpot.append(out["mean_tpot_ms"])
                off.append(chosen[0] / total)
                two.append(chosen[2] / total)
            err = float(np.mean(tpot)) / cell.mean_tpot_ms - 1
            errors.setdefault(name, {}).setdefault(label, []).append(err)
            parts.append(f"{np.mean(tpot):.2f} / {100 * err:+.1f}% / "
                         f"{np.mean(off):.2f} / {np.mean(two):.2f}")
        print(f"| {run} | {cell.rate:g} | {label} | {cell.prior} | {cell.mean_tpot_ms:.2f} | "
              + " | ".join(parts) + " |", flush=True)
    print()
    print("| variant | " + " | ".join(f"{k}: mean abs / signed TPOT error (cells)"
                                       for k in ("ppo", "dw")) + " |")
    print("|---|---|---|")
    for name, per in errors.items():
        cols = []
        for k in ("ppo", "dw"):
            e = np.array(per.get(k, []))
            cols.append(f"{100 * np.abs(e).mean():.2f}% / {100 * e.mean():+.2f}% ({e.size})"
                        if e.size else "-")
        print(f"| {name} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)

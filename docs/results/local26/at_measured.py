"""Run 92 "ppo_2 r6", no profile, open loop: the predicted / measured step latency at the
steps that measured that depth (per band), the shipped file against the candidate, and the
features' expected tokens at depth 3 (the priced goodput's other half).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/local26/at_measured.py CANDIDATE.npz
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import replay_decisions as rd
from servings import RAMP, headline_servings

from controller.policy_file import ExportedPolicy

SHIPPED = Path(__file__).resolve().parents[3] / "controller/data/default_policy.npz"
BANDS = (("<8", 1, 8), ("8-23", 8, 24), (">=24", 24, 10**9))

for policy, steps, _ in headline_servings("moe_acc2.5", 92, "noprofile_ppo_s3_ppo",
                                          [*RAMP, "ppo r6", "static_3 r6", "ppo_2 r6"]):
    if policy not in ("ppo", "ppo_2"):
        continue
    for path in (SHIPPED, Path(sys.argv[1])):
        rows = rd.replay(steps, ExportedPolicy.load(path), None)
        out = {"serving": policy, "file": path.name}
        for band, lo, hi in BANDS:
            sel = [r for r in rows if lo <= r["batch"] < hi]
            cell = {}
            for d in (0, 3):
                at = [r[f"pred{d}_ms"] / r["latency_ms"] for r in sel
                      if r["recorded"] == d and r["latency_ms"] > 0]
                cell[f"pred/meas_d{d}"] = [round(float(np.median(at)), 3), len(at)] if at else None
            # priced goodput ratio g3 = log(tokens3 / tokens0) - log(pred3 / pred0)
            tok = [math.exp(r["g3"]) * r["pred3_ms"] / r["pred0_ms"] for r in sel]
            cell["tokens_d3"] = round(float(np.median(tok)), 3) if tok else None
            out[band] = cell
        print(json.dumps(out), flush=True)

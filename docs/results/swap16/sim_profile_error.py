#!/usr/bin/env python
"""One-off (sixteenth session): what the features compute in the simulator's prediction of
run 44 (``scripts/h200/replay_policies.py --server docs/results/h200/fidelity/moe_real_spec.yaml
--prior PRIOR --acceptance 2.5`` at ``HEADLINE_RATE=8``, policy ``ppo``, seed 0), per
batch-size band: the depths chosen, the profile error (``cost_profile_error``) and the
features' price of depth 3 against off, read from each observation the ``ppo`` adapter
acts on (its ``act`` wrapped, unchanged). Usage::

    HEADLINE_RATE=8 PYTHONPATH=$PWD python docs/results/swap16/sim_profile_error.py
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts/h200"))

from replay_policies import replay  # noqa: E402

from agents.policies import ExportedPolicyAdapter  # noqa: E402
from env.sim.cost_model import load_profile  # noqa: E402

BANDS = (("<8", 0, 8), ("8-23", 8, 24), (">=24", 24, 10**9))
SEEN: list[tuple[int, float, float, float, int]] = []
_act = ExportedPolicyAdapter.act


def _noting_act(self, obs) -> int:
    """The adapter's decision, unchanged; notes the observation's numbers."""
    depth = _act(self, obs)
    names = self.exported.feature_spec.names()
    v = obs.vector
    SEEN.append((obs.batch_size, float(v[names.index("cost_profile_error")]),
                 3.0 * float(v[names.index("relative_goodput_3")]),
                 float(v[names.index("cost_confidence_0")]), depth))
    return depth


ExportedPolicyAdapter.act = _noting_act


def main() -> None:
    """Both priors; print per band the shares and the medians."""
    server = load_profile(str(ROOT / "docs/results/h200/fidelity/moe_real_spec.yaml"))
    out = {}
    for prior in ("h100_llama31_8b", "h200_qwen3_30b_a3b"):
        SEEN.clear()
        result = replay(server, load_profile(prior), 2.5, "ppo", 0)
        rows = np.array(SEEN)
        entry = {"throughput_tok_s": round(result["throughput_tok_s"], 1),
                 "mean_tpot_ms": round(result["mean_tpot_ms"], 2)}
        for band, lo, hi in BANDS:
            sel = rows[(rows[:, 0] >= lo) & (rows[:, 0] < hi)]
            n = len(sel) or 1
            share = Counter(int(d) for d in sel[:, 4])
            entry[band] = {
                "decisions": len(sel),
                "depth_share": {d: round(c / n, 3) for d, c in sorted(share.items())},
                "profile_error_median": round(float(np.median(sel[:, 1])), 3) if len(sel)
                else None,
                "profile_error_p10_p90": [round(float(q), 3) for q in
                                          np.percentile(sel[:, 1], [10, 90])] if len(sel)
                else None,
                "depth3_over_off_goodput_median": round(float(np.exp(np.median(sel[:, 2]))),
                                                        3) if len(sel) else None,
                "conf0_median": round(float(np.median(sel[:, 3])), 3) if len(sel) else None,
            }
        out[prior] = entry
        print(f"## prior {prior}\n{json.dumps(entry, indent=1)}", flush=True)
    (Path(__file__).parent / "sim_profile_error.json").write_text(json.dumps(out, indent=1)
                                                                   + "\n")


if __name__ == "__main__":
    main()

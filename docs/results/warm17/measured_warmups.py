#!/usr/bin/env python
"""One-off (seventeenth session): the warm-ups run 44's two ``ppo`` servings ran on the
real H200 (the plugin's off switch: a depth-0 decode step directly followed by a
speculative one), their cost against the off steps of the same serving, and the decode
steps at each depth. Windows from ``moe_acc2.5_controller_run44.log`` (the ppo reload to
the next reload), as ``docs/results/swap16/replay_decisions.py``. Usage::

    PYTHONPATH=$PWD python docs/results/warm17/measured_warmups.py
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from env.sim.cost_model import load_profile
from env.sim.simulator import WARMUP_LATENCY_FLAGS
from env.traces.trace_format import read_packed_trace

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "docs/results/h200/offswitch/moe_acc2.5_trace_r8r6_run44.tar.gz"
#: The profile compare.py simulates these servings with (``moe.real``).
PROFILE = ROOT / "docs/results/h200/fidelity/moe_real_spec.yaml"
SERVINGS = {"r8": ("2026-12-03 13:02:27.277", "2026-12-03 13:03:09.566"),
            "r6": ("2026-12-03 13:04:33.829", "2026-12-03 13:05:15.754")}


def unix(stamp: str) -> float:
    """A log time stamp (UTC) as unix seconds."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").replace(
        tzinfo=timezone.utc).timestamp()


def main() -> None:
    """Print per serving: decode steps per depth, warm-ups, warm-up vs off cost, and the
    warm-ups' measured latency over the profile's (SGLang's steps=0 with the extend)."""
    profile = load_profile(PROFILE)
    trace = read_packed_trace(TRACE)
    t0 = trace.meta["t0_unix"]
    out = {}
    for name, (start, end) in SERVINGS.items():
        lo, hi = unix(start) - t0, unix(end) - t0
        steps = [r for r in trace.steps if lo <= r.time_s < hi and r.is_decode]
        depth = np.array([r.steps_used for r in steps])
        batch = np.array([r.batch_size for r in steps])
        latency = np.array([r.step_latency_s for r in steps]) * 1e3
        warm = np.zeros(len(steps), dtype=bool)
        warm[:-1] = (depth[:-1] == 0) & (depth[1:] > 0)
        off = (depth == 0) & ~warm
        ratios = []
        for i in np.flatnonzero(warm):  # against off steps at the same batch size
            same = off & (batch == batch[i])
            if same.any():
                ratios.append(latency[i] / np.median(latency[same]))
        predicted = [1e3 * profile.step_latency_s(int(batch[i]), 0, steps[i].kv_used_tokens, 0,
                                                  **WARMUP_LATENCY_FLAGS)
                     for i in np.flatnonzero(warm)]
        out[name] = {
            "decode_steps": len(steps),
            "steps_per_depth": {int(d): int((depth == d).sum()) for d in np.unique(depth)},
            "warmups": int(warm.sum()),
            "warmup_ms_median": float(np.median(latency[warm])) if warm.any() else None,
            "warmup_over_off_same_batch_median": float(np.median(ratios)) if ratios else None,
            "warmup_time_share": float(latency[warm].sum() / latency.sum()),
            "warmup_measured_over_profile": [round(float(m / q), 3) for m, q in
                                             zip(latency[warm], predicted, strict=True)],
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

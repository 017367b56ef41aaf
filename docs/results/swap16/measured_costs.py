#!/usr/bin/env python
"""One-off (sixteenth session): run 44's measured decode latency and accepted tokens at
batch 24-48 per depth (every serving of the trace), against what each profile predicts
there (``CostProfile.step_latency_s`` as the features' prior calls it). Usage::

    PYTHONPATH=$PWD python docs/results/swap16/measured_costs.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from env.sim.cost_model import load_profile
from env.traces.trace_format import read_packed_trace

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "docs/results/h200/offswitch/moe_acc2.5_trace_r8r6_run44.tar.gz"
PROFILES = ("h100_llama31_8b", "h200_qwen3_30b_a3b",
            str(ROOT / "docs/results/h200/fidelity/moe_real_spec.yaml"))


def main() -> None:
    """Print per depth: steps, median batch, kv, latency, tokens per request; predictions."""
    steps = [r for r in read_packed_trace(TRACE).steps
             if r.prefill_tokens == 0 and 24 <= r.batch_size <= 48 and r.step_latency_s > 0]
    profiles = {Path(p).stem: load_profile(p) for p in PROFILES}
    print("| depth | steps | median batch | median latency ms | tokens/request/step | "
          + " | ".join(f"{n} predicts ms" for n in profiles) + " |")
    print("|---|---|---|---|---|" + "---|" * len(profiles))
    for depth in (0, 1, 3, 5):
        sel = [r for r in steps if r.steps_used == depth]
        if not sel:
            continue
        lat = np.median([r.step_latency_s for r in sel]) * 1e3
        batch = int(np.median([r.batch_size for r in sel]))
        kv = int(np.median([r.kv_used_tokens for r in sel]))
        tokens = np.mean([1.0 + (np.mean(r.accepted_drafts) if len(r.accepted_drafts) else 0.0)
                          for r in sel])
        preds = [1e3 * p.step_latency_s(batch, depth, kv, 0, draft_extend=depth > 0,
                                        speculative_path=depth > 0) for p in profiles.values()]
        print(f"| {depth} | {len(sel)} | {batch} | {lat:.2f} | {tokens:.2f} | "
              + " | ".join(f"{x:.2f}" for x in preds) + " |")


if __name__ == "__main__":
    main()

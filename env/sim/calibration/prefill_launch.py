"""The prefill's launch booked on the decode step before it (``CostProfile.prefill_launch_s``,
``prefill_launch_hidden``), fitted on the H200 plugin traces of runs 46-69.

Under SGLang's overlap scheduler a decode step whose next record is a prefill carries the
prefill's launch (the plugin times a step from the previous result to its own).
``docs/results/gpu22/prefill_launch.py`` (output beside it) measures each such step's
extra over the plain steps of its run, depth and batch size: it does not grow with the
prefill's prompt tokens or requests, nor with the queue, and shrinks as the step's own
latency grows (the launch's CPU work hides behind the step's GPU work). Least squares of
``extra = max(0, L - h * own)`` over those steps gives the values below. The H100 and
Blackwell profiles are not given one: no trace there times the step before a prefill.
"""

from __future__ import annotations

from env.sim.cost_model import CostProfile

#: ``(prefill_launch_s, prefill_launch_hidden)`` of the dense Llama-3.1-8B shape on the
#: H200 (runs 61-68: 9,493 steps before a prefill; mean extra 5.7 ms at depth 0, 3.3 at
#: depth 3, none from an own latency of about 22 ms).
H200_DENSE = (0.0080, 0.36)
#: The Qwen3-30B-A3B MoE on the H200 (runs 46-55, 69: 8,295 steps; mean extra 0.7 ms at
#: depth 0, 0.4 at depth 3; L per run 0-2 ms in runs 46-50, 5-6 ms in 51-69).
H200_MOE = (0.0048, 0.24)
SOURCE = "docs/results/gpu22/prefill_launch.txt (table 3)"


def with_prefill_launch(profile: CostProfile, fitted: tuple[float, float]) -> CostProfile:
    """``profile`` with the fitted launch booking and its provenance."""
    launch, hidden = fitted
    provenance = dict(profile.provenance)
    provenance["prefill_launch"] = (
        f"{SOURCE}: max(0, {launch * 1e3:.1f} ms - {hidden} x the decode step's own latency) "
        "booked on the decode step before a prefill, moved from the prefill's cost")
    return profile.replace(prefill_launch_s=launch, prefill_launch_hidden=hidden,
                           provenance=provenance)

"""``h200_qwen3_30b_a3b`` fitted to a trace of the MoE's off server, in real tokens.

The profile shipped until run 4 was fitted by ``specctl-fit-profile`` to an explore trace
recorded with SGLang's default simulated-acceptance tokens (id 100 for every generated
token): on the random-weight MoE every request then routes to the same few experts and
every step is cheaper than on real text (``docs/FIDELITY.md``), and its 256-token prompts
leave the verify-mode KV cost ``c_steps0_kv`` unidentified (it was 0). The off server of
``scripts/h200/offswitch.py off`` decodes the target's own greedy tokens (no simulated
acceptance) and records plain decode steps (sweeps, the replay under constant off),
depth-3 steps (the profiled batch) and every depth while switching: one routing regime
that holds both sides of the off switch, so the off path's cost is fitted directly and
``env.sim.off_cost`` (which splits a steps=0 measurement) is not applied to it.
"""

from __future__ import annotations

from pathlib import Path

from env.sim.calibration.fitting import REPO_DIR
from env.sim.cost_model import CostProfile, FitReport
from env.sim.load_fit import StepArrays, blank_template, fit_server_profile

#: The real-token trace of the MoE's off server (run 4), shipped with the project's results.
MOE_REAL_TRACE = REPO_DIR / "docs" / "results" / "h200" / "offswitch" / "moe_off_trace_run4.tar.gz"


def calibrate_h200_moe(trace: str | Path, shipped: CostProfile) -> tuple[CostProfile, FitReport]:
    """``shipped`` (server limits, model, acceptance) with its costs fitted to ``trace``."""
    model = shipped.model or {}
    try:
        fraction = model["experts_per_token"] / model["experts"]
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise ValueError(f"{shipped.name}: model section needs experts and experts_per_token "
                         f"({exc})") from exc
    steps = StepArrays.load(trace)
    profile, report = fit_server_profile([steps], blank_template(shipped, fraction),
                                         speculative=True)
    trace = Path(trace)
    where = trace.relative_to(REPO_DIR) if trace.is_relative_to(REPO_DIR) else trace
    return profile.replace(
        name=shipped.name,
        description=(
            "SGLang 0.5.15.post1, one H200, Qwen3-30B-A3B shape (MoE, 128 experts, top-8, "
            "bf16, dummy weights) with a one-layer EAGLE-3 head; fitted to every step of a "
            "trace the specctl plugin recorded on the real server decoding real tokens "
            "(plain and speculative steps, one-batch sweeps and the 40 s replay)."),
        provenance={
            "calibrated_to": f"{where} (offswitch.py off: no simulated acceptance, "
                             "--disable-radix-cache --max-running-requests 48)",
            "method": "env.sim.calibration.h200_moe.calibrate_h200_moe "
                      "(env.sim.load_fit.fit_server_profile)",
            "c_kv": "env.sim.load_fit.within_batch_kv_slope of the plain decode steps",
            "fit": report.summary(),
            "template": f"{shipped.name} (server limits, model, acceptance)",
        }), report

"""``h200_qwen3_30b_a3b`` fitted to real-token traces the plugin recorded on the H200 MoE.

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

**Stacked, as ``docs/FIDELITY.md`` run 9 fits the screen's server** (``env.sim.load_fit.
fit_speculative_on_plain``): the plain terms are fitted to the off trace's plain decode and
prefill steps alone (the plugin's off path runs that plain decode), then the verify and
draft terms and ``moe_draft_token_share`` on top, to the speculative decode steps of the
off trace and of ``speculative_traces``. The off trace alone cannot place the
verify-mode KV cost: all its speculative steps hold about 330 cached tokens per request
(fitted alone, ``c_steps0_kv`` comes out 0 and run 9's steps are off by 6.4%), so the
shipped profile adds run 4's real-token replay (its first run; thousands of cached tokens
per request) and run 8's two closed-loop traces (depth 1 and 3 under load), as
``moe_real_spec`` does. Run 9's trace stays held out (:data:`MOE_HELD_OUT_TRACE`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from env.sim.calibration.fitting import REPO_DIR
from env.sim.cost_model import CostProfile, FitReport
from env.sim.load_fit import (
    StepArrays,
    blank_template,
    fit_server_profile,
    fit_speculative_on_plain,
    load_points,
)

_H200 = REPO_DIR / "docs" / "results" / "h200"
#: The real-token trace of the MoE's off server (run 4), shipped with the project's results.
MOE_REAL_TRACE = _H200 / "offswitch" / "moe_off_trace_run4.tar.gz"
#: Real-token traces whose speculative steps join the verify terms' fit, each with the
#: number of runs it holds one after another (the first is fitted): run 4's replay at
#: acceptance 2.5 (static 3 first) and run 8's closed loops at 2.5 and 1.1.
MOE_SPEC_TRACES: tuple[tuple[Path, int], ...] = (
    (_H200 / "offswitch" / "moe_acc2.5_trace_run4.tar.gz", 3),
    (_H200 / "load" / "moe_acc2.5_load_trace_run8.tar.gz", 1),
    (_H200 / "load" / "moe_acc1.1_load_trace_run8.tar.gz", 1),
)
#: Run 9's closed loops at acceptance 2.5: never fitted, the profile's held-out check.
MOE_HELD_OUT_TRACE = _H200 / "load" / "moe_acc2.5_load_trace_run9.tar.gz"


def _where(path: Path) -> str:
    return str(path.relative_to(REPO_DIR) if path.is_relative_to(REPO_DIR) else path)


def calibrate_h200_moe(trace: str | Path, shipped: CostProfile,
                       speculative_traces: Sequence[tuple[str | Path, int]] = (),
                       ) -> tuple[CostProfile, FitReport]:
    """``shipped`` (server limits, model, acceptance) with its costs fitted to ``trace``
    (the off server's: plain terms, then verify terms on top) and the speculative steps of
    ``speculative_traces`` (``(path, runs)``: the first of ``runs`` runs joins the verify
    fit). Returns the profile and the verify fit's report."""
    model = shipped.model or {}
    try:
        fraction = model["experts_per_token"] / model["experts"]
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise ValueError(f"{shipped.name}: model section needs experts and experts_per_token "
                         f"({exc})") from exc
    off = StepArrays.load(trace)
    plain, _ = fit_server_profile([off], blank_template(shipped, fraction),
                                             speculative=False)
    spec_runs = [off] + [StepArrays.load(path).phases(int(runs))[0]
                         for path, runs in speculative_traces]
    profile, report, by_share = fit_speculative_on_plain(spec_runs, plain)
    trace = Path(trace)
    extra = [f"{_where(Path(p))}" + (f" (first of {runs} runs)" if int(runs) > 1 else "")
             for p, runs in speculative_traces]
    return profile.replace(
        name=shipped.name,
        description=(
            "SGLang 0.5.15.post1, one H200, Qwen3-30B-A3B shape (MoE, 128 experts, top-8, "
            "bf16, dummy weights) with a one-layer EAGLE-3 head; the server without "
            "speculation fitted to the plain steps of a trace the specctl plugin recorded "
            "on the real server decoding real tokens, verify and draft terms fitted on top "
            "to the speculative steps of real-token traces."),
        provenance={
            "calibrated_to": f"{_where(trace)} (offswitch.py off: no simulated acceptance, "
                             "--disable-radix-cache --max-running-requests 48)",
            "speculative_steps_from": [_where(trace), *extra],
            "method": "env.sim.calibration.h200_moe.calibrate_h200_moe "
                      "(env.sim.load_fit.fit_server_profile on the plain steps, then "
                      "fit_speculative_on_plain)",
            "c_kv": "env.sim.load_fit.within_batch_kv_slope of the plain decode steps",
            "plain_fit": plain.provenance["fit"],
            "fit": profile.provenance["fit"],
            "moe_draft_token_share": {f"{k:g}": round(v, 4) for k, v in by_share.items()},
            "template": f"{shipped.name} (server limits, model, acceptance)",
        }), report


def held_out_error(profile: CostProfile, trace: str | Path = MOE_HELD_OUT_TRACE) -> FitReport:
    """``profile``'s step-level error on a trace no fit saw (default: run 9's MoE loops)."""
    return FitReport.evaluate(profile, load_points(StepArrays.load(trace)))

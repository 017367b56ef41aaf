"""env.sim.calibration.h200_moe on real-token traces the plugin recorded on the H200."""

from __future__ import annotations

from pathlib import Path

import pytest

from env.sim.calibration.h200_moe import (
    MOE_HELD_OUT_TRACE,
    MOE_SPEC_TRACES,
    calibrate_h200_moe,
    held_out_error,
)
from env.sim.cost_model import load_profile
from env.sim.load_fit import STACKED_SPEC_TERMS, StepArrays, blank_template, fit_server_profile

#: The first session's MoE off server: real tokens, one-batch sweeps and every depth.
TRACE = Path(__file__).resolve().parents[1] / "docs/results/h200/offswitch/moe_off_trace.tar.gz"
#: Run 8's closed loops at acceptance 2.5 (depth 1 and 3 under load, longer contexts).
RUN8 = next(path for path, _ in MOE_SPEC_TRACES if "acc2.5_load_trace_run8" in path.name)
PLAIN_TERMS = ("c_fixed", "c_request", "c_moe", "c_kv", "c_prefill_token")


@pytest.fixture(scope="module")
def off_only():
    return calibrate_h200_moe(TRACE, load_profile("h200_qwen3_30b_a3b"))


def test_a_real_token_trace_gives_the_shipped_profile_both_sides_of_the_off_switch(off_only):
    shipped = load_profile("h200_qwen3_30b_a3b")
    profile, report = off_only
    assert profile.name == shipped.name and profile.server == shipped.server
    assert profile.acceptance == shipped.acceptance
    assert profile.moe_active_fraction == pytest.approx(8 / 128)
    assert "moe_off_trace.tar.gz" in profile.provenance["calibrated_to"]
    assert report.median_abs_error < 0.06
    # in this trace a depth-3 step of 32 requests took 27.8 ms, a plain one 15.6 ms
    off = profile.step_latency_s(32, 0, 10_500, 0, False, False)
    three = profile.step_latency_s(32, 3, 10_500, 0, True, True)
    assert off == pytest.approx(15.6e-3, rel=0.1) and three == pytest.approx(27.8e-3, rel=0.1)


def test_the_plain_terms_are_the_server_without_speculation(off_only):
    # Stacked: the off path costs what a fit to the plain steps alone says, and the
    # speculative steps move only the verify and draft terms.
    shipped = load_profile("h200_qwen3_30b_a3b")
    plain, _ = fit_server_profile([StepArrays.load(TRACE)], blank_template(shipped, 8 / 128),
                                  speculative=False)
    profile, _ = off_only
    for term in PLAIN_TERMS:
        assert getattr(profile, term) == pytest.approx(getattr(plain, term), rel=1e-12), term
    assert set(STACKED_SPEC_TERMS) <= set(profile.provenance["fit"]["free"])
    assert profile.moe_draft_token_share < 1.0  # drafts continue their request's own text


def test_long_context_speculative_steps_place_the_verify_kv_cost(off_only):
    # The off trace's verify steps all hold ~330 cached tokens per request: no KV term.
    with_run8, _ = calibrate_h200_moe(TRACE, load_profile("h200_qwen3_30b_a3b"), [(RUN8, 1)])
    profile, _ = off_only
    assert profile.c_steps0_kv < with_run8.c_steps0_kv
    assert with_run8.c_steps0_kv == pytest.approx(0.8e-6, rel=0.5)  # 0.75-0.8 us measured
    for term in PLAIN_TERMS:
        assert getattr(with_run8, term) == getattr(profile, term), term
    assert any("run8" in s for s in with_run8.provenance["speculative_steps_from"])


def test_the_shipped_profile_predicts_run_9_which_no_fit_saw():
    # docs/FIDELITY.md run 9: the joint fit was off by 7.6-9.2% there, the stacked 2.6-2.7%
    report = held_out_error(load_profile("h200_qwen3_30b_a3b"), MOE_HELD_OUT_TRACE)
    assert report.median_abs_error < 0.04
    assert report.summary()["points"] >= 20


def test_a_profile_without_the_moe_shape_is_refused():
    with pytest.raises(ValueError, match="experts"):
        calibrate_h200_moe(TRACE, load_profile("h200_llama31_8b"))

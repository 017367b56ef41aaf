"""env.sim.calibration.h200_moe on a real-token trace the plugin recorded on the H200."""

from __future__ import annotations

from pathlib import Path

import pytest

from env.sim.calibration.h200_moe import calibrate_h200_moe
from env.sim.cost_model import load_profile

#: The first session's MoE off server: real tokens, one-batch sweeps and every depth.
TRACE = Path(__file__).resolve().parents[1] / "docs/results/h200/offswitch/moe_off_trace.tar.gz"


def test_a_real_token_trace_gives_the_shipped_profile_both_sides_of_the_off_switch():
    shipped = load_profile("h200_qwen3_30b_a3b")
    profile, report = calibrate_h200_moe(TRACE, shipped)
    assert profile.name == shipped.name and profile.server == shipped.server
    assert profile.acceptance == shipped.acceptance
    assert profile.moe_active_fraction == pytest.approx(8 / 128)
    assert "moe_off_trace.tar.gz" in profile.provenance["calibrated_to"]
    assert report.median_abs_error < 0.05
    # in this trace a depth-3 step of 32 requests took 27.8 ms, a plain one 15.6 ms
    off = profile.step_latency_s(32, 0, 10_500, 0, False, False)
    three = profile.step_latency_s(32, 3, 10_500, 0, True, True)
    assert off == pytest.approx(15.6e-3, rel=0.1) and three == pytest.approx(27.8e-3, rel=0.1)
    assert profile.c_steps0_kv > 0


def test_a_profile_without_the_moe_shape_is_refused():
    with pytest.raises(ValueError, match="experts"):
        calibrate_h200_moe(TRACE, load_profile("h200_llama31_8b"))

"""The real off switch's cost: fitted to the H200 measurements, and only what it should move."""

from __future__ import annotations

import numpy as np
import pytest

from env.sim.calibration.h200_moe import MOE_REAL_TRACE
from env.sim.cost_model import load_profile
from env.sim.load_fit import StepArrays, step_medians
from env.sim.off_cost import OffPoints, dense_h200_points, fit_off_path


def test_fit_recovers_a_known_speculative_path_cost():
    truth = load_profile("h200_llama31_8b").replace(c_steps0=0.0012, c_steps0_request=1.5e-4)
    b = np.array([1.0, 8.0, 32.0, 48.0])
    kv = b * 320
    steps0 = truth.step_latency_array(b, 0, kv, 0, True, True)
    off = truth.step_latency_array(b, 0, kv, 0, False, False)
    # The same server described without the split: all of it in c_fixed / c_request.
    merged = truth.replace(c_fixed=truth.c_fixed + truth.c_steps0,
                           c_request=truth.c_request + truth.c_steps0_request,
                           c_steps0=0.0, c_steps0_request=0.0)
    fitted, report = fit_off_path(merged, OffPoints(b, kv, off / steps0, "synthetic"))
    assert fitted.c_steps0 == pytest.approx(truth.c_steps0, rel=1e-6)
    assert fitted.c_steps0_request == pytest.approx(truth.c_steps0_request, rel=1e-6)
    assert all(abs(p["rel_error"]) < 1e-6 for p in report["points"])


def test_fit_leaves_the_verify_kv_cost_where_it_is():
    truth = load_profile("h200_llama31_8b").replace(c_steps0=0.0012, c_steps0_request=1.5e-4,
                                                    c_steps0_kv=5e-7)
    b = np.array([1.0, 8.0, 32.0, 48.0])
    kv = b * 320
    ratio = (truth.step_latency_array(b, 0, kv, 0, False, False)
             / truth.step_latency_array(b, 0, kv, 0, True, True))
    merged = truth.replace(c_fixed=truth.c_fixed + truth.c_steps0,
                           c_request=truth.c_request + truth.c_steps0_request,
                           c_steps0=0.0, c_steps0_request=0.0)
    fitted, _ = fit_off_path(merged, OffPoints(b, kv, ratio, "synthetic"))
    assert fitted.c_steps0 == pytest.approx(truth.c_steps0, rel=1e-6)
    assert fitted.c_steps0_request == pytest.approx(truth.c_steps0_request, rel=1e-6)
    assert fitted.c_steps0_kv == truth.c_steps0_kv


def test_fit_leaves_every_speculative_and_steps0_latency_unchanged():
    before = load_profile("h200_llama31_8b").replace(c_steps0=0.0, c_steps0_request=0.0)
    b = np.array([1.0, 16.0, 64.0])
    points = OffPoints(b, b * 300, np.array([0.8, 0.6, 0.4]), "synthetic")
    after, _ = fit_off_path(before, points)
    grid_b, grid_d = np.meshgrid(np.arange(1, 65), np.arange(8))
    for extend in (True, False):
        np.testing.assert_allclose(
            after.step_latency_array(grid_b, grid_d, grid_b * 500, 0, extend, True),
            before.step_latency_array(grid_b, grid_d, grid_b * 500, 0, extend, True))
    off_before = before.step_latency_array(b, 0, b * 300, 0, False, False)
    assert (after.step_latency_array(b, 0, b * 300, 0, False, False) < off_before).all()


@pytest.mark.parametrize(("name", "points"), [("h200_llama31_8b", dense_h200_points)])
def test_shipped_profiles_reproduce_the_measured_off_vs_steps0_ratios(name, points):
    """Measured on a real H200: TPOT of a server without speculation over that of
    SGLang's steps=0 at the same load. Within 10% per load."""
    try:
        measured = points()
    except FileNotFoundError:
        pytest.skip("shared/measured/h200-sglang-0.5.15-offswitch is not beside this checkout")
    profile = load_profile(name)
    b, kv = measured.batch_size, measured.kv_tokens
    model = (profile.step_latency_array(b, 0, kv, 0, False, False)
             / profile.step_latency_array(b, 0, kv, 0, True, True))
    np.testing.assert_allclose(model, measured.ratio, rtol=0.10)
    # And the measurement's point: off is much cheaper than steps=0 under load.
    assert model[-1] < 0.75


def test_shipped_moe_profile_prices_real_token_off_and_depth3_steps():
    """Measured on a real H200 in one token regime (the MoE's off server, real tokens): the
    median plain (off) and depth-3 step at each batch size both ran, within 10%, and so
    their ratio; off much cheaper than depth 3 at the largest batch."""
    if not MOE_REAL_TRACE.exists():
        pytest.skip(f"{MOE_REAL_TRACE} is not in this checkout")
    steps = StepArrays.load(MOE_REAL_TRACE)
    off, three = step_medians(steps, 0), step_medians(steps, 3)
    batches = sorted(set(off) & set(three))
    assert batches, "the trace has no batch size with both plain and depth-3 steps"
    profile = load_profile("h200_qwen3_30b_a3b")
    for b in batches:
        (off_s, off_kv), (three_s, three_kv) = off[b], three[b]
        model_off = profile.step_latency_s(b, 0, off_kv, 0, False, False)
        model_three = profile.step_latency_s(b, 3, three_kv, 0, True, True)
        assert model_off == pytest.approx(off_s, rel=0.10), f"batch {b}, off"
        assert model_three == pytest.approx(three_s, rel=0.10), f"batch {b}, depth 3"
    assert model_off / model_three < 0.75


def test_off_points_reject_nonsense():
    with pytest.raises(ValueError, match="ratios"):
        OffPoints(np.array([1.0]), np.array([10.0]), np.array([-0.2]), "x")

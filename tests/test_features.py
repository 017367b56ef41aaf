"""The feature module: estimators converge, layouts agree, values stay in the box."""

from __future__ import annotations

import numpy as np
import pytest

from env.cost_model import load_profile
from env.features import FeatureBuilder, FeatureSpec
from env.schema import StepRecord


def _record(i: int, batch: int, depth: int, accepted: np.ndarray, latency: float,
            kv: int = 50_000, prefill: int = 0) -> StepRecord:
    return StepRecord(server="t", rank=0, step_index=i, time_s=0.01 * i, batch_size=batch,
                      waiting_requests=5, running_requests=batch, kv_used_tokens=kv,
                      kv_capacity_tokens=500_000, prefill_tokens=prefill, steps_used=depth,
                      accepted_drafts=accepted, step_latency_s=latency)


def _stream(alphas: np.ndarray, profile, n: int = 600, seed: int = 0):
    """Telemetry of a server whose drafts are accepted position-wise with ``alphas``."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        depth = int(rng.integers(0, len(alphas) + 1))
        batch = int(rng.integers(1, 96))
        if depth:
            accepted_each = rng.random((batch, depth)) < alphas[:depth]
            accepted = np.cumprod(accepted_each, axis=1).sum(axis=1).astype(np.int8)
        else:
            accepted = np.zeros(0, np.int8)
        yield _record(i, batch, depth, accepted, profile.step_latency_s(batch, depth, 50_000, 0))


def test_acceptance_rates_converge_to_the_true_chain_rates():
    alphas = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    # A long window so the test measures the estimator, not the window's noise.
    builder = FeatureBuilder(FeatureSpec(accept_decay=0.9995))
    builder.update_many(_stream(alphas, load_profile("h200_llama31_8b"), n=3000))
    assert np.allclose(builder.accept_rates(), alphas, atol=0.03)


def test_latency_prediction_recovers_the_server_cost_per_depth():
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder()
    builder.update_many(_stream(np.full(7, 0.7), profile))
    predicted = builder.latency_predictions_s(32)
    true = np.array([profile.step_latency_s(32, d, 50_000, 0) for d in range(8)])
    assert np.allclose(predicted, true, rtol=0.06)
    assert (np.diff(predicted) >= 0).all()


def test_grid_rows_equal_single_observations_and_stay_in_the_box():
    builder = FeatureBuilder()
    builder.update_many(_stream(np.full(7, 0.6), load_profile("blackwell_tp8"), n=200))
    grid = builder.observation_grid()
    spec = builder.spec
    assert grid.shape == (len(spec.batch_grid), spec.size)
    for i, batch in enumerate(spec.batch_grid):
        assert np.array_equal(grid[i], builder.observation(batch).vector)
    assert np.array_equal(builder.observation(40).vector, builder.observation(32).vector)
    assert np.abs(grid).max() <= 1.0
    extreme = _record(10_000, 5000, 7, np.full(5000, 7, np.int8), 5.0, kv=10**7)
    extreme.waiting_requests = 10**6
    builder.update(extreme)
    assert np.abs(builder.observation(5000).vector).max() <= 1.0


def test_observation_reports_records_fed_since_the_last_one():
    builder = FeatureBuilder()
    records = list(_stream(np.full(7, 0.5), load_profile("h200_llama31_8b"), n=5))
    builder.update_many(records[:3])
    assert [r.step_index for r in builder.observation().new_records] == [0, 1, 2]
    builder.update_many(records[3:])
    assert [r.step_index for r in builder.observation().new_records] == [3, 4]
    assert builder.observation().new_records == ()


def test_prefill_steps_do_not_move_the_decode_estimators():
    builder = FeatureBuilder()
    builder.update(_record(0, 8, 3, np.array([3, 2, 1, 0, 3, 3, 3, 1], np.int8), 0.01))
    before = builder.observation(8)
    builder.update(_record(1, 4, 0, np.zeros(0, np.int8), 0.5, prefill=4000))
    after = builder.observation(8)
    assert np.array_equal(before.accept_rate, after.accept_rate)
    assert np.array_equal(before.latency_pred_s, after.latency_pred_s)
    assert after.vector[4] > before.vector[4]  # the prefill share rose


def test_spec_round_trip_and_rejects_unknown_fields_and_versions():
    spec = FeatureSpec(max_depth=5)
    assert FeatureSpec.from_dict(spec.to_dict()) == spec
    assert len(spec.names()) == spec.size
    with pytest.raises(ValueError, match="unknown feature-spec fields"):
        FeatureSpec.from_dict({**spec.to_dict(), "colour": 1})
    with pytest.raises(ValueError, match="version"):
        FeatureSpec.from_dict({**spec.to_dict(), "version": 99})

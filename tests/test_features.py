"""The feature module: estimators converge, layouts agree, values stay in the box."""

from __future__ import annotations

import numpy as np
import pytest

from env.features import FeatureBuilder, FeatureSpec, observation_grids
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord


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


@pytest.mark.parametrize("with_profile", [False, True])
def test_batched_grids_equal_each_stream_alone_bit_for_bit(with_profile):
    """The controller computes all pending streams' grids at once; every stream's rows
    must be what it would get alone (and what the environment's observation gives)."""
    profile = load_profile("h200_llama31_8b")
    prior = profile if with_profile else None
    builders = []
    for seed, alpha in enumerate((0.3, 0.6, 0.9)):
        builder = FeatureBuilder(FeatureSpec(), prior)
        builder.update_many(_stream(np.full(7, alpha), profile, n=40 + 30 * seed, seed=seed))
        builders.append(builder)
    builders.append(FeatureBuilder(FeatureSpec(), prior))  # no telemetry yet
    batched = observation_grids(builders)
    for builder in builders:
        builder._theta = None  # solved again, alone
    alone = np.stack([b.observation_grid() for b in builders])
    assert np.array_equal(batched, alone)
    assert not np.array_equal(batched[0], batched[1])  # the streams differ
    spec = builders[0].spec
    for row, batch in ((0, 1), (7, 16), (19, 1024)):
        assert np.array_equal(batched[2, row], builders[2].observation(batch).vector)
        assert spec.batch_grid[row] == batch


def test_batching_refuses_builders_with_other_specs_or_profiles():
    profile = load_profile("h200_llama31_8b")
    with pytest.raises(ValueError, match="share the feature spec and the cost profile"):
        observation_grids([FeatureBuilder(), FeatureBuilder(FeatureSpec(max_depth=5))])
    with pytest.raises(ValueError, match="share the feature spec and the cost profile"):
        observation_grids([FeatureBuilder(), FeatureBuilder(None, profile)])


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


def test_cost_confidence_counts_measured_depths_and_profile_error_shows_a_wrong_profile():
    profile = load_profile("h200_llama31_8b")
    spec = FeatureSpec()
    names = spec.names()
    truth_stream = [_record(i, 16, 3, np.full(16, 2, np.int8),
                            profile.step_latency_s(16, 3, 50_000, 0)) for i in range(200)]
    for prior, expect_flag in ((None, 0.0), (profile, 1.0)):
        builder = FeatureBuilder(spec, prior)
        builder.update_many(truth_stream)
        obs = builder.observation(16)
        vector = dict(zip(names, obs.vector.tolist(), strict=True))
        assert vector["cost_confidence_3"] > 0.5
        assert vector["cost_confidence_0"] == 0.0 and vector["cost_confidence_7"] == 0.0
        assert obs.cost_samples[3] > 50 and obs.cost_samples[[0, 7]].sum() == 0
        assert vector["has_cost_profile"] == expect_flag
        assert abs(vector["cost_profile_error"]) < 0.01
    # A profile that says steps cost half what they do: the error is log(2), not 0.
    halved = profile.replace(**{k: v / 2 for k, v in profile.coefficients.items()})
    builder = FeatureBuilder(spec, halved)
    builder.update_many(truth_stream)
    error = builder.observation(16).vector[names.index("cost_profile_error")]
    assert error == pytest.approx(np.log(2.0), rel=0.02)


def test_off_steps_are_priced_as_the_real_off_switch():
    """With a profile, the prior cost of steps 0 is the server without speculation
    (the plugin's off path), not SGLang's steps=0."""
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(FeatureSpec(), profile)
    predicted = builder.latency_predictions_s(48)[0]
    off = profile.step_latency_s(48, 0, 0, 0, False, False)
    assert predicted == pytest.approx(off, rel=1e-6)
    assert predicted < 0.6 * profile.step_latency_s(48, 0, 0, 0)

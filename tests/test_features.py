"""The feature module: estimators converge, layouts agree, values stay in the box."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from controller.policy_file import ExportedPolicy
from env import features
from env.features import FeatureBuilder, FeatureSpec, observation_grids
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord


@pytest.fixture(autouse=True)
def _layouts_built_afresh():
    """Layouts are cached per spec; each test builds its own (a mutation run forks every
    mutant from a process whose cache is full, which would hide a broken _Layout)."""
    features._layout.cache_clear()


@pytest.fixture(autouse=True, params=["numpy", "compiled"])
def backend(request, monkeypatch):
    """Every test here runs on both implementations (the compiled one needs numba)."""
    if request.param == "compiled":
        pytest.importorskip("numba")
    monkeypatch.setenv(features.BACKEND_VARIABLE, request.param)
    return request.param


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
    if features.compiled_available():
        with pytest.raises(ValueError, match=r"\(and the backend\)$"):
            observation_grids([FeatureBuilder(backend="numpy"),
                               FeatureBuilder(backend="compiled")])


def test_batching_no_builders_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^no feature builders given$"):
        observation_grids([])


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


# -- each estimator by hand, from the definitions in env/features.py's docstring --------


def _step(i: int, depth: int, accepted: list[int], batch: int = 4, latency: float = 0.0,
          **changes) -> StepRecord:
    record = _record(i, batch, depth, np.array(accepted, np.int8), latency)
    for name, value in changes.items():
        setattr(record, name, value)
    return record


def test_acceptance_counts_by_hand():
    """A request that accepted a of d drafts: successes at 1..a, a failure at a+1; each
    position's estimate has the one before as its prior; counts decay per step."""
    spec = FeatureSpec()  # prior 0.7 of strength 4, decay 0.97
    builder = FeatureBuilder(spec)
    builder.update(_step(0, 2, [2, 2, 2, 2]))  # after an off period: left out
    assert builder.accept_rates().tolist() == [0.7] * 7
    builder.update(_step(1, 2, [2, 1, 0, 9]))  # 9 > depth counts as 2
    r1 = (3 + 4 * 0.7) / (4 + 4)  # 3 of 4 accepted the first draft
    r2 = (2 + 4 * r1) / (3 + 4)  # 2 of those 3 the second
    np.testing.assert_allclose(builder.accept_rates(), [r1, r2, r2, r2, r2, r2, r2])
    builder.update(_step(2, 1, [0, 1]))
    trials, successes = np.array([4 * 0.97 + 2, 3 * 0.97]), np.array([3 * 0.97 + 1, 2 * 0.97])
    q1 = (successes[0] + 4 * 0.7) / (trials[0] + 4)
    q2 = (successes[1] + 4 * q1) / (trials[1] + 4)
    obs = builder.observation()
    np.testing.assert_allclose(obs.accept_rate, [q1, q2, q2, q2, q2, q2, q2])
    # E[accepted | d] = sum over k <= d of the chance of reaching and passing position k.
    np.testing.assert_allclose(obs.expected_accepted[:3], [0.0, q1, q1 + q1 * q2])
    names = spec.names()
    vector = dict(zip(names, obs.vector.tolist(), strict=True))
    assert vector["accept_confidence_1"] == pytest.approx(
        np.log1p(trials[0]) / np.log1p(1e4), rel=1e-6)
    assert vector["accept_confidence_3"] == 0.0
    assert vector["log_steps_since_acceptance"] == 0.0


def test_steps_since_acceptance_and_switch_count_steps():
    spec = FeatureSpec()
    builder = FeatureBuilder(spec)
    names = spec.names()
    vector = dict(zip(names, builder.observation().vector.tolist(), strict=True))
    assert vector["log_steps_since_acceptance"] == 1.0  # never: saturated
    for i, depth in enumerate([3, 3, 3, 0, 0, 3, 3]):
        builder.update(_step(i, depth, [1] * 4 if depth else []))
    # Since the switch to 3: two steps at 3 (the switch itself counts 0); acceptance
    # last counted at step 6 (step 5 re-entered from off: left out).
    vector = dict(zip(names, builder.observation().vector.tolist(), strict=True))
    assert vector["log_steps_since_switch"] == pytest.approx(np.log1p(1) / np.log1p(1000))
    assert vector["log_steps_since_acceptance"] == 0.0
    assert vector["steps_used"] == pytest.approx(3 / 7)
    builder.update(_step(7, 0, []))
    builder.update(_step(8, 0, []))
    obs = builder.observation()
    vector = dict(zip(names, obs.vector.tolist(), strict=True))
    assert obs.steps_since_switch == 1 and obs.steps_used == 0
    assert vector["log_steps_since_acceptance"] == pytest.approx(np.log1p(2) / np.log1p(1000))


def test_latency_prior_without_data_or_profile():
    """No measurement: 10 ms at depth 0, +5 % to speculate, +7 % per further draft step."""
    builder = FeatureBuilder()
    expected = 1e-3 * np.array([10.0, 10.5, 11.2, 11.9, 12.6, 13.3, 14.0, 14.7])
    np.testing.assert_allclose(builder.latency_predictions_s(1), expected, rtol=1e-9)
    np.testing.assert_allclose(builder.latency_predictions_s(np.array([8, 500])),
                               [expected, expected], rtol=1e-9)


def test_one_measurement_moves_the_level_not_the_prior_fractions():
    """One 20 ms step at depth 0, batch 64, no KV: the regression fits it exactly, and the
    prior's fractions (of the observed level now) price speculation."""
    builder = FeatureBuilder()
    builder.update(_step(0, 0, [], batch=64, latency=0.020, kv_used_tokens=0))
    np.testing.assert_allclose(builder.latency_predictions_s(64),
                               1e-3 * (20 + np.array([0, 1.0, 2.4, 3.8, 5.2, 6.6, 8.0, 9.4])),
                               rtol=1e-9)
    names = builder.spec.names()
    vector = dict(zip(names, builder.observation().vector.tolist(), strict=True))
    assert vector["log_latency_ms"] == pytest.approx(np.log1p(20) / np.log1p(1000), rel=1e-6)
    assert vector["log_throughput"] == pytest.approx(np.log1p(64 / 0.02) / np.log1p(1e6),
                                                     rel=1e-6)
    # One step measured at depth 0: confidence 1 - exp(-samples / cost_confidence_samples).
    assert vector["cost_confidence_0"] == pytest.approx(
        1 - np.exp(-1 / builder.spec.cost_confidence_samples), rel=1e-6)


@pytest.mark.parametrize("kv", [0, 30_000, 400_000])
def test_with_a_profile_and_no_measurement_the_prediction_is_the_profile(kv):
    """The regression models the residual over the profile, whose prior is 0; steps 0
    is the plugin's off path; the KV term is the profile's at the latest KV use."""
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(FeatureSpec(), profile)
    builder.update(_step(0, 0, [], latency=0.0, kv_used_tokens=kv))  # not measured
    batches = np.array([1, 7, 64, 300])
    expected = [[profile.step_latency_s(b, d, kv, 0, d > 0, d > 0) for d in range(8)]
                for b in batches]
    np.testing.assert_allclose(builder.latency_predictions_s(batches), expected, rtol=1e-9)
    np.testing.assert_allclose(builder.latency_predictions_s(64), expected[2], rtol=1e-9)


def test_predictions_never_fall_with_depth_nor_below_the_floor():
    """A measured speculative step far cheaper than the off steps: the raw fit would say
    deeper is cheaper; the prediction is held flat instead, and above 5 % of the level."""
    builder = FeatureBuilder(FeatureSpec(latency_ridge=1e-6))
    for i in range(50):
        builder.update(_step(i, 0, [], batch=64, latency=0.050, kv_used_tokens=0))
        builder.update(_step(i, 7, [0] * 64, batch=64, latency=0.001, kv_used_tokens=0))
    predicted = builder.latency_predictions_s(64)
    assert (np.diff(predicted) >= 0).all()
    level_ms = builder._latency_ms_ema
    assert predicted.min() >= 0.05 * level_ms * 1e-3 * (1 - 1e-9)
    assert predicted[0] == pytest.approx(0.050, rel=0.05)


def test_load_features_by_hand():
    spec = FeatureSpec()
    names = spec.names()
    builder = FeatureBuilder(spec)
    builder.update(_step(0, 0, [], batch=10, prefill_tokens=500, waiting_requests=30,
                         kv_used_tokens=1000, kv_capacity_tokens=4000))
    builder.update(_step(1, 0, [], batch=10))
    builder.update(_step(2, 0, [], batch=12, waiting_requests=7, kv_used_tokens=3000,
                         kv_capacity_tokens=4000))
    obs = builder.observation()
    vector = dict(zip(names, obs.vector.tolist(), strict=True))
    # EMA (alpha 0.1) of "was a prefill": 1, then 0, 0.
    assert vector["prefill_share"] == pytest.approx(0.1 * 0.9 * 0.9)
    # The batch grew 20 % over its average of 10: the trend's EMA is 0.1 * 0.2, x10.
    assert vector["batch_trend"] == pytest.approx(0.2)
    assert vector["log_batch_size"] == pytest.approx(np.log1p(12) / np.log1p(1024))
    assert vector["log_waiting_requests"] == pytest.approx(np.log1p(7) / np.log1p(4096))
    assert vector["kv_use"] == 0.75 and obs.kv_use == 0.75 and obs.kv_used_tokens == 3000
    assert obs.batch_size == 12 and obs.waiting_requests == 7
    assert builder.observation(13).vector[0] == pytest.approx(np.log1p(12) / np.log1p(1024))
    assert builder.observation(0).vector[0] == pytest.approx(np.log1p(1) / np.log1p(1024))
    assert vector["has_cost_profile"] == 0.0 and vector["cost_profile_error"] == 0.0


def test_relative_latency_and_goodput_by_hand():
    """relative_latency_d = log(l_d / l_0) / 3 and relative_goodput_d =
    (log(1 + E[accepted | d]) - log(l_d / l_0)) / 3, both within [-1, 1]."""
    builder = FeatureBuilder()
    obs = builder.observation(1)
    names = builder.spec.names()
    vector = dict(zip(names, obs.vector.tolist(), strict=True))
    latency = builder.latency_predictions_s(1)
    for d in range(1, 8):
        slower = np.log(latency[d] / latency[0])
        assert vector[f"relative_latency_{d}"] == pytest.approx(slower / 3, rel=1e-5)
        gain = np.log1p(obs.expected_accepted[d]) - slower
        assert vector[f"relative_goodput_{d}"] == pytest.approx(gain / 3, rel=1e-5)


def test_grid_floor():
    spec = FeatureSpec(batch_grid=(2, 8, 64))
    assert [spec.grid_floor(b) for b in (0, 1, 2, 7, 8, 63, 64, 10**6)] == [2, 2, 2, 2, 8, 8,
                                                                              64, 64]
    assert spec.to_dict()["batch_grid"] == [2, 8, 64]
    assert FeatureSpec.from_dict({"batch_grid": [2.0, 8]}).batch_grid == (2, 8)
    assert spec.size == 13 + 5 * 7 == len(spec.names())
    assert FeatureSpec(max_depth=2).names()[-6:] == ["log_throughput", "cost_confidence_0",
                                                     "cost_confidence_1", "cost_confidence_2",
                                                     "has_cost_profile", "cost_profile_error"]


def test_reset_forgets_everything():
    builder = FeatureBuilder()
    fresh = builder.observation().vector
    builder.update_many(_stream(np.full(7, 0.6), load_profile("h200_llama31_8b"), n=30))
    builder.reset()
    assert np.array_equal(builder.observation().vector, fresh)


def _named(builder: FeatureBuilder, batch: int | None = None) -> dict[str, float]:
    obs = builder.observation(batch)
    return dict(zip(builder.spec.names(), obs.vector.tolist(), strict=True))


def test_a_fresh_builder_observes_an_idle_server():
    builder = FeatureBuilder()
    obs = builder.observation()
    assert (obs.batch_size, obs.waiting_requests, obs.kv_use, obs.steps_used,
            obs.steps_since_switch, obs.kv_used_tokens) == (0, 0, 0.0, 0, 0, 0)
    assert obs.vector.dtype == np.float32 and obs.vector.shape == (builder.spec.size,)
    vector = _named(builder)
    for name in ("log_waiting_requests", "kv_use", "batch_trend", "prefill_share",
                 "steps_used", "log_steps_since_switch", "log_latency_ms", "log_throughput",
                 "has_cost_profile", "cost_profile_error", "cost_confidence_0"):
        assert vector[name] == 0.0, name
    assert vector["log_steps_since_acceptance"] == 1.0
    np.testing.assert_array_equal(obs.latency_pred_s, builder.latency_predictions_s(0))


def test_a_decode_step_of_no_request_counts_as_one():
    builder = FeatureBuilder()
    builder.update(_step(0, 0, [], batch=0))
    assert builder.observation().batch_size == 1


def test_the_batch_trend_by_hand_and_its_saturation():
    builder = FeatureBuilder()
    for i, batch in enumerate([1, 2]):  # average 1, then +100 %
        builder.update(_step(i, 0, [], batch=batch))
    assert _named(builder)["batch_trend"] == pytest.approx(10 * 0.1 * 1.0)  # saturated at 1
    builder = FeatureBuilder()
    for i, batch in enumerate([10, 12, 9]):
        builder.update(_step(i, 0, [], batch=batch))
    ema, trend = 10.0, 0.0
    for batch in (12, 9):
        trend += 0.1 * ((batch - ema) / ema - trend)
        ema += 0.1 * (batch - ema)
    assert _named(builder)["batch_trend"] == pytest.approx(10 * trend, rel=1e-6)
    builder = FeatureBuilder()
    for i, batch in enumerate([100] * 5 + [1, 1]):  # a collapse saturates at -1
        builder.update(_step(i, 0, [], batch=batch))
    assert _named(builder)["batch_trend"] == -1.0


def test_the_first_step_after_off_is_left_out_at_any_depth():
    builder = FeatureBuilder()
    builder.update(_step(0, 0, []))
    builder.update(_step(1, 1, [0, 0, 0, 0]))  # re-entry at depth 1: left out
    assert builder.accept_rates()[0] == pytest.approx(0.7)
    builder.update(_step(2, 1, [0, 0, 0, 0]))
    assert builder.accept_rates()[0] == pytest.approx(4 * 0.7 / 8)


def test_steps_since_switch_keeps_counting():
    builder = FeatureBuilder()
    for i in range(6):
        builder.update(_step(i, 2, [1] * 4))
    assert builder.observation().steps_since_switch == 5


def test_cost_samples_and_the_latency_level_are_forgetting_averages():
    spec = FeatureSpec(latency_forgetting=0.5)
    builder = FeatureBuilder(spec)
    for i, latency in enumerate([0.010, 0.020, 0.040]):
        builder.update(_step(i, 3, [1] * 4, latency=latency))
    obs = builder.observation()
    np.testing.assert_allclose(obs.cost_samples, [0, 0, 0, 1.75, 0, 0, 0, 0])  # 1+.5+.25
    level = 10.0 + 0.1 * (20 - 10)
    level += 0.1 * (40 - level)
    rate = 8 / 0.010  # 4 requests + 4 accepted drafts (the first step is a re-entry: still
    rate += 0.1 * (8 / 0.020 - rate)  # tokens); EMA over the steps
    rate += 0.1 * (8 / 0.040 - rate)
    vector = _named(builder)
    assert vector["log_latency_ms"] == pytest.approx(np.log1p(level) / np.log1p(1000), rel=1e-6)
    assert vector["log_throughput"] == pytest.approx(np.log1p(rate) / np.log1p(1e6), rel=1e-6)


def _linear_server_ms(batch: int, depth: int, kv: int) -> float:
    """A server whose latency is exactly linear in the regression's terms."""
    b, s, m = batch / 64, float(depth > 0), max(depth - 1, 0)
    return 4.0 + 3.0 * b + 1.5 * s + 0.5 * s * b + 0.8 * m + 0.3 * m * b + 20.0 * kv / 1e5


def test_the_regression_recovers_a_server_linear_in_its_terms():
    """Batch in units of 64, speculation on, draft steps beyond the first and KV per 1e5
    tokens: such a server is fitted exactly (a tiny ridge, no forgetting)."""
    builder = FeatureBuilder(FeatureSpec(latency_ridge=1e-9, latency_forgetting=1.0))
    rng = np.random.default_rng(0)
    for i in range(300):
        b, d, kv = int(rng.integers(1, 200)), int(rng.integers(0, 8)), int(rng.integers(0, 10**6))
        builder.update(_step(i, d, [0] * b if d else [], batch=b, kv_used_tokens=kv,
                             latency=_linear_server_ms(b, d, kv) / 1e3))
    builder.update(_step(300, 0, [], batch=5, kv_used_tokens=700_000))  # KV now, unmeasured
    for batch in (1, 37, 64, 150):
        expected = [_linear_server_ms(batch, d, 700_000) / 1e3 for d in range(8)]
        np.testing.assert_allclose(builder.latency_predictions_s(batch), expected, rtol=1e-6)


def test_with_a_profile_the_regression_fits_only_the_residual():
    profile = load_profile("h200_llama31_8b")
    rng = np.random.default_rng(1)
    steps = [(int(rng.integers(1, 96)), int(rng.integers(0, 8))) for _ in range(200)]

    def feed(builder, extra_ms: float) -> None:
        for i, (b, d) in enumerate(steps):
            off = d == 0  # the plugin's off path at steps 0
            truth = profile.step_latency_s(b, d, 50_000, 0, not off, not off)
            builder.update(_step(i, d, [0] * b if d else [], batch=b, kv_used_tokens=50_000,
                                 latency=truth + extra_ms / 1e3))

    exact = FeatureBuilder(FeatureSpec(), profile)
    feed(exact, 0.0)
    expected = [profile.step_latency_s(32, d, 50_000, 0, d > 0, d > 0) for d in range(8)]
    np.testing.assert_allclose(exact.latency_predictions_s(32), expected, rtol=1e-9)
    assert _named(exact)["cost_profile_error"] == pytest.approx(0.0, abs=1e-6)
    shifted = FeatureBuilder(FeatureSpec(), profile)
    feed(shifted, 2.0)  # 2 ms more per step than the profile says
    np.testing.assert_allclose(shifted.latency_predictions_s(32), np.add(expected, 2e-3),
                               rtol=2e-2)  # (the ridge pulls toward no residual)


def test_the_profile_error_of_a_fast_server_is_log_ratio_and_saturates():
    """Below 1 ms per step as well; ten times faster than its profile: log(0.1) < -1."""
    base = load_profile("h200_llama31_8b")
    tiny = base.replace(**{k: v / 1e4 for k, v in base.coefficients.items()})  # ~ 1 us
    builder = FeatureBuilder(FeatureSpec(), tiny)
    for i in range(300):
        builder.update(_step(i, 3, [1] * 16, batch=16, kv_used_tokens=0,
                             latency=2 * tiny.step_latency_s(16, 3, 0, 0)))
    assert _named(builder, 16)["cost_profile_error"] == pytest.approx(np.log(2.0), rel=1e-3)
    builder = FeatureBuilder(FeatureSpec(), base)
    for i in range(300):
        builder.update(_step(i, 3, [1] * 16, batch=16, kv_used_tokens=0,
                             latency=0.1 * base.step_latency_s(16, 3, 0, 0)))
    assert _named(builder, 16)["cost_profile_error"] == -1.0


def test_predictions_are_floored_at_5_percent_of_the_level():
    base = load_profile("h200_llama31_8b")
    tiny = base.replace(**{k: v / 1e6 for k, v in base.coefficients.items()})
    builder = FeatureBuilder(FeatureSpec(), tiny)  # no measurement: a 10 ms level
    np.testing.assert_allclose(builder.latency_predictions_s(8), [0.05 * 10.0e-3] * 8)
    # Measured: 20 ms at batch 64, 1 ms at batch 128: extrapolated to 1024 it falls below 0.
    builder = FeatureBuilder(FeatureSpec(latency_ridge=1e-6))
    for i in range(40):
        builder.update(_step(i, 0, [], batch=64 if i % 2 else 128, kv_used_tokens=0,
                             latency=0.020 if i % 2 else 0.001))
    level = builder._latency_ms_ema
    assert 1.0 < level < 20.0
    assert builder.latency_predictions_s(1024)[0] == pytest.approx(0.05 * level * 1e-3)


def test_without_a_profile_kv_moves_nothing_until_measured():
    builder = FeatureBuilder()
    builder.update(_step(0, 0, [], kv_used_tokens=400_000))  # not measured
    expected = 1e-3 * np.array([10.0, 10.5, 11.2, 11.9, 12.6, 13.3, 14.0, 14.7])
    np.testing.assert_allclose(builder.latency_predictions_s(64), expected, rtol=1e-9)


def test_an_off_step_carrying_zero_entries_is_no_acceptance_evidence():
    """The wire lets a steps-0 step carry entries of 0 (none above steps_used): nothing
    was drafted, so the counts neither grow nor decay."""
    builder = FeatureBuilder()
    builder.update(_step(0, 2, [2, 1]))
    builder.update(_step(1, 2, [2, 1]))
    rates = builder.accept_rates()
    builder.update(_step(2, 0, [0, 0, 0, 0]))
    np.testing.assert_array_equal(builder.accept_rates(), rates)
    assert _named(builder)["log_steps_since_acceptance"] > 0


# -- mutation survivors of the batched code (docs/MUTATION.md, env/features.py) -----------


def _twins(lengths: tuple[int, ...], prior=None) -> tuple[list, list]:
    """Two identical sets of builders, stream i fed ``lengths[i]`` records of its own."""
    profile = load_profile("h200_llama31_8b")
    sets = []
    for _ in range(2):
        builders = []
        for seed, n in enumerate(lengths):
            builder = FeatureBuilder(FeatureSpec(), prior)
            builder.update_many(_stream(np.full(7, 0.3 + 0.2 * seed), profile, n=n, seed=seed))
            builders.append(builder)
        sets.append(builders)
    return sets[0], sets[1]


@pytest.mark.parametrize("lengths", [(30, 30), (30, 45, 12), (45, 30, 0), (12, 30, 45)])
def test_batched_folding_equals_each_stream_folded_alone(lengths):
    """Streams with equal or unequal pending records, folded together in one call, end
    with the regression of twins that never met another stream (checked on the twins'
    own, independently folded state, not on state the batched call left behind)."""
    batched, alone = _twins(lengths)
    grids = observation_grids(batched)
    for i, twin in enumerate(alone):
        np.testing.assert_array_equal(grids[i], twin.observation_grid())
        np.testing.assert_array_equal(batched[i].latency_predictions_s(np.array([1, 64, 700])),
                                      twin.latency_predictions_s(np.array([1, 64, 700])))


def test_batching_some_stale_and_some_solved_streams():
    """Only the streams with new telemetry are solved again; each keeps its own latency
    level as the prior's scale, and two solved streams are not given the first's fit."""
    batched, alone = _twins((40, 25, 60))
    for i in (0, 2):  # solved alone first: not stale in the batch below
        batched[i].observation()
    extra = list(_stream(np.full(7, 0.5), load_profile("blackwell_tp8"), n=7, seed=9))
    batched[1].update_many(extra)
    alone[1].update_many(extra)
    grids = observation_grids(batched)
    for i, twin in enumerate(alone):
        np.testing.assert_array_equal(grids[i], twin.observation_grid())
        np.testing.assert_array_equal(batched[i].latency_predictions_s(64),
                                      twin.latency_predictions_s(64))
    solved = observation_grids([batched[0], batched[2]])  # neither stale
    np.testing.assert_array_equal(solved, np.stack([grids[0], grids[2]]))
    assert not np.array_equal(solved[0], solved[1])


def test_the_latency_regression_forgets_old_steps():
    """Depth 0 at one batch size: the prediction is the forgetting-weighted mean of the
    measured latencies (weights forgetting**age; a tiny ridge)."""
    spec = FeatureSpec(latency_forgetting=0.5, latency_ridge=1e-9)
    builder = FeatureBuilder(spec)
    latencies = [0.010] * 20 + [0.030]
    for i, latency in enumerate(latencies):
        builder.update(_step(i, 0, [], batch=64, latency=latency, kv_used_tokens=0))
    weights = 0.5 ** np.arange(len(latencies))[::-1]
    expected = float(np.dot(weights, latencies) / weights.sum())
    assert builder.latency_predictions_s(64)[0] == pytest.approx(expected, rel=1e-6)


def test_the_vector_carries_the_acceptance_rates_unscaled():
    """accept_rate_k in the vector is the rate itself (the first below 1/2 here, so neither
    a doubling nor a halving could hide behind the box clip)."""
    builder = FeatureBuilder()
    for i in range(30):
        builder.update(_step(i, 3, [0, 0, 0, 0, 1, 2, 3]))
    obs = builder.observation()
    assert 0.1 < obs.accept_rate[0] < 0.5
    vector = _named(builder)
    for k in range(1, 8):
        assert vector[f"accept_rate_{k}"] == pytest.approx(obs.accept_rate[k - 1], rel=1e-6)


def test_observation_reports_the_profile_error_unclipped():
    """Observation.cost_profile_error is the EMA (alpha 0.1) of log(measured / profile)."""
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(FeatureSpec(), profile)
    builder.update(_step(0, 2, [1] * 16, batch=16, kv_used_tokens=0,
                         latency=3 * profile.step_latency_s(16, 2, 0, 0)))
    obs = builder.observation()
    assert obs.cost_profile_error == pytest.approx(0.1 * np.log(3.0), rel=1e-9)
    assert _named(builder)["cost_profile_error"] == pytest.approx(0.1 * np.log(3.0), rel=1e-6)


@pytest.mark.parametrize("with_profile", [False, True])
def test_a_copy_goes_on_alone(with_profile):
    """copy(): the same observations as the original now, and afterwards each folds its
    own records only (nothing mutable shared)."""
    profile = load_profile("h200_llama31_8b")
    prior = profile if with_profile else None
    records = list(_stream(np.full(7, 0.6), profile, n=60, seed=3))
    original, twin = FeatureBuilder(FeatureSpec(), prior), FeatureBuilder(FeatureSpec(), prior)
    for builder in (original, twin):
        builder.update_many(records[:40])  # some folded below, some left pending
    original.observation_grid()
    twin.observation_grid()
    original.update_many(records[40:45])
    twin.update_many(records[40:45])
    copy = original.copy()
    assert type(copy) is type(original) and copy.cost_prior is original.cost_prior
    np.testing.assert_array_equal(copy.observation_grid(), twin.observation_grid())
    copy.update_many(records[45:])  # the copy moves on; the original must not
    assert copy.observation().new_records == tuple(records[45:])
    assert original.observation().new_records == tuple(records[40:45])  # its own only
    np.testing.assert_array_equal(original.observation_grid(), twin.observation_grid())
    twin.update_many(records[45:])
    np.testing.assert_array_equal(copy.observation_grid(), twin.observation_grid())


@pytest.mark.parametrize("name", ["numpy", "compiled"])
def test_resolve_backend_takes_the_argument_over_the_environment(name, monkeypatch):
    if name == "compiled":
        pytest.importorskip("numba")
    other = "compiled" if name == "numpy" else "numpy"
    monkeypatch.setenv(features.BACKEND_VARIABLE, other)
    assert features.resolve_backend(name) == name
    assert FeatureBuilder(backend=name).backend == name
    monkeypatch.setenv(features.BACKEND_VARIABLE, name)
    assert features.resolve_backend() == name
    assert FeatureBuilder().backend == name


@pytest.mark.parametrize("numba_here", [True, False])
def test_resolve_backend_default_follows_numba(numba_here, monkeypatch):
    monkeypatch.delenv(features.BACKEND_VARIABLE)
    monkeypatch.setattr(features, "compiled_available", lambda: numba_here)
    expected = "compiled" if numba_here else "numpy"
    assert features.resolve_backend() == expected
    monkeypatch.setenv(features.BACKEND_VARIABLE, "")  # set but empty: the default too
    assert features.resolve_backend(None) == expected
    assert features.resolve_backend("") == expected


def test_resolve_backend_names_the_bad_source_and_the_choices(monkeypatch):
    expected = " unknown feature backend 'numba' (expected 'compiled' or 'numpy')"
    with pytest.raises(ValueError) as error:
        features.resolve_backend("numba")
    assert str(error.value) == "backend:" + expected
    monkeypatch.setenv(features.BACKEND_VARIABLE, "numba")
    with pytest.raises(ValueError) as error:
        FeatureBuilder()
    assert str(error.value) == f"environment variable {features.BACKEND_VARIABLE}:" + expected


def test_compiled_without_numba_is_refused(monkeypatch):
    monkeypatch.setattr(features, "compiled_available", lambda: False)
    assert features.resolve_backend("numpy") == "numpy"
    for ask in ({"backend": "compiled"}, {}):
        monkeypatch.setenv(features.BACKEND_VARIABLE, "compiled")
        with pytest.raises(ValueError) as error:
            features.resolve_backend(**ask)
        assert str(error.value) == ("feature backend 'compiled' needs numba, which is not "
                                    "installed (pip install numba, or choose 'numpy')")


def test_compiled_available_is_false_when_numba_does_not_import(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "numba", None)  # import raises
    assert features.compiled_available.__wrapped__() is False
    monkeypatch.undo()
    assert features.compiled_available.__wrapped__() is (
        __import__("importlib").util.find_spec("numba") is not None)


def _kernel_signatures(monkeypatch) -> set[tuple]:
    """Spy on the compiled kernels called from Python: the numba types of their arguments
    (a new tuple is a compilation at that call)."""
    numba = pytest.importorskip("numba")
    from env import features_compiled

    seen: set[tuple] = set()
    # Not _solve: _fold calls it compiled, and a Python spy there would not type.
    for name in ("_fold", "_grids"):
        kernel = getattr(features_compiled, name)

        def spy(*args, _kernel=kernel, _name=name):
            seen.add((_name, *(numba.typeof(a) for a in args)))
            return _kernel(*args)

        monkeypatch.setattr(features_compiled, name, spy)
    return seen


def test_warm_up_compiles_every_kernel_signature_a_stream_uses(backend, monkeypatch):
    """warm_up's promise: nothing compiles at the first decision. Every kernel call of a
    real stream (decoded read-only drafts, simulated ones, one poll of several streams,
    one observation) has argument types that warm_up already called it with."""
    profile = load_profile("h200_llama31_8b")
    if backend == "numpy":
        assert features.warm_up(cost_prior=profile) is None  # nothing to compile
        return
    # Compiled before the spies go in: _fold_probed calls _fold compiled, and compiling
    # it with a Python spy in _fold's place fails (it passed only on a warm numba cache).
    features.warm_up(cost_prior=profile, backend="compiled")
    seen = _kernel_signatures(monkeypatch)
    monkeypatch.setenv(features.BACKEND_VARIABLE, "numpy")  # the argument decides
    features.warm_up(cost_prior=profile, backend="compiled")
    monkeypatch.setenv(features.BACKEND_VARIABLE, "compiled")
    warmed = set(seen)
    assert {name for name, *_ in warmed} == {"_fold", "_grids"}
    seen.clear()
    builders = [FeatureBuilder(cost_prior=profile) for _ in range(3)]
    drafts = np.array([2, 0, 5], dtype=np.int8)
    decoded = np.frombuffer(drafts.tobytes(), dtype=np.int8)  # as the wire decodes it
    for i, accepted in enumerate((drafts, decoded)):
        builders[0].update(_record(i, 16, 3, accepted, 0.02))
        builders[1].update(_record(i, 8, 4, accepted, 0.03))
    observation_grids(builders)
    builders[1].observation()
    assert seen and seen <= warmed, seen - warmed


def test_the_layouts_batch_grid_is_read_only():
    """The compiled backend knows the grid by identity (it caches what it derives from
    it), so nothing may write into it."""
    grid = FeatureBuilder()._layout.grid
    assert list(grid) == list(FeatureSpec().batch_grid)
    with pytest.raises(ValueError, match="read-only"):
        grid[0] = 3


# -- latency_model 2: off's own level, batch slope and KV term (twelfth session) --------


def _run(builder: FeatureBuilder, steps, first: int = 0) -> int:
    """Feed (batch, depth, latency_s, kv) steps; returns the next step index."""
    for i, (batch, depth, latency, kv) in enumerate(steps, start=first):
        builder.update(_step(i, depth, [0] * batch if depth else [], batch=batch,
                             latency=latency, kv_used_tokens=kv))
    return first + len(steps)


@pytest.mark.parametrize("with_profile", [False, True])
def test_model_2_speculative_steps_leave_off_s_prediction_alone(with_profile):
    """Off measured at batches 8-64, then 400 depth-2 steps: with a profile, however slow
    they are, off's prediction is the same (model 2), without one they move it only
    through the prior's ties (less); in model 1 they move it (the eleventh session's cause 2: a
    long speculative run moved off's prediction with it)."""
    profile = load_profile("h200_llama31_8b") if with_profile else None
    rng = np.random.default_rng(3)
    off = [(int(b), 0, 0.010 + 0.0002 * int(b), 40_000 + 100 * i)
           for i, b in enumerate(rng.integers(8, 65, size=60))]
    spec_steps = [(int(b), 2, 0.0, 50_000 + 100 * i)
                  for i, b in enumerate(rng.integers(8, 65, size=400))]
    predictions = {}
    for model in (1, 2):
        for slow in (1.0, 3.0):
            builder = FeatureBuilder(FeatureSpec(latency_model=model), profile)
            at = _run(builder, off)
            _run(builder, [(b, d, slow * (0.02 + 0.001 * b), kv)
                           for b, d, _, kv in spec_steps], at)
            predictions[model, slow] = builder.latency_predictions_s(np.array([16, 64]))
    moved = {model: predictions[model, 3.0][:, 0] / predictions[model, 1.0][:, 0]
             for model in (1, 2)}
    if with_profile:  # the residual's prior is 0 for every term: nothing ties them
        np.testing.assert_allclose(moved[2], 1.0, rtol=1e-12)
    else:  # only through the prior's ties (weight latency_ridge against off's decayed
        # steps: here off's batch slope, which its 60 steps pin down least, moves by ~20%)
        assert (abs(moved[2] - 1.0) < 0.3).all(), moved
    # the speculative depth's own prediction follows its steps (3x slower)
    assert (predictions[2, 3.0][:, 2] > 2.5 * predictions[2, 1.0][:, 2]).all()
    assert (abs(moved[1] - 1.0) > 0.15).all(), moved


def _tied_server_ms(batch: int, depth: int) -> float:
    """A server whose costs follow model 2's prior ties exactly: off 8 ms + 2 ms per 64
    requests (token_prior_fraction 0.25), speculating +5 %, 2 ms per 64 verify tokens,
    +7 % of off's level per further draft step."""
    b, m = batch / 64, max(depth - 1, 0)
    if depth == 0:
        return 8.0 + 2.0 * b
    return 8.0 * 1.05 + 2.0 * (depth + 1) * b + 0.07 * 8.0 * m


def test_model_2_prices_off_from_a_speculative_run_by_its_verify_tokens():
    """No profile, only depth 3 measured (at batches 8-64): off's price follows from the
    ties (the verify tokens), where model 1 prices off at the run's level less 5 % and
    the draft steps' 7 %s."""
    rng = np.random.default_rng(4)
    steps = [(int(b), 3, _tied_server_ms(int(b), 3) / 1e3, 0)
             for b in rng.integers(8, 65, size=300)]
    truth = np.array([[_tied_server_ms(b, d) for d in range(8)] for b in (16, 64)]) / 1e3
    got = {}
    for model in (1, 2):
        builder = FeatureBuilder(FeatureSpec(latency_model=model))
        _run(builder, steps)
        got[model] = builder.latency_predictions_s(np.array([16, 64]))
    np.testing.assert_allclose(got[2], truth, rtol=0.05)  # the level prior pulls a little
    assert (got[1][:, 0] > 1.4 * truth[:, 0]).all()  # off priced near the run's level


def test_model_2_without_telemetry_prices_speculation_by_its_verify_tokens():
    """The prior alone: off 10 ms (the unmeasured level) + 25 % per 64 requests; a depth
    d costs 5 % more than off's level, its (d + 1) x batch verify tokens at off's
    per-token price, and 7 % of off's level per further draft step."""
    builder = FeatureBuilder(FeatureSpec(latency_model=2))
    for batch in (1, 64, 256):
        b = batch / 64
        expected = [10.0 + 2.5 * b] + [10.5 + 2.5 * (d + 1) * b + 0.7 * (d - 1)
                                       for d in range(1, 8)]
        np.testing.assert_allclose(builder.latency_predictions_s(batch),
                                   np.array(expected) / 1e3, rtol=1e-9)


def test_the_latency_model_is_checked():
    with pytest.raises(ValueError, match="latency_model"):
        FeatureSpec(latency_model=4)
    assert FeatureSpec.from_dict({"latency_model": 2}).latency_model == 2
    assert FeatureSpec.from_dict({}).latency_model == 1  # a file from before the field


@pytest.mark.parametrize("with_profile", [False, True])
def test_model_3_is_model_2_with_a_profile_and_model_1_without(with_profile):
    profile = load_profile("h200_llama31_8b") if with_profile else None
    rng = np.random.default_rng(5)
    steps = [(int(b), int(d), 0.01 + 0.0003 * int(b) * (1 + int(d)), 1000 * i)
             for i, (b, d) in enumerate(zip(rng.integers(1, 65, size=200),
                                            rng.integers(0, 4, size=200), strict=True))]
    grids = {}
    for model in (1, 2, 3):
        builder = FeatureBuilder(FeatureSpec(latency_model=model), profile)
        _run(builder, steps)
        grids[model] = builder.observation_grid()
    np.testing.assert_array_equal(grids[3], grids[2 if with_profile else 1])
    assert not np.array_equal(grids[1], grids[2])


def _profile_ms(profile, batch: int, depth: int, kv: int) -> float:
    return 1e3 * profile.step_latency_s(batch, depth, kv, 0, draft_extend=depth > 0,
                                        speculative_path=depth > 0)


def _exact_steps(profile, count: int) -> list[tuple]:
    """Decode steps at batch 1-8 of 300-token requests, off and depth 3 alternating in
    runs of 10, each at the profile's own latency."""
    steps = []
    for i in range(count):
        batch, depth = 1 + i % 8, 3 if (i // 10) % 2 else 0
        kv = 300 * batch
        steps.append((batch, depth, _profile_ms(profile, batch, depth, kv) / 1e3, kv))
    return steps


@pytest.mark.parametrize("model", [1, 3])
def test_one_stalled_step_enters_the_latency_estimators_at_the_outlier_ratio(model):
    """Run 32 (a fresh H200): one depth-3 step of 112 ms among 4-7 ms ones, a first-use
    stall, priced depth 3 above off and left the policy off for 3.5 s. With
    ``latency_outlier_ratio`` such a step counts as that ratio times the profile's
    prediction: its cost estimates equal those of a stream whose step took exactly that
    (the measured throughput keeps the stall: it is what the server served)."""
    profile = load_profile("h200_qwen3_30b_a3b")
    steps = _exact_steps(profile, 60)
    batch, kv = 1, 300
    prior_s = _profile_ms(profile, batch, 3, kv) / 1e3
    grids = {}
    for ratio, stall_s in ((0.0, 0.112), (3.0, 0.112), (3.0, 3.0 * prior_s)):
        builder = FeatureBuilder(FeatureSpec(latency_model=model,
                                             latency_outlier_ratio=ratio), profile)
        at = _run(builder, steps)
        _run(builder, [(batch, 3, stall_s, kv)], at)
        grids[ratio, stall_s] = (builder.observation(batch).cost_profile_error,
                                 builder.latency_predictions_s(np.array([1, 8]))[0])
    clipped, exact = grids[3.0, 0.112], grids[3.0, 3.0 * prior_s]
    assert clipped[0] == exact[0]
    np.testing.assert_array_equal(clipped[1], exact[1])
    unclipped = grids[0.0, 0.112][1]
    # the stall moves depth 3's predicted cost far more unclipped than clipped
    assert unclipped[3] - clipped[1][3] > 5 * (clipped[1][3] - prior_s), (unclipped, clipped)


def test_a_profile_far_off_is_learned_from_unclipped_steps():
    """A server 5x slower than the handed profile (another server's) is not a stream of
    outliers: once the mean log error passes ``latency_outlier_trust`` the steps enter
    whole, and the predictions follow the server as without the clip."""
    profile = load_profile("h200_qwen3_30b_a3b")
    slow = [(b, d, 5.0 * latency, kv) for b, d, latency, kv in _exact_steps(profile, 400)]
    predictions = {}
    for ratio in (0.0, 3.0):
        builder = FeatureBuilder(FeatureSpec(latency_model=3, latency_outlier_ratio=ratio),
                                 profile)
        _run(builder, slow)
        assert builder.observation(4).cost_profile_error > 0.5
        predictions[ratio] = builder.latency_predictions_s(np.array([4]))[0]
    kv = slow[-1][3]  # the predictions are at the latest KV use
    truth = np.array([5.0 * _profile_ms(profile, 4, d, kv) / 1e3 for d in (0, 3)])
    np.testing.assert_allclose(predictions[3.0][[0, 3]], truth, rtol=0.1)
    np.testing.assert_allclose(predictions[3.0], predictions[0.0], rtol=0.02)


def test_a_stall_among_the_first_steps_enters_whole():
    """Before ``latency_outlier_warmup`` measured steps the mean log error says nothing
    yet about the profile (another server's looks like a run of stalls at first): the
    steps enter whole, as with the clip off."""
    profile = load_profile("h200_qwen3_30b_a3b")
    steps = [*_exact_steps(profile, 5), (1, 3, 0.112, 300)]
    predictions = []
    for ratio in (0.0, 3.0):
        builder = FeatureBuilder(FeatureSpec(latency_model=3, latency_outlier_ratio=ratio),
                                 profile)
        _run(builder, steps)
        predictions.append(builder.latency_predictions_s(np.array([1, 8])))
    np.testing.assert_array_equal(predictions[0], predictions[1])


RELATIVE = FeatureSpec(latency_model=3, latency_outlier_ratio=3.0,
                       latency_outlier_relative=True)


def _early_predictions(spec: FeatureSpec, profile, steps) -> np.ndarray:
    builder = FeatureBuilder(spec, profile)
    _run(builder, steps)
    return builder.latency_predictions_s(np.array([1, 8, 16]))


@pytest.mark.parametrize("depth", [0, 3, 5])
def test_relative_clip_takes_a_lone_early_stall_at_the_ratio(depth):
    """Runs 49, 51, 60 (H200): a fresh stream met an 83-210 ms step at its fourth record,
    among steps the profile priced right, before the warm-up armed the clip. With
    ``latency_outlier_relative`` it enters at the ratio times the profile's price (the
    earlier steps measured the profile's price: their mean ratio is 1), exactly as a
    stream whose step took that; without the field it enters whole."""
    profile = load_profile("h200_qwen3_30b_a3b")
    exact = _exact_steps(profile, 3)
    batch, kv = 4, 1200
    prior_s = _profile_ms(profile, batch, depth, kv) / 1e3
    stalled = [*exact, (batch, depth, 0.150, kv)]
    at_ratio = [*exact, (batch, depth, 3.0 * prior_s, kv)]
    clipped = _early_predictions(RELATIVE, profile, stalled)
    np.testing.assert_allclose(clipped, _early_predictions(RELATIVE, profile, at_ratio),
                               rtol=1e-9)
    whole = _early_predictions(replace(RELATIVE, latency_outlier_relative=False), profile,
                               stalled)
    assert np.all(whole[:, depth] > 1.5 * clipped[:, depth]), (whole, clipped)


def test_relative_clip_takes_uniformly_dear_early_steps_whole():
    """Another server's profile: every early step 4-6x the profile's price. Each is within
    the ratio of the steps before it, so all enter whole (as with the clip off), where
    the clip armed from the second step (``latency_outlier_warmup: 1``) takes them in at
    3x and the estimates lag the server."""
    profile = load_profile("h200_qwen3_30b_a3b")
    factors = [5.0, 6.0, 4.0, 5.5, 4.5, 6.0, 5.0, 4.0]
    dear = [(b, d, f * latency, kv)
            for (b, d, latency, kv), f in zip(_exact_steps(profile, 8), factors, strict=True)]
    unclipped = _early_predictions(replace(RELATIVE, latency_outlier_ratio=0.0), profile, dear)
    np.testing.assert_array_equal(_early_predictions(RELATIVE, profile, dear), unclipped)
    armed = replace(RELATIVE, latency_outlier_relative=False, latency_outlier_warmup=1.0)
    assert not np.allclose(_early_predictions(armed, profile, dear), unclipped, rtol=0.05)


def test_relative_clip_judges_a_step_against_dear_earlier_steps():
    """Among steps 2x the profile's price, a step at 5x the profile's (2.5x the stream's
    own) enters whole; a stall (over 3 x 2x) is clipped, at 3x the profile's price as
    after the warm-up."""
    profile = load_profile("h200_qwen3_30b_a3b")
    spec = replace(RELATIVE, latency_outlier_trust=5.0)  # not judged by the mean error
    twice = [(b, d, 2.0 * latency, kv) for b, d, latency, kv in _exact_steps(profile, 3)]
    batch, kv = 4, 1200
    prior_s = _profile_ms(profile, batch, 0, kv) / 1e3
    dear = [*twice, (batch, 0, 5.0 * prior_s, kv)]
    np.testing.assert_array_equal(
        _early_predictions(spec, profile, dear),
        _early_predictions(replace(spec, latency_outlier_relative=False), profile, dear))
    np.testing.assert_allclose(
        _early_predictions(spec, profile, [*twice, (batch, 0, 0.5, kv)]),
        _early_predictions(spec, profile, [*twice, (batch, 0, 3.0 * prior_s, kv)]),
        rtol=1e-9)


def test_relative_clip_never_clips_under_the_ratio_times_the_profile():
    """Earlier steps at half the profile's price: a step at 2.5x the profile's (5x the
    stream's own) enters whole, and a stall is clipped at 3x the profile's, not at 3x
    the stream's: the clip needs both bounds passed, as the clip after the warm-up never
    takes a step under the ratio times the profile."""
    profile = load_profile("h200_qwen3_30b_a3b")
    half = [(b, d, 0.5 * latency, kv) for b, d, latency, kv in _exact_steps(profile, 3)]
    batch, kv = 4, 1200
    prior_s = _profile_ms(profile, batch, 0, kv) / 1e3
    off = replace(RELATIVE, latency_outlier_relative=False)
    dear = [*half, (batch, 0, 2.5 * prior_s, kv)]
    np.testing.assert_array_equal(_early_predictions(RELATIVE, profile, dear),
                                  _early_predictions(off, profile, dear))
    np.testing.assert_allclose(
        _early_predictions(RELATIVE, profile, [*half, (batch, 0, 0.5, kv)]),
        _early_predictions(RELATIVE, profile, [*half, (batch, 0, 3.0 * prior_s, kv)]),
        rtol=1e-9)


def test_relative_clip_takes_a_first_step_whole():
    """A stream's first measured step has nothing to be judged against: a stall there
    enters whole, as without the field."""
    profile = load_profile("h200_qwen3_30b_a3b")
    steps = [(4, 5, 0.150, 1200), *_exact_steps(profile, 3)]
    np.testing.assert_array_equal(
        _early_predictions(RELATIVE, profile, steps),
        _early_predictions(replace(RELATIVE, latency_outlier_relative=False), profile, steps))


@pytest.mark.parametrize("field", ["latency_outlier_relative", "latency_drop_before_prefill"])
def test_a_later_bool_field_is_false_in_an_old_file_and_must_be_a_bool(field):
    """Every policy file before the field (the one shipped when both came, kept under
    docs/results/off_probe/) reads it False."""
    data = replace(FeatureSpec(), **{field: True}).to_dict()
    del data[field]
    assert getattr(FeatureSpec.from_dict(data), field) is False
    before = ExportedPolicy.load("docs/results/off_probe/policy_3dd256a8.npz")
    assert getattr(before.feature_spec, field) is False
    with pytest.raises(ValueError, match=field):
        FeatureSpec(**{field: 1})


@pytest.mark.parametrize("field, value", [
    ("latency_outlier_warmup", 0.0), ("latency_outlier_ratio", 1.0),
    ("latency_outlier_ratio", -2.0),
    ("latency_outlier_ratio", float("nan")), ("latency_outlier_ratio", True),
    ("latency_outlier_ratio", "3"), ("latency_outlier_trust", 0.0),
    ("latency_outlier_trust", float("inf")),
])
def test_outlier_settings_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        FeatureSpec(**{field: value})


def _local_pair(profile, steps, samples: float = 1.0,
                cap: bool = False) -> tuple[FeatureBuilder, FeatureBuilder]:
    """Two builders fed ``steps`` (see _run), model 3, without and with the local
    measured-cost correction."""
    pair = []
    for local in (0.0, samples):
        builder = FeatureBuilder(FeatureSpec(latency_model=3, latency_local_samples=local,
                                             latency_local_cap=cap), profile)
        _run(builder, steps)
        pair.append(builder)
    return pair[0], pair[1]


def test_the_local_correction_prices_a_depth_measured_nearby_as_measured():
    """Issue 9 (docs/POLICY.md "cause 3"): a server whose depth 3 costs 2.5x the handed
    profile's prediction and depths 1-2 what the profile says, run at depth 1, then 3,
    then 2, all at batch 32. The shared residual terms cannot hold that per-depth error
    (they are affine in the depth): the regression prices depth 1, measured 300 steps
    ago, at under half its cost. With the correction every depth run is priced within
    5% of its measurements, while a batch size far from any (512) keeps the regression's
    prediction, bit for bit."""
    profile = load_profile("h200_llama31_8b")
    kv = 32 * 600

    def truth(depth: int) -> float:
        return (2.5 if depth == 3 else 1.0) * _profile_ms(profile, 32, depth, kv) / 1e3

    steps = ([(32, 1, truth(1), kv)] * 100 + [(32, 3, truth(3), kv)] * 100
             + [(32, 2, truth(2), kv)] * 200)
    plain, local = _local_pair(profile, steps)
    want = np.array([truth(d) for d in (1, 2, 3)])
    uncorrected = plain.latency_predictions_s(32)[1:4]
    assert uncorrected[0] < 0.6 * want[0], uncorrected / want
    np.testing.assert_allclose(local.latency_predictions_s(32)[1:4], want, rtol=0.05)
    np.testing.assert_array_equal(local.latency_predictions_s(512),
                                  plain.latency_predictions_s(512))


def test_the_local_correction_by_hand():
    """One off step at batch 8 measured at e^0.7 times the profile: off's prediction at
    batch 8 (bucket 3) moves toward the measurement in log space by 1 - exp(-1 / k),
    at batch 16 (the neighbouring bucket, half weight) by 1 - exp(-0.5 / k), at batch 32
    not at all; without a profile the setting changes nothing."""
    profile = load_profile("h200_llama31_8b")
    kv = 4000
    measured = math.exp(0.7) * _profile_ms(profile, 8, 0, kv) / 1e3
    plain, local = _local_pair(profile, [(8, 0, measured, kv)], samples=2.0)
    for batch, weight in ((8, -math.expm1(-1 / 2.0)), (16, -math.expm1(-0.5 / 2.0)),
                          (32, 0.0)):
        target = math.exp(0.7) * _profile_ms(profile, batch, 0, kv) / 1e3
        before = plain.latency_predictions_s(batch)[0]
        want = before * math.exp(weight * (math.log(target) - math.log(before)))
        assert local.latency_predictions_s(batch)[0] == pytest.approx(want, rel=1e-9)
    steps = [(8, 0, measured, kv), (8, 2, 2 * measured, kv)]
    plain, local = _local_pair(None, steps)
    np.testing.assert_array_equal(local.observation_grid(), plain.observation_grid())


def test_the_local_correction_forgets_as_the_regression_forgets():
    """A measurement's weight decays by ``latency_forgetting`` per later decode step
    (here 200 steps at another batch bucket): its pull shrinks as its count does."""
    profile = load_profile("h200_llama31_8b")
    kv = 4000
    measured = math.exp(0.7) * _profile_ms(profile, 8, 0, kv) / 1e3
    far = _profile_ms(profile, 256, 0, kv) / 1e3
    steps = [(8, 0, measured, kv)] + [(256, 0, far, kv)] * 200
    plain, local = _local_pair(profile, steps, samples=2.0)
    count = FeatureSpec().latency_forgetting ** 200
    weight = -math.expm1(-count / 2.0)
    target = math.exp(0.7) * _profile_ms(profile, 8, 0, kv) / 1e3
    before = plain.latency_predictions_s(8)[0]
    want = before * math.exp(weight * (math.log(target) - math.log(before)))
    assert local.latency_predictions_s(8)[0] == pytest.approx(want, rel=1e-9)


def test_a_depth_measured_nearby_bounds_the_unmeasured_depths_both_ways():
    """The fourteenth session's h100_llama31_8b trace with another server's profile:
    depth 6, measured at 48 ms, priced at 77 ms because depth 1, never run, was guessed
    there and a deeper draft is never priced below a shallower one. Here off and depth
    5 (at 0.3x the profile) are measured at batch 64, depths 1-4 guessed about twice as
    high: with the correction depth 5 is priced as measured and the unmeasured deeper
    depths no lower; with ``latency_local_cap`` the unmeasured shallower depths no
    higher than it either (h200_llama31_8b at seed 3: depth 3 priced above the measured
    depth 6 kept the policy at 6 where 3 serves 1.17x), without it they keep their
    guess; off, measured, keeps its own price."""
    profile = load_profile("h200_llama31_8b")
    kv = 64 * 600
    depth5 = 0.3 * _profile_ms(profile, 64, 5, kv) / 1e3
    steps = [(64, 0, _profile_ms(profile, 64, 0, kv) / 1e3, kv)] * 20 + [(64, 5, depth5, kv)] * 3
    plain, local = _local_pair(profile, steps, samples=0.5, cap=True)
    _, uncapped = _local_pair(profile, steps, samples=0.5)
    guessed, priced = plain.latency_predictions_s(64), local.latency_predictions_s(64)
    assert guessed[1] > 1.8 * depth5 and guessed[5] > 1.8 * depth5
    for predictions in (priced, uncapped.latency_predictions_s(64)):
        assert predictions[5] == pytest.approx(depth5, rel=0.02)
        assert predictions[6] >= predictions[5] and predictions[7] >= predictions[6]
        assert predictions[0] == pytest.approx(guessed[0], rel=1e-6)
    assert all(priced[d] <= priced[5] * (1 + 1e-12) for d in range(1, 5))
    np.testing.assert_array_equal(uncapped.latency_predictions_s(64)[1:5], guessed[1:5])


def test_the_local_tolerance_corrects_only_beyond_it():
    """``latency_local_tolerance``: the prediction moves by the weight times the part of
    its log distance to the measured target beyond the tolerance, toward the target;
    within it, not at all."""
    profile = load_profile("h200_llama31_8b")
    kv = 4000
    for error in (0.7, -0.7, 0.1):
        measured = math.exp(error) * _profile_ms(profile, 8, 0, kv) / 1e3
        steps = [(8, 0, measured, kv)]
        predictions = {}
        for tolerance in (0.0, 0.3):
            spec = FeatureSpec(latency_model=3, latency_local_samples=2.0,
                               latency_local_tolerance=tolerance)
            builder = FeatureBuilder(spec, profile)
            _run(builder, steps)
            predictions[tolerance] = builder.latency_predictions_s(8)[0]
        plain, _ = _local_pair(profile, steps)
        before = plain.latency_predictions_s(8)[0]
        gap = math.log(measured) - math.log(before)
        beyond = math.copysign(max(abs(gap) - 0.3, 0.0), gap)
        weight = -math.expm1(-1 / 2.0)
        assert predictions[0.3] == pytest.approx(before * math.exp(weight * beyond), rel=1e-9)
        assert predictions[0.0] == pytest.approx(before * math.exp(weight * gap), rel=1e-9)


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), True, "1"])
@pytest.mark.parametrize("field", ["latency_local_samples", "latency_local_tolerance"])
def test_a_bad_local_correction_setting_is_refused_by_name(value, field):
    with pytest.raises(ValueError, match=field):
        FeatureSpec(**{field: value})


@pytest.mark.parametrize("value", [1, 0.0, "true", None])
def test_the_local_cap_must_be_a_bool(value):
    with pytest.raises(ValueError, match="latency_local_cap"):
        FeatureSpec(latency_local_cap=value)


def test_the_local_correction_keeps_the_observation_layout_and_round_trips():
    """The shipped weights read the vector by position: the settings change values, never
    the layout, and travel in a policy file's spec."""
    spec = FeatureSpec(latency_model=3, latency_local_samples=0.5,
                       latency_local_tolerance=0.2, latency_local_cap=True)
    assert spec.names() == FeatureSpec().names() and spec.size == FeatureSpec().size
    assert FeatureSpec.from_dict(spec.to_dict()) == spec
    old = {k: v for k, v in spec.to_dict().items() if not k.startswith("latency_local")}
    assert FeatureSpec.from_dict(old) == FeatureSpec(latency_model=3)

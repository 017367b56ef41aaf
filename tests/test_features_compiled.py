"""The compiled features (numba) against the numpy implementation: same observations.

The two differ only in float rounding (a hand-written 7 x 7 solve instead of LAPACK's,
libm's logarithms instead of numpy's): every vector entry within 1e-6 (in the box
[-1, 1], float32), every float64 estimate within 1e-9 relative, every count equal.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env import features
from env.features import FeatureBuilder, FeatureSpec, observation_grids, resolve_backend
from env.sim.cost_model import COEFFICIENTS, CostProfile, ServerLimits, load_profile
from env.traces.schema import StepRecord

pytest.importorskip("numba")

PROFILE = load_profile("h200_llama31_8b")
SPEC = FeatureSpec()
#: Both latency regressions (FeatureSpec.latency_model): the compiled kernels branch on it.
SPECS = (SPEC, FeatureSpec(latency_model=2), FeatureSpec(latency_model=3),
         # the outlier clip (the drawn latencies, 0.1 ms to 2 s, are often far off the profile)
         FeatureSpec(latency_model=3, latency_outlier_ratio=3.0),
         FeatureSpec(latency_outlier_ratio=1.5, latency_outlier_trust=2.0),
         # ... judged before its warm-up against the stream's own earlier steps
         FeatureSpec(latency_model=3, latency_outlier_ratio=3.0, latency_outlier_relative=True),
         FeatureSpec(latency_outlier_ratio=1.5, latency_outlier_trust=2.0,
                     latency_outlier_warmup=30.0, latency_outlier_relative=True),
         # the local measured-cost correction (with a profile; without one it is off)
         FeatureSpec(latency_model=3, latency_local_samples=1.0, latency_local_cap=True),
         FeatureSpec(latency_local_samples=0.5, latency_outlier_ratio=3.0,
                     latency_local_tolerance=0.2),
         # the re-entry warm-up: inferred, and read from the records' flag where they
         # carry one (the flagged warm-up's restart sets the compiled state's depth)
         FeatureSpec(latency_model=3, drop_warmup_latency=True, warmup_restarts_draft=True),
         FeatureSpec(latency_model=3, drop_warmup_latency=True, warmup_restarts_draft=True,
                     warmup_flag=True),
         FeatureSpec(drop_warmup_latency=True, warmup_flag=True),
         # a decode step's latency left out where the next record is a prefill (the hold
         # is shared Python; the compiled fold must see the same records), alone and with
         # the warm-up's own hold
         FeatureSpec(latency_drop_before_prefill=True, latency_outlier_ratio=3.0),
         FeatureSpec(latency_model=3, latency_drop_before_prefill=True,
                     drop_warmup_latency=True, warmup_restarts_draft=True),
         # the off ceiling rising with off's own (unflagged) steps: the shipped file's
         # estimators, and with the ceiling's batch threshold beside the local correction
         FeatureSpec(latency_model=3, latency_outlier_ratio=3.0,
                     latency_drop_before_prefill=True, latency_off_ceiling=0.1,
                     latency_off_ceiling_samples=2.0),
         FeatureSpec(latency_off_ceiling=0.2, latency_off_ceiling_batch=24.0,
                     latency_off_ceiling_samples=0.5, latency_local_samples=1.0))


@st.composite
def records(draw, max_steps: int = 9) -> list[StepRecord]:
    """A telemetry stream: decode steps at random depths (some beyond max_depth), prefills,
    unmeasured latencies, idle and full KV caches; the re-entry warm-up flag unknown, known,
    or a warm-up on a depth-0 decode step."""
    out = []
    # The drafts' values from a drawn seed: hundreds of drawn integers per record would
    # exceed hypothesis's data budget.
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    for i in range(draw(st.integers(1, 40))):
        prefill = draw(st.sampled_from([0, 0, 0, 0, 512]))
        steps = 0 if prefill else draw(st.integers(0, max_steps))
        batch = draw(st.integers(0, 300))
        if steps and batch:
            accepted = rng.integers(0, steps + 1, size=batch).astype(np.int8)
        else:
            accepted = np.zeros(0, dtype=np.int8)
        latency = draw(st.one_of(st.just(0.0), st.floats(1e-4, 2.0)))
        kv = draw(st.integers(0, 1_000_000))
        warmup = draw(st.sampled_from([None, False, True]))
        out.append(StepRecord("s", 0, i, 0.01 * i, batch, draw(st.integers(0, 5000)), batch,
                              kv, 1_000_000, prefill, steps, accepted, latency,
                              warmup=warmup and not (steps or prefill)))
    return out


def _twins(prior, spec: FeatureSpec = SPEC) -> tuple[FeatureBuilder, FeatureBuilder]:
    return (FeatureBuilder(spec, prior, backend="numpy"),
            FeatureBuilder(spec, prior, backend="compiled"))


def _assert_same(reference: FeatureBuilder, compiled: FeatureBuilder, batch: int) -> None:
    want, got = reference.observation(batch), compiled.observation(batch)
    np.testing.assert_allclose(got.vector, want.vector, rtol=0, atol=1e-6)
    for name in ("batch_size", "waiting_requests", "kv_use", "steps_used",
                 "steps_since_switch", "kv_used_tokens"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("accept_rate", "expected_accepted", "latency_pred_s", "cost_samples",
                 "cost_profile_error"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-9,
                                   atol=1e-12, err_msg=name)
    assert got.new_records == want.new_records


@settings(max_examples=60, deadline=None)
@given(stream=records(), with_profile=st.booleans(), batch=st.integers(0, 2000),
       every=st.integers(1, 7), spec=st.sampled_from(SPECS))
def test_compiled_observations_equal_numpy_ones(stream, with_profile, batch, every, spec):
    reference, compiled = _twins(PROFILE if with_profile else None, spec)
    for i, record in enumerate(stream):
        reference.update(record)
        compiled.update(record)
        if i % every == 0:
            _assert_same(reference, compiled, batch)
    _assert_same(reference, compiled, batch)
    np.testing.assert_allclose(compiled.observation_grid(), reference.observation_grid(),
                               rtol=0, atol=1e-6)
    np.testing.assert_allclose(compiled.accept_rates(), reference.accept_rates(), rtol=1e-12)
    sizes = np.array([1, batch + 1, 4096])
    np.testing.assert_allclose(compiled.latency_predictions_s(sizes),
                               reference.latency_predictions_s(sizes), rtol=1e-9)


@settings(max_examples=25, deadline=None)
@given(streams=st.lists(records(), min_size=2, max_size=5), with_profile=st.booleans(),
       spec=st.sampled_from(SPECS))
def test_compiled_batches_equal_numpy_batches(streams, with_profile, spec):
    """Several streams in one call, as the daemon computes a poll's decisions."""
    prior = PROFILE if with_profile else None
    pairs = [_twins(prior, spec) for _ in streams]
    for (reference, compiled), stream in zip(pairs, streams, strict=True):
        for record in stream:
            reference.update(record)
            compiled.update(record)
    want = observation_grids([reference for reference, _ in pairs])
    got = observation_grids([compiled for _, compiled in pairs])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    for i, (_, compiled) in enumerate(pairs):  # batching stays invisible, bit for bit
        np.testing.assert_array_equal(got[i], compiled.observation_grid())


def test_a_negative_accepted_count_is_refused_by_both():
    for builder in _twins(None):
        with pytest.raises(ValueError, match="negative"):
            builder.update(StepRecord("s", 0, 1, 0.0, 2, 0, 2, 0, 10, 0, 3,
                                      np.array([1, -1], dtype=np.int8), 0.01))


def test_non_integer_accepted_counts_are_refused_by_both():
    for builder in _twins(None):
        with pytest.raises(TypeError, match="float64"):  # each names the dtype it got
            builder.update(StepRecord("s", 0, 1, 0.0, 2, 0, 2, 0, 10, 0, 3,
                                      np.array([1.0, 2.0]), 0.01))


def test_the_backend_is_chosen_by_argument_then_environment(monkeypatch):
    monkeypatch.setenv(features.BACKEND_VARIABLE, "numpy")
    assert type(FeatureBuilder()).backend == "numpy"
    assert FeatureBuilder(backend="compiled").backend == "compiled"
    monkeypatch.setenv(features.BACKEND_VARIABLE, "compiled")
    assert FeatureBuilder().backend == "compiled"
    assert FeatureBuilder(backend="numpy").backend == "numpy"
    monkeypatch.delenv(features.BACKEND_VARIABLE)
    assert resolve_backend() == "compiled"  # numba is installed here
    monkeypatch.setenv(features.BACKEND_VARIABLE, "fortran")
    with pytest.raises(ValueError, match=r"^environment variable SPECCTL_FEATURES: "
                                         r"unknown feature backend 'fortran'"):
        FeatureBuilder()
    with pytest.raises(ValueError, match=r"^backend: unknown feature backend 'c'"):
        FeatureBuilder(backend="c")


def test_a_reset_compiled_builder_is_a_fresh_one():
    used, fresh = FeatureBuilder(backend="compiled"), FeatureBuilder(backend="compiled")
    used.update(StepRecord("s", 0, 1, 0.0, 8, 3, 8, 100, 1000, 0, 3,
                           np.array([3, 1, 0, 2, 3, 3, 0, 1], dtype=np.int8), 0.02))
    assert not np.array_equal(used.observation_grid(), fresh.observation_grid())
    used.reset()
    np.testing.assert_array_equal(used.observation_grid(), fresh.observation_grid())
    np.testing.assert_array_equal(used._state, fresh._state)


_COEFFICIENT = st.one_of(st.just(0.0), st.floats(1e-9, 1e-1), st.floats(1e-7, 1e-5))


@st.composite
def profiles(draw) -> CostProfile:
    """A cost profile with any of its terms zero or not, dense or MoE (a draft token's
    expert share 1 or less), with or without a CUDA-graph batch limit."""
    values = {name: draw(_COEFFICIENT) for name in COEFFICIENTS}
    moe = draw(st.sampled_from([0.0, 1.0, 1, 0.125, 0.5]))
    share = draw(st.sampled_from([1.0, 0.0, 0.3]))
    graph = draw(st.sampled_from([None, 1, 64, 512]))
    return CostProfile("drawn", ServerLimits(256, 10**6, 8192, graph), **values,
                       moe_active_fraction=moe, moe_draft_token_share=share)


@settings(max_examples=200, deadline=None)
@given(profile=profiles(), batch=st.integers(1, 5000), depth=st.integers(0, 7),
       kv=st.integers(0, 10**7))
def test_the_compiled_prior_is_the_profiles_own_bit_for_bit(profile, batch, depth, kv):
    """The compiled fold's prior (features_compiled._profile_ms) is the Python fold's
    ``1e3 * step_latency_s(...)`` exactly: the same float64 operations in the same order."""
    from env.features_compiled import _profile_ms, _profile_vector

    want = 1e3 * profile.step_latency_s(batch, depth, kv, 0, draft_extend=depth > 0,
                                        speculative_path=depth > 0)
    assert _profile_ms(_profile_vector(profile), batch, depth, kv) == want


class _Wrapped:
    """A cost prior that is not a CostProfile: the compiled builder calls its
    step_latency_s in Python (and the features read its other attributes)."""

    def __init__(self, profile: CostProfile) -> None:
        self._profile = profile

    def __getattr__(self, name):
        return getattr(self._profile, name)


@settings(max_examples=30, deadline=None)
@given(stream=records(), profile=st.sampled_from(["h200_llama31_8b", "h200_qwen3_30b_a3b"]),
       spec=st.sampled_from(SPECS))
def test_a_profile_folded_compiled_or_in_python_gives_the_same_state(stream, profile, spec):
    """The prior computed inside the compiled fold (a CostProfile) and handed to it from
    Python (any other prior object) fold every record to the same state, bit for bit."""
    prior = load_profile(profile)
    inside = FeatureBuilder(spec, prior, backend="compiled")
    python = FeatureBuilder(spec, _Wrapped(prior), backend="compiled")
    assert inside._profile.shape[0] and not python._profile.shape[0]
    for record in stream:
        inside.update(record)
        python.update(record)
        np.testing.assert_array_equal(inside._state, python._state)
    np.testing.assert_array_equal(inside.observation_grid(), python.observation_grid())


def test_builders_share_grid_inputs_only_with_their_own_spec_and_profile():
    """The compiled builders of one spec and one cost prior share _grid_inputs' cache; a
    builder of another prior (or none) or another spec computes its own: each grid equals
    the one a builder computes with every cache empty."""
    from env import features_compiled

    priors = (load_profile("h200_llama31_8b"), load_profile("h200_qwen3_30b_a3b"), None)
    specs = (SPEC, FeatureSpec(latency_model=2))
    record = StepRecord("s", 0, 1, 0.0, 24, 3, 24, 200_000, 10**6, 0, 3,
                        np.array([3, 1, 0, 2] * 6, dtype=np.int8), 0.02)
    grids = {}
    for spec in specs:
        for prior in priors:
            features_compiled._inputs_caches.clear()
            alone = FeatureBuilder(spec, prior, backend="compiled")
            alone.update(record)
            grids[spec, id(prior)] = alone.observation_grid()
    features_compiled._inputs_caches.clear()
    shared = [FeatureBuilder(spec, prior, backend="compiled") for _ in range(2)
              for spec in specs for prior in priors]
    for builder in shared:
        builder.update(record)
        np.testing.assert_array_equal(builder.observation_grid(),
                                      grids[builder.spec, id(builder.cost_prior)])
    first = shared[0]
    assert shared[len(specs) * len(priors)]._inputs_cache is first._inputs_cache
    assert sum(b._inputs_cache is first._inputs_cache for b in shared) == 2

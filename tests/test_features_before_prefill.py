"""``FeatureSpec.latency_drop_before_prefill``: a decode step whose next record is a
prefill enters the estimators without its latency (it carries that prefill's launch under
SGLang's overlap scheduler), one record late."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder, FeatureSpec
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

PROFILE = load_profile("h200_llama31_8b_recorded")
SPEC = FeatureSpec(latency_outlier_ratio=3.0)
DROP = dataclasses.replace(SPEC, latency_drop_before_prefill=True)


def _decode(i: int, batch: int, depth: int, latency_ms: float) -> StepRecord:
    accepted = np.full(batch if depth else 0, min(depth, 2), np.int8)
    return StepRecord("s", 0, i, 0.01 * i, batch, 3, batch, 1500 * batch, 700_000, 0, depth,
                      accepted, latency_ms / 1e3)


def _prefill(i: int, latency_ms: float = 13.0) -> StepRecord:
    return StepRecord("s", 0, i, 0.01 * i, 1, 2, 48, 72_000, 700_000, 1024, 0,
                      np.zeros(0, np.int8), latency_ms / 1e3)


def _served(seed: int, n: int = 400) -> list[StepRecord]:
    """Batch 40-48 at depth 0 or 3 with an admission every ~5 steps: the decode step
    before each prefill about 9 ms dearer, as measured on the H200 (runs 61-64)."""
    rng = np.random.default_rng(seed)
    out: list[StepRecord] = []
    depth = 0
    while len(out) < n:
        if rng.random() < 0.1:
            depth = 3 - depth
        batch = int(rng.integers(40, 49))
        clean = 7.2 if depth == 0 else 29.0
        if rng.random() < 0.2:
            out.append(_decode(len(out), batch, depth, clean + 9.0))
            out.append(_prefill(len(out)))
        else:
            out.append(_decode(len(out), batch, depth, clean * rng.uniform(0.95, 1.05)))
    out.append(_prefill(len(out)))  # the last decode step's fate known
    return out


def _zeroed(records: list[StepRecord]) -> list[StepRecord]:
    """``records`` with each decode step before a prefill unmeasured (latency 0)."""
    return [dataclasses.replace(r, step_latency_s=0.0)
            if r.prefill_tokens == 0 and nxt is not None and nxt.prefill_tokens > 0 else r
            for r, nxt in zip(records, [*records[1:], None], strict=True)]


@pytest.mark.parametrize("backend", ["numpy", "compiled"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_step_before_a_prefill_enters_unmeasured(backend, seed):
    """Fed a stream, the builder equals one without the rule fed the same stream with
    each decode step before a prefill unmeasured."""
    if backend == "compiled":
        pytest.importorskip("numba")
    stream = _served(seed)
    held = FeatureBuilder(DROP, PROFILE, backend=backend)
    held.update_many(stream)
    plain = FeatureBuilder(SPEC, PROFILE, backend=backend)
    plain.update_many(_zeroed(stream))
    np.testing.assert_array_equal(held.observation_grid(), plain.observation_grid())
    np.testing.assert_array_equal(held.latency_predictions_s(np.array([8, 24, 48])),
                                  plain.latency_predictions_s(np.array([8, 24, 48])))


def test_a_decode_record_is_folded_when_the_next_arrives():
    """The observation lags one decode record: after it, the features are those before
    it; after the next decode record, those of the first folded whole."""
    stream = _served(3, n=60)[:-1]
    stream = [r for r in stream if r.prefill_tokens == 0]
    held = FeatureBuilder(DROP, PROFILE)
    plain = FeatureBuilder(SPEC, PROFILE)
    for record in stream[:-1]:
        held.update(record)
        before = held.observation_grid().copy()
        plain.update(record)
    held.update(stream[-1])
    np.testing.assert_array_equal(held.observation_grid(), plain.observation_grid())
    assert not np.array_equal(before, held.observation_grid())


def test_it_prices_off_as_measured_where_admissions_make_it_dear():
    """The case it is for: off at batch 48 priced near its clean 7.2 ms with the rule,
    above it without (the admissions' 9 ms counted as off's)."""
    stream = _served(4, n=800)
    prices = {}
    for name, spec in (("plain", SPEC), ("drop", DROP)):
        builder = FeatureBuilder(spec, PROFILE)
        builder.update_many(stream)
        prices[name] = 1e3 * builder.latency_predictions_s(48)[0]
    assert abs(prices["drop"] - 7.2) < 0.5
    assert prices["plain"] > prices["drop"] + 0.8


@pytest.mark.parametrize("backend", ["numpy", "compiled"])
def test_a_copy_carries_the_held_record_and_a_reset_drops_it(backend):
    if backend == "compiled":
        pytest.importorskip("numba")
    stream = [r for r in _served(5, n=30) if r.prefill_tokens == 0]
    builder = FeatureBuilder(DROP, PROFILE, backend=backend)
    builder.update_many(stream[:-1])  # the last of these is held, not folded
    copy, fresh = builder.copy(), FeatureBuilder(DROP, PROFILE, backend=backend)
    fresh.update_many(stream[:-1])
    copy.update(stream[-1])
    fresh.update(stream[-1])
    np.testing.assert_array_equal(copy.observation_grid(), fresh.observation_grid())
    builder.reset()  # a held record left behind would be folded by the next update
    builder.update_many(stream[-3:])
    fresh = FeatureBuilder(DROP, PROFILE, backend=backend)
    fresh.update_many(stream[-3:])
    np.testing.assert_array_equal(builder.observation_grid(), fresh.observation_grid())


def test_the_twenty_first_sessions_file_is_the_one_before_with_only_the_rule_on():
    """The default policy of the twenty-first and twenty-second sessions (``5c3d9060``,
    served as ``adm`` in runs 65-69): the file shipped before (``3dd256a8``) with this rule
    on, nothing else. (The shipped file adds the off ceiling: test_features_off_bounds.)"""
    shipped = ExportedPolicy.load("docs/results/gpu21/policy_5c3d9060.npz")
    before = ExportedPolicy.load("docs/results/off_probe/policy_3dd256a8.npz")
    assert shipped.feature_spec == dataclasses.replace(before.feature_spec,
                                                       latency_drop_before_prefill=True)
    assert (shipped.guard, shipped.probe, shipped.actions) == (before.guard, before.probe,
                                                               before.actions)
    for new, old in zip([*shipped.weights, *shipped.biases], [*before.weights, *before.biases],
                        strict=True):
        np.testing.assert_array_equal(new, old)


def _flagged(records: list[StepRecord], flag_of=None) -> list[StepRecord]:
    """``records`` with ``before_prefill`` known on every record: by default whether the
    next record is a prefill (as the plugin sees it under overlap scheduling)."""
    nexts = [*records[1:], None]
    return [dataclasses.replace(r, before_prefill=(
        flag_of(r, nxt) if flag_of else nxt is not None and nxt.prefill_tokens > 0))
        for r, nxt in zip(records, nexts, strict=True)]


@pytest.mark.parametrize("backend", ["numpy", "compiled"])
def test_a_known_flag_drops_the_latency_at_once_without_holding_the_record(backend):
    """A decode record flagged ``before_prefill`` by the plugin is folded unmeasured when
    it arrives, every record is folded when it arrives (no lag): after each record the
    features equal those of a builder without the rule fed the zeroed stream so far."""
    if backend == "compiled":
        pytest.importorskip("numba")
    stream = _flagged(_served(6, n=120))
    zeroed = _zeroed(stream)
    flagged = FeatureBuilder(DROP, PROFILE, backend=backend)
    plain = FeatureBuilder(SPEC, PROFILE, backend=backend)
    for record, clean in zip(stream, zeroed, strict=True):
        flagged.update(record)
        plain.update(clean)
        np.testing.assert_array_equal(flagged.observation_grid(), plain.observation_grid())
    assert any(r.before_prefill for r in stream)


@pytest.mark.parametrize("backend", ["numpy", "compiled"])
def test_a_known_false_flag_keeps_the_latency_even_before_a_prefill(backend):
    """Without overlap scheduling a decode step's latency carries no prefill's launch: the
    plugin says False, and the record is kept whole though a prefill follows it (the
    record's word over the inference)."""
    if backend == "compiled":
        pytest.importorskip("numba")
    stream = _flagged(_served(7, n=200), lambda r, nxt: False)
    flagged = FeatureBuilder(DROP, PROFILE, backend=backend)
    flagged.update_many(stream)
    plain = FeatureBuilder(SPEC, PROFILE, backend=backend)
    plain.update_many(stream)
    np.testing.assert_array_equal(flagged.observation_grid(), plain.observation_grid())
    inferred = FeatureBuilder(DROP, PROFILE, backend=backend)
    inferred.update_many([dataclasses.replace(r, before_prefill=None) for r in stream])
    assert not np.array_equal(inferred.observation_grid(), plain.observation_grid())

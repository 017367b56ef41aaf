"""FeatureSpec.drop_warmup_latency: the re-entry warm-up's latency is not off's cost.

On the plugin's off switch the first step asked to speculate after an off period runs
SGLang's own steps=0 (a verify forward and the draft extend) and is reported as depth 0;
the features leave its latency out, so off is priced from off steps only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env.features import FeatureBuilder, FeatureSpec
from env.probe import ProbeSpec
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

# Every test here runs on both implementations (an autouse fixture of test_features).
from tests.test_features import backend  # noqa: F401

DROP = FeatureSpec(drop_warmup_latency=True, latency_model=3)
KEEP = replace(DROP, drop_warmup_latency=False)


def _record(i: int, depth: int, latency: float, batch: int = 32,
            prefill: int = 0) -> StepRecord:
    accepted = np.full(batch, min(depth, 2), dtype=np.int8) if depth and not prefill \
        else np.zeros(0, dtype=np.int8)
    return StepRecord(server="t", rank=0, step_index=i, time_s=0.01 * i, batch_size=batch,
                      waiting_requests=i % 7, running_requests=batch,
                      kv_used_tokens=40_000 + 100 * i, kv_capacity_tokens=500_000,
                      prefill_tokens=prefill, steps_used=0 if prefill else depth,
                      accepted_drafts=accepted, step_latency_s=latency)


def _warmups_zeroed(records: list[StepRecord]) -> list[StepRecord]:
    """The stream with each warm-up's latency set to 0 (not measured): a depth-0 decode
    record whose next decode record speculates."""
    out = list(records)
    held = None
    for i, record in enumerate(out):
        if not record.is_decode:
            continue
        if held is not None and record.steps_used > 0:
            out[held] = replace(out[held], step_latency_s=0.0)
        held = i if record.steps_used == 0 else None
    return out


def _vector(spec: FeatureSpec, records: list[StepRecord], prior) -> np.ndarray:
    builder = FeatureBuilder(spec, cost_prior=prior, probe=ProbeSpec(off_share=0.2))
    builder.update_many(records)
    return builder.observation_grid()


def _off_periods(count: int) -> list[StepRecord]:
    """``count`` cycles of an off step (17 ms), the warm-up (40 ms) and two steps at
    depth 3 (50 ms): the run-44 pattern at batch 32."""
    cycle = ((0, 0.017), (0, 0.040), (3, 0.050), (3, 0.050))
    return [_record(i, *cycle[i % len(cycle)]) for i in range(count * len(cycle))]


def test_a_warmup_step_does_not_price_off():
    """Off steps at 17 ms, each off period ended by a 40-ms warm-up: with the field off
    is predicted near 17 ms; without it, well above (the run-44 case)."""
    prior = load_profile("h200_qwen3_30b_a3b")
    records = _off_periods(30)
    predicted = {}
    for name, spec in (("drop", DROP), ("keep", KEEP)):
        builder = FeatureBuilder(spec, cost_prior=prior)
        builder.update_many(records)
        predicted[name] = 1e3 * builder.latency_predictions_s(32)[0]
    assert predicted["drop"] == pytest.approx(17.0, rel=0.05)
    assert predicted["keep"] > 1.2 * predicted["drop"]


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from([0, 0, 1, 3, -1]),
                                st.floats(0.005, 0.08)), min_size=1, max_size=40))
def test_dropping_equals_zeroing_the_warmups_latency(steps):
    """Fed any stream that ends on a speculative decode step, the features with the field
    on equal, bit for bit, those without it fed the stream with each warm-up's latency
    zeroed (-1 below: a prefill step between decode steps)."""
    prior = load_profile("h200_llama31_8b")
    records = [_record(i, max(depth, 0), latency, prefill=64 if depth < 0 else 0)
               for i, (depth, latency) in enumerate(steps)]
    records.append(_record(len(records), 3, 0.03))
    dropped = _vector(DROP, records, prior)
    zeroed = _vector(KEEP, _warmups_zeroed(records), prior)
    np.testing.assert_array_equal(dropped, zeroed)


def test_records_after_a_depth0_step_wait_for_the_next_decode_step():
    """A depth-0 decode record and the prefill after it are folded, in order, when the
    next decode record arrives; until then the observation is the one before them."""
    prior = load_profile("h200_llama31_8b")
    first = [_record(0, 3, 0.03), _record(1, 3, 0.03)]
    held = [_record(2, 0, 0.012), _record(3, 0, 0.05, prefill=128)]
    builder = FeatureBuilder(DROP, cost_prior=prior)
    builder.update_many(first)
    before = builder.observation_grid()
    builder.update_many(held)
    np.testing.assert_array_equal(builder.observation_grid(), before)
    builder.update(_record(4, 0, 0.012))  # an off step: the held one was off too
    reference = FeatureBuilder(KEEP, cost_prior=prior)
    reference.update_many(first + held)
    np.testing.assert_array_equal(builder.observation_grid(), reference.observation_grid())


def test_copy_keeps_its_own_held_records():
    """copy() (the daemon evaluates a stream's earlier records on a copy) does not share
    the held records with the original."""
    prior = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(DROP, cost_prior=prior)
    builder.update_many([_record(0, 3, 0.03), _record(1, 0, 0.012)])
    twin = builder.copy()
    twin.update(_record(2, 3, 0.03))  # the twin's held step was a warm-up
    builder.update(_record(2, 0, 0.012))  # the original's was off
    reference = FeatureBuilder(KEEP, cost_prior=prior)
    reference.update_many([_record(0, 3, 0.03), _record(1, 0, 0.012)])
    np.testing.assert_array_equal(builder.observation_grid(), reference.observation_grid())


@pytest.mark.parametrize("name", ["drop_warmup_latency", "warmup_restarts_draft",
                                  "warmup_flag"])
def test_the_field_is_false_in_an_old_file_and_must_be_a_bool(name):
    data = replace(KEEP, **{name: True}).to_dict()
    del data[name]
    assert getattr(FeatureSpec.from_dict(data), name) is False
    with pytest.raises(ValueError, match=name):
        FeatureSpec(**{name: 1})


RESTART = replace(DROP, warmup_restarts_draft=True)


@pytest.mark.parametrize("spec, counted", [(DROP, False), (RESTART, True)])
def test_the_step_after_a_warmup_counts_with_warmup_restarts_draft(spec, counted):
    """An acceptance probe on the plugin is a warm-up then one drafting step: with
    ``warmup_restarts_draft`` that step's acceptance is measured (the warm-up restarted
    the draft), without it the step is dropped as a cold re-entry."""
    prior = load_profile("h200_llama31_8b")
    records = [_record(i, 3, 0.03) for i in range(20)]  # accepting 2 of 3
    records += [_record(20 + i, 0, 0.012) for i in range(30)]
    warmup, probe = _record(50, 0, 0.03), _record(51, 1, 0.02)  # probe: accepts 1 of 1
    builder = FeatureBuilder(spec, cost_prior=prior)
    builder.update_many([*records, warmup, probe])
    age, measured = builder.acceptance_age()
    assert measured
    assert bool(age == 0) is counted
    reference = FeatureBuilder(spec, cost_prior=prior)
    reference.update_many(records)
    first_position = (builder.accept_rates()[0], reference.accept_rates()[0])
    assert bool(first_position[0] > first_position[1]) is counted


def test_warmup_restarts_draft_still_drops_the_warmups_latency():
    """The warm-up folded at the next depth is still not a latency measurement: off's
    and depth 3's predictions equal those of a stream without the warm-up record's
    latency, whichever depth it is counted at."""
    prior = load_profile("h200_qwen3_30b_a3b")
    records = _off_periods(20)
    records.append(_record(len(records), 3, 0.05))
    dropped = FeatureBuilder(DROP, cost_prior=prior)
    restarted = FeatureBuilder(RESTART, cost_prior=prior)
    dropped.update_many(records)
    restarted.update_many(records)
    np.testing.assert_array_equal(dropped.latency_predictions_s(32),
                                  restarted.latency_predictions_s(32))

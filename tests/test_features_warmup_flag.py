"""FeatureSpec.warmup_flag: the re-entry warm-up read from the records' own flag.

The plugin with its off path in use (and the simulator on the off path) says which
depth-0 decode step was the re-entry warm-up (``StepRecord.warmup``). With the field the
features read it from there: no one-record hold, and a warm-up followed by off is still a
warm-up. Records without the flag (an older plugin or trace) are inferred as before, and a
policy without the field computes as before whatever the records say.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.wire import decode, encode_step
from env.features import FeatureBuilder, FeatureSpec
from env.probe import ProbeSpec
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

# Every test here runs on both implementations (an autouse fixture of test_features).
from tests.test_features import backend  # noqa: F401

DROP = FeatureSpec(drop_warmup_latency=True, latency_model=3)
RESTART = replace(DROP, warmup_restarts_draft=True)
KEEP = replace(DROP, drop_warmup_latency=False)
PRIOR = load_profile("h200_qwen3_30b_a3b")
PROBE = ProbeSpec(off_share=0.2)


def _record(i: int, depth: int, latency: float, warmup: bool | None, batch: int = 32,
            prefill: int = 0) -> StepRecord:
    accepted = (np.full(batch, min(depth, 2), dtype=np.int8) if depth and not prefill
                else np.zeros(0, dtype=np.int8))
    return StepRecord(server="t", rank=0, step_index=i, time_s=0.01 * i, batch_size=batch,
                      waiting_requests=i % 7, running_requests=batch,
                      kv_used_tokens=40_000 + 100 * i, kv_capacity_tokens=500_000,
                      prefill_tokens=prefill, steps_used=0 if prefill else depth,
                      accepted_drafts=accepted, step_latency_s=latency, warmup=warmup)


def plugin_stream(plan: list[tuple[int, float]], warm_then_on: bool = False
                  ) -> list[StepRecord]:
    """The records the plugin with its off path sends for a plan of (asked depth, latency)
    steps (asked -1: a prefill): ``OffSwitch.choose``'s bookkeeping, each warm-up flagged.
    ``warm_then_on``: a step asked for 0 right after a warm-up is asked for 1 instead (the
    inference reads every warm-up right then)."""
    out: list[StepRecord] = []
    stale = after_warmup = False
    for asked, latency in plan:
        i = len(out)
        if asked < 0:
            out.append(_record(i, 0, latency, False, prefill=64))
            continue
        if asked == 0 and after_warmup and warm_then_on:
            asked = 1
        after_warmup = False
        if asked == 0:
            stale = True
            out.append(_record(i, 0, latency, False))
        elif stale:
            stale, after_warmup = False, True
            out.append(_record(i, 0, latency, True))
        else:
            out.append(_record(i, asked, latency, False))
    return out


def _stripped(records: list[StepRecord]) -> list[StepRecord]:
    """The stream as an older plugin sends it: no flag."""
    return [replace(r, warmup=None) for r in records]


def _builder(spec: FeatureSpec) -> FeatureBuilder:
    return FeatureBuilder(spec, cost_prior=PRIOR, probe=PROBE)


def _assert_same(a: FeatureBuilder, b: FeatureBuilder, where: str) -> None:
    np.testing.assert_array_equal(a.observation_grid(), b.observation_grid(), err_msg=where)
    assert a.acceptance_age() == b.acceptance_age(), where
    assert a.probing == b.probing, where
    np.testing.assert_array_equal(a.latency_predictions_s(np.array([1, 32, 200])),
                                  b.latency_predictions_s(np.array([1, 32, 200])), where)


plans = st.lists(st.tuples(st.sampled_from([-1, 0, 0, 0, 1, 3, 3, 5]),
                           st.floats(0.005, 0.08)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(plan=plans, spec=st.sampled_from([DROP, RESTART]))
def test_where_the_inference_is_right_the_flag_gives_its_features_without_the_hold(plan, spec):
    """On a plugin stream whose every warm-up is followed by a speculative step (where the
    inference reads the warm-ups right), the features read from the flags equal the
    inferred ones, bit for bit, after every record the inference is not holding (it holds
    depth-0 records a step; the flag needs no hold)."""
    records = plugin_stream(plan, warm_then_on=True)
    flagged, inferred = _builder(replace(spec, warmup_flag=True)), _builder(spec)
    for i, record in enumerate(records):
        flagged.update(record)
        inferred.update(record)
        assert not flagged._held, "a flagged stream is never held"
        if not inferred._held:
            _assert_same(flagged, inferred, f"after record {i}")


@settings(max_examples=60, deadline=None)
@given(plan=plans)
def test_a_flagged_warmup_is_left_out_wherever_it_is_and_nothing_waits(plan):
    """On any plugin stream (a warm-up followed by off included) the features with the
    flag equal, after every record, those without the field fed the stream with each
    flagged warm-up's latency zeroed (not measured): each warm-up left out, nothing else,
    and nothing held."""
    records = plugin_stream(plan)
    zeroed = [replace(r, step_latency_s=0.0) if r.warmup else r for r in records]
    flagged, reference = _builder(replace(DROP, warmup_flag=True)), _builder(KEEP)
    for i, (record, zero) in enumerate(zip(records, zeroed, strict=True)):
        flagged.update(record)
        reference.update(zero)
        _assert_same(flagged, reference, f"after record {i}")


@settings(max_examples=40, deadline=None)
@given(plan=plans, spec=st.sampled_from([FeatureSpec(), KEEP, DROP, RESTART]))
def test_without_the_field_the_flag_changes_nothing_and_unknown_records_are_inferred(plan,
                                                                                       spec):
    """A policy without ``warmup_flag`` (every file before it, the shipped one among them)
    computes on a flagged stream exactly as on the stream without flags; and with the
    field a stream without flags (an older plugin) computes as without it."""
    records = plugin_stream(plan)
    plain = _stripped(records)
    with_flags, without = _builder(spec), _builder(spec)
    flag_field_unknown = _builder(replace(spec, warmup_flag=True))
    for i, (record, old) in enumerate(zip(records, plain, strict=True)):
        with_flags.update(record)
        without.update(old)
        flag_field_unknown.update(old)
        _assert_same(with_flags, without, f"after record {i}")
        _assert_same(flag_field_unknown, without, f"after record {i} (unknown)")


def _off_prediction_ms(spec: FeatureSpec, records: list[StepRecord]) -> float:
    builder = FeatureBuilder(spec, cost_prior=PRIOR)
    builder.update_many(records)
    return 1e3 * builder.latency_predictions_s(32)[0]


def test_a_warmup_followed_by_off_is_still_left_out():
    """The policy back on for one step (the warm-up) then off again, cycle after cycle:
    the inference reads each such warm-up as an off step (off priced too slow), the flag
    leaves it out (off at its 17 ms)."""
    # off 17 ms, the warm-up (40 ms), off again, the warm-up, two steps at depth 3
    cycle = [(0, 0.017), (3, 0.040), (0, 0.017), (3, 0.040), (3, 0.050), (3, 0.050)]
    records = plugin_stream(cycle * 30)
    assert [r.warmup for r in records[:6]] == [False, True, False, True, False, False]
    flagged = _off_prediction_ms(replace(DROP, warmup_flag=True), records)
    inferred = _off_prediction_ms(DROP, records)
    assert flagged == pytest.approx(17.0, rel=0.05)
    assert inferred > 1.2 * flagged


def test_a_flagged_off_step_is_folded_at_once():
    """No lag while off: an off step flagged as such changes the observation when it
    arrives; an unknown one waits for the next decode record."""
    first = [_record(0, 3, 0.03, False), _record(1, 3, 0.03, False)]
    off = _record(2, 0, 0.012, False)
    for spec, waits in ((DROP, True), (replace(DROP, warmup_flag=True), False)):
        builder = FeatureBuilder(spec, cost_prior=PRIOR)
        builder.update_many(first)
        before = builder.observation_grid()
        builder.update(off)
        assert np.array_equal(builder.observation_grid(), before) is waits
        assert builder.observation().steps_used == (3 if waits else 0)


@pytest.mark.parametrize("flagged", [False, True])
def test_the_two_step_probe_on_the_plugin_measures_with_the_flag(flagged):
    """The acceptance probe on the plugin: the warm-up, then one drafting step. With the
    flag and ``warmup_restarts_draft`` the drafting step's acceptance counts whether or not
    the warm-up is known from the stream alone."""
    records = [_record(i, 3, 0.03, False) for i in range(20)]
    records += [_record(20 + i, 0, 0.012, False) for i in range(30)]
    warmup, probe = _record(50, 0, 0.03, True), _record(51, 1, 0.02, False)
    spec = replace(RESTART, warmup_flag=flagged)
    builder = FeatureBuilder(spec, cost_prior=PRIOR)
    builder.update_many([*records, warmup, probe])
    assert builder.acceptance_age() == (0, True)
    assert builder.observation().steps_since_switch == 1  # the switch counted at the warm-up


def test_a_copy_keeps_its_own_restart():
    """copy() after a flagged warm-up: the copy's next step and the original's are read
    each on its own (the daemon evaluates earlier records on copies)."""
    spec = replace(RESTART, warmup_flag=True)
    builder = FeatureBuilder(spec, cost_prior=PRIOR)
    builder.update_many([_record(0, 3, 0.03, False), _record(1, 0, 0.012, False),
                         _record(2, 0, 0.04, True)])
    twin = builder.copy()
    twin.update(_record(3, 3, 0.05, False))  # drafts warm after the warm-up
    builder.update(_record(3, 0, 0.012, False))  # off again
    assert twin.acceptance_age() == (0, True)
    assert builder.acceptance_age()[0] > 0
    builder.update(_record(4, 3, 0.05, False))  # after off: a cold re-entry, dropped
    assert builder.acceptance_age()[0] > 0


def test_the_flag_reaches_the_features_through_the_wire():
    """A frame of an older plugin (no flag) is inferred, one with the flag is read."""
    warm = _record(1, 0, 0.04, True)
    spec = replace(DROP, warmup_flag=True)
    for record, held in ((warm, False), (replace(warm, warmup=None), True)):
        builder = FeatureBuilder(spec, cost_prior=PRIOR)
        builder.update(_record(0, 3, 0.05, False))
        builder.update(decode(encode_step(record)))
        assert bool(builder._held) is held


@pytest.mark.parametrize("path", ["docs/results/gpu22/policy_65d4fb99.npz",
                                  "docs/results/off_probe/policy_3dd256a8.npz",
                                  "docs/results/drop_warmup/policy_58513820.npz"])
def test_the_files_before_the_field_compute_as_before_on_a_flagged_stream(path):
    """The files shipped up to the twenty-third session (no warm-up fields) and the
    seventeenth session's retrain (``drop_warmup_latency`` and ``warmup_restarts_draft``, no
    ``warmup_flag``) read a flagged plugin stream exactly as one without flags: their
    features are unchanged. (The file shipped since the twenty-fourth reads the flag for its
    off ceiling's cells, ``latency_off_ceiling_samples``: tests/test_features_off_bounds.py.)"""
    from pathlib import Path

    from controller.policy_file import ExportedPolicy

    spec = ExportedPolicy.load(Path(__file__).parents[1] / path).feature_spec
    assert spec.warmup_flag is False
    cycle = [(0, 0.017), (3, 0.040), (0, 0.017), (3, 0.040), (3, 0.050), (-1, 0.03),
             (3, 0.050), (0, 0.02)]
    records = plugin_stream(cycle * 12)
    a, b = _builder(spec), _builder(spec)
    for i, (record, old) in enumerate(zip(records, _stripped(records), strict=True)):
        a.update(record)
        b.update(old)
        _assert_same(a, b, f"after record {i}")


def _flagged_as_inferred(records: list[StepRecord]) -> list[StepRecord]:
    """Each record flagged as the inference reads it: a depth-0 decode record with a
    measured latency is a warm-up iff the next decode record speculates."""
    out = [replace(r, warmup=False) for r in records]
    decode = [i for i, r in enumerate(out) if r.prefill_tokens == 0]
    for i, j in itertools.pairwise(decode):
        if (out[i].steps_used == 0 and out[i].step_latency_s > 0.0
                and out[j].steps_used > 0):
            out[i] = replace(out[i], warmup=True)
    return out


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from([-1, 0, 0, 1, 3, 3, 9]),
                                st.sampled_from([0.0, 0.01, 0.03, 0.06])),
                      min_size=1, max_size=40),
       spec=st.sampled_from([DROP, RESTART]))
def test_any_stream_flagged_as_the_inference_reads_it_gives_its_features(steps, spec):
    """Any stream (a warm-up after a speculative step, depths beyond max_depth, unmeasured
    latencies, prefills): flagged as the inference reads it, the flag's features equal the
    inference's after every record the inference is not holding."""
    records = [_record(i, max(depth, 0), latency, None, prefill=64 if depth < 0 else 0)
               for i, (depth, latency) in enumerate(steps)]
    flagged, inferred = _builder(replace(spec, warmup_flag=True)), _builder(spec)
    for i, (record, known) in enumerate(zip(records, _flagged_as_inferred(records),
                                            strict=True)):
        flagged.update(known)
        inferred.update(record)
        if not inferred._held:
            _assert_same(flagged, inferred, f"after record {i}")

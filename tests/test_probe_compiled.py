"""The off probe folded compiled (``env.features_compiled.CompiledProbeTracker``) against
``ProbeTracker``'s Python fold: on the same features (the compiled backend's), every
record leaves the same probe state, bit for bit, and the same decisions' probe flags;
copies too."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env.features import FeatureSpec
from env.probe import _BUCKETS, ProbeSpec, ProbeTracker, off_bucket
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

pytest.importorskip("numba")

from env.features_compiled import CompiledFeatureBuilder, CompiledProbeTracker, _off_bucket

PROFILE = load_profile("h200_llama31_8b")
#: Every attribute of a tracker's state.
STATE = ("budget_s", "cost_s", "remaining", "decode_steps", "off_budget_s", "off_cost_s",
         "off_remaining", "off_expected", "off_weights", "off_stamps", "off_confirmed")


class PythonProbeBuilder(CompiledFeatureBuilder):
    """The compiled features with the probe folded in Python (the reference)."""

    tracker_type = ProbeTracker


def stream(seed: int, length: int, builder: CompiledFeatureBuilder | None = None):
    """Runs of speculation and of off at a few batch sizes (across the probe's buckets),
    latencies near, above and below one another's, some unmeasured, a prefill now and
    then; with ``builder``, whose records these are, an off probe it starts is run (off
    at the run's batch), so that its predictions are confirmed or refuted."""
    rng = np.random.default_rng(seed)
    i = 0
    while i < length:
        steps = int(rng.choice([0, 1, 3, 3, 5]))
        batch = int(rng.choice([1, 2, 7, 8, 48, 64, 200, 40_000]))
        off_s = float(rng.choice([0.0, 0.004, 0.01, 0.02, 0.04]))
        prefill = 512 if rng.random() < 0.02 else 0
        for _ in range(int(rng.integers(1, 120))):
            ran = 0 if prefill or (builder is not None and builder.probing == 2) else steps
            accepted = (rng.integers(0, ran + 1, size=batch).astype(np.int8)
                        if ran else np.zeros(0, dtype=np.int8))
            latency = off_s * (1.0 + 0.2 * ran) * float(rng.uniform(0.8, 1.25))
            # the re-entry warm-up flag (read by FeatureSpec.warmup_flag): now and then a
            # depth-0 decode step is flagged one, its latency left out of the features
            warmup = bool(rng.random() < 0.05) if not (ran or prefill) else False
            yield StepRecord("s", 0, i, 0.01 * i, batch, 3, batch, 40_000 + 100 * i,
                             1_000_000, prefill, ran, accepted, latency, warmup=warmup)
            i += 1


def assert_same(got: CompiledFeatureBuilder, want: CompiledFeatureBuilder, where: str) -> None:
    assert np.array_equal(got._state, want._state), where
    assert got.probing == want.probing, where
    for name in STATE:
        assert getattr(got.probe_tracker, name) == getattr(want.probe_tracker, name), (
            where, name)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), with_profile=st.booleans(),
       share=st.sampled_from([0.05, 0.2, 1.0]), steps=st.integers(1, 3),
       samples=st.sampled_from([0.3, 0.5, 2.0]), confirm=st.sampled_from([0.0, 0.15, 1.0]),
       trust=st.sampled_from([0.0, 0.05, 0.5]),
       spec=st.sampled_from([FeatureSpec(), FeatureSpec(latency_model=3),
                             FeatureSpec(latency_model=3, drop_warmup_latency=True,
                                         warmup_restarts_draft=True, warmup_flag=True)]))
def test_the_compiled_off_probe_folds_as_the_python_one(seed, with_profile, share, steps,
                                                          samples, confirm, trust, spec):
    probe = ProbeSpec(off_share=share, off_steps=steps, off_samples=samples,
                      off_confirm=confirm, off_trust=trust)
    profile = PROFILE if with_profile else None
    fused = CompiledFeatureBuilder(spec, profile, probe=probe)
    reference = PythonProbeBuilder(spec, profile, probe=probe)
    assert type(fused.probe_tracker) is CompiledProbeTracker
    assert type(reference.probe_tracker) is ProbeTracker
    decode = 0
    for i, record in enumerate(stream(seed, 700, reference)):
        fused.update(record)
        reference.update(record)
        decode += record.prefill_tokens == 0
        assert_same(fused, reference, f"record {i}")
        if i % 97 == 50:  # a copy goes on alone, the original is untouched
            copies = fused.copy(), reference.copy()
            for later in (replace(record, step_index=i + k, steps_used=k % 2) for k in (1, 2)):
                for copy in copies:
                    copy.update(later)
            assert_same(*copies, f"copy at {i}")
            assert_same(fused, reference, f"after the copies at {i}")
    assert fused.probe_tracker.decode_steps == decode


def test_the_reference_fires_and_is_confirmed_in_these_streams():
    """The property above compares more than quiet trackers: in its streams the off probe
    fires, and a prediction is confirmed."""
    probe = ProbeSpec(off_share=0.2, off_confirm=1.0)
    builder = PythonProbeBuilder(None, PROFILE, probe=probe)
    fired = 0
    for record in stream(7, 3000, builder):
        builder.update(record)
        fired += builder.probing == 2
    assert fired and any(builder.probe_tracker.off_confirmed)


def test_a_reset_compiled_tracker_is_a_fresh_one():
    probe = ProbeSpec(off_share=0.2)
    used = CompiledFeatureBuilder(None, PROFILE, probe=probe)
    for record in stream(3, 500, used):
        used.update(record)
    used.reset()
    fresh = CompiledFeatureBuilder(None, PROFILE, probe=probe)
    assert_same(used, fresh, "after reset")


def test_the_compiled_buckets_are_the_python_ones():
    sizes = [*range(0, 300), *(2**k + d for k in range(8, 20) for d in (-1, 0, 1))]
    assert [_off_bucket(b, _BUCKETS) for b in sizes] == [off_bucket(b) for b in sizes]

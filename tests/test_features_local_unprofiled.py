"""``FeatureSpec.latency_local_unprofiled``: the local measured-cost correction without a
cost profile, its base the latency regression's own prediction of each step when it was
measured. Each test runs on both feature backends (the compiled one mirrors the numpy
one; tests/test_features_compiled.py draws streams through both)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder, FeatureSpec
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

pytest.importorskip("numba")
BACKENDS = ("numpy", "compiled")
SHIPPED = ExportedPolicy.load("controller/data/default_policy.npz").feature_spec


def _feed(builder: FeatureBuilder, steps, first: int = 0) -> int:
    """(batch, depth, latency_s, kv) decode steps, each request accepting nothing."""
    for i, (batch, depth, latency, kv) in enumerate(steps, start=first):
        accepted = np.zeros(batch if depth else 0, dtype=np.int8)
        builder.update(StepRecord("s", 0, i, 0.01 * i, batch, 0, batch, kv, 1_000_000, 0,
                                  depth, accepted, latency))
    return first + len(steps)


def _pair(backend: str, samples: float, profile=None, spec: FeatureSpec = SHIPPED
          ) -> tuple[FeatureBuilder, FeatureBuilder]:
    """The spec without and with the correction (``samples``)."""
    return tuple(FeatureBuilder(dataclasses.replace(spec, latency_local_unprofiled=value),
                                profile, backend=backend) for value in (0.0, samples))


@pytest.mark.parametrize("backend", BACKENDS)
def test_by_hand_an_off_step_is_priced_as_measured_and_carried_by_the_regression(backend):
    """Off measured 200 times at batch 256 (bucket 8), then once at batch 8 at e^-0.4 times
    the regression's prediction: off's prediction at batch 8 (bucket 3) moves from the
    regression's (as it is now, after that step) toward the measured step by 1 - exp(-1 /
    k) in log space, at batch 16 (the neighbouring bucket, half weight) by 1 - exp(-0.5 /
    k) times the same log ratio (measured / the regression now at batch 8), at batch 64
    not at all."""
    samples, kv = 2.0, 4000
    # (each decode step folded at once: no hold for a prefill after it)
    plain, local = _pair(backend, samples,
                         spec=dataclasses.replace(SHIPPED, latency_drop_before_prefill=False))
    steps = [(256, 0, 0.020, kv)] * 200
    for builder in (plain, local):
        _feed(builder, steps)
    before = plain.latency_predictions_s(8)[0]
    measured = math.exp(-0.4) * before
    for builder in (plain, local):
        _feed(builder, [(8, 0, measured, kv)], first=len(steps))
    gap = math.log(measured) - math.log(plain.latency_predictions_s(8)[0])
    assert -0.4 < gap < 0.0  # the regression moved toward the step (its two off terms)
    for batch, weight in ((8, -math.expm1(-1 / samples)), (16, -math.expm1(-0.5 / samples)),
                          (64, 0.0)):
        want = plain.latency_predictions_s(batch)[0] * math.exp(weight * gap)
        assert local.latency_predictions_s(batch)[0] == pytest.approx(want, rel=1e-9)
    np.testing.assert_array_equal(local.latency_predictions_s(64),
                                  plain.latency_predictions_s(64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_depth_the_regression_misfits_is_priced_as_measured_near_its_batch(backend):
    """A server whose depth 3 costs 12 ms at batch 4 and grows convexly with the batch
    (model 2's batch term is linear in the verify tokens), run at depth 3 at batch 32,
    64 and 128 (100 steps each, interleaved), then at batch 4: depth 3 for 10 steps, then
    off for 50 (run 92's "ppo_2 r6" in small: a few small-batch depth-3 steps, then off).
    The regression's line through the large batches prices depth 3 at batch 4 far below
    its 12 ms (off's price, by the running maximum); with the correction it is priced
    within 5% of what it measured there, after the off steps moved the regression."""
    kv = 20_000

    def depth3_ms(batch: int) -> float:
        return 12.0 + 0.004 * batch ** 2.2

    steps = ([(b, 3, depth3_ms(b) / 1e3, kv) for b in (32, 64, 128)] * 100
             + [(4, 3, depth3_ms(4) / 1e3, kv)] * 10 + [(4, 0, 0.0055, kv)] * 51)
    plain, local = _pair(backend, 0.5)
    for builder in (plain, local):
        _feed(builder, steps)
    guessed = 1e3 * plain.latency_predictions_s(4)[3]
    assert guessed < 0.6 * depth3_ms(4), guessed
    assert 1e3 * local.latency_predictions_s(4)[3] == pytest.approx(depth3_ms(4), rel=0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_a_profile_the_field_changes_nothing(backend):
    """The profile's own correction (latency_local_samples) is the one that runs there;
    off or on, ``latency_local_unprofiled`` leaves every observation as it was, bit for bit."""
    profile = load_profile("h200_llama31_8b")
    spec = dataclasses.replace(SHIPPED, latency_model=3)
    for with_local in (0.0, 1.0):
        plain, local = _pair(backend, 2.0, profile,
                             dataclasses.replace(spec, latency_local_samples=with_local))
        steps = [(8, 0, 0.009, 3000), (8, 3, 0.030, 3000), (64, 3, 0.05, 9000)] * 20
        for builder in (plain, local):
            _feed(builder, steps)
        np.testing.assert_array_equal(local.observation_grid(), plain.observation_grid())


def test_the_field_is_off_in_every_file_before_it_and_must_be_a_number():
    data = dataclasses.replace(SHIPPED, latency_local_unprofiled=2.0).to_dict()
    del data["latency_local_unprofiled"]
    assert FeatureSpec.from_dict(data) == SHIPPED
    assert SHIPPED.latency_local_unprofiled == 0.0
    for value in (-1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="latency_local_unprofiled"):
            FeatureSpec(latency_local_unprofiled=value)

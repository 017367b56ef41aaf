"""``FeatureSpec.latency_residual_log``: with a cost profile, the latency regression fits
log(measured / profile) on its level terms and prices a depth at the profile times exp(the
fit), so a profile wrong by a factor is corrected by that factor at every batch size, not
by the offset measured at the batch sizes the stream ran. Off (the default) it is absent
from a policy file, whose bytes stay as they were."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from controller.default_policy import default_policy_path
from controller.policy_file import ExportedPolicy
from env.features import RESIDUAL_LOG_BOUND, FeatureBuilder, FeatureSpec
from env.sim.cost_model import load_profile
from tests.lockstep import decode_record

BACKENDS = ("numpy", "compiled")
TRUTH = load_profile("h200_llama31_8b")
#: A profile that prices every step 3x what the server measures.
THREE_X = TRUTH.replace(**{name: 3.0 * value for name, value in TRUTH.coefficients.items()})
KV = 50_000  # decode_record's KV use


def true_s(batch: int, steps: int) -> float:
    on = steps > 0  # the plugin's off switch: no speculative path, no draft extend
    return TRUTH.step_latency_s(batch, steps, KV, 0, draft_extend=on, speculative_path=on)


def fed(backend: str, log: bool) -> FeatureBuilder:
    """A builder handed THREE_X that measured off and depth 1 at batch 1-4 only."""
    spec = dataclasses.replace(FeatureSpec(latency_model=3), latency_residual_log=log)
    builder = FeatureBuilder(spec, THREE_X, backend)
    step = 0
    for _ in range(6):
        for batch in (1, 2, 3, 4):
            for steps in (0, 1):
                step += 1
                builder.update(decode_record(step, steps, batch, true_s(batch, steps), 1))
    return builder


def test_the_field_is_absent_at_its_default_and_the_shipped_bytes_stay(tmp_path):
    assert "latency_residual_log" not in FeatureSpec().to_dict()
    on = FeatureSpec(latency_residual_log=True)
    assert on.to_dict()["latency_residual_log"] is True
    assert FeatureSpec.from_dict(on.to_dict()) == on
    shipped = ExportedPolicy.load(default_policy_path())
    path = shipped.save_named_by_hash(tmp_path)
    digest = hashlib.sha256(default_policy_path().read_bytes()).hexdigest()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    with pytest.raises(ValueError, match="latency_residual_log"):
        FeatureSpec(latency_residual_log=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_profile_wrong_by_a_factor_is_corrected_by_it_at_a_batch_never_run(backend):
    log = fed(backend, True)
    for batch in (64, 512):  # never run: the profile's shape, the measured factor
        for steps in (0, 1):
            truth, priced = true_s(batch, steps), log.latency_predictions_s(batch)[steps]
            assert abs(np.log(priced / truth)) < np.log(1.1), (batch, steps, priced, truth)
    # the offset measured at batch 1-4 leaves depth 1 at batch 64 over twice its cost
    offset = fed(backend, False).latency_predictions_s(64)[1]
    assert offset > 1.8 * true_s(64, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_exact_profile_is_left_where_it_is(backend):
    spec = FeatureSpec(latency_model=3, latency_residual_log=True)
    builder = FeatureBuilder(spec, TRUTH, backend)
    for step in range(1, 25):
        batch, steps = 1 + step % 8, step % 2
        builder.update(decode_record(step, steps, batch, true_s(batch, steps), 1))
    for batch in (1, 64, 1024):
        predicted = builder.latency_predictions_s(batch)
        assert predicted[0] == pytest.approx(true_s(batch, 0), rel=1e-6)
        assert predicted[1] == pytest.approx(true_s(batch, 1), rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fitted_factor_is_bounded(backend):
    """Steps measured 10^4 x the profile: the factor stops at e^RESIDUAL_LOG_BOUND."""
    spec = FeatureSpec(latency_model=3, latency_residual_log=True, latency_ridge=1e-9)
    builder = FeatureBuilder(spec, TRUTH, backend)
    for step in range(1, 41):
        batch, steps = 1 + step % 8, step % 2
        builder.update(decode_record(step, steps, batch, 1e4 * true_s(batch, steps), 1))
    predicted = builder.latency_predictions_s(1024)
    assert np.all(np.isfinite(predicted))
    assert predicted[0] <= true_s(1024, 0) * np.exp(RESIDUAL_LOG_BOUND) * (1 + 1e-9)

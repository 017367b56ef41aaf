"""``FeatureSpec.latency_off_ceiling``: off's predicted latency at most exp(ceiling) times
the handed profile's off price while the stream trusts the profile (run 73's lock-in: a
few warm-ups counted as off priced off at batch 32-48 1.3-1.8x the profile and the
server; docs/results/gpu22/LOCKIN.md). Both feature backends."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder, FeatureSpec
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

PROFILE = load_profile("h200_qwen3_30b_a3b")
BASE = FeatureSpec(latency_model=3, latency_outlier_ratio=3.0)
CEILING = dataclasses.replace(BASE, latency_off_ceiling=0.1)
BACKENDS = ["numpy", "compiled"]
AT = np.array([8, 32, 48])
KV_PER_REQUEST = 900


def _profile_ms(batch: int, depth: int, kv: int) -> float:
    return 1e3 * PROFILE.step_latency_s(batch, depth, kv, 0, draft_extend=depth > 0,
                                        speculative_path=depth > 0)


def _record(i: int, batch: int, depth: int, latency_ms: float) -> StepRecord:
    accepted = np.full(batch if depth else 0, min(depth, 2), np.int8)
    return StepRecord("s", 0, i, 0.01 * i, batch, 0, batch, KV_PER_REQUEST * batch, 700_000,
                      0, depth, accepted, latency_ms / 1e3)


def _stream(off_scale: float, spec_scale: float = 1.0, n: int = 300) -> list[StepRecord]:
    """Depth 3 at batch 8-48 at ``spec_scale`` x the profile, with an off step every tenth
    at ``off_scale`` x (the last batch 48)."""
    out = []
    for i in range(n):
        batch = 8 + (i * 7) % 41 if i < n - 1 else 48
        depth = 0 if i % 10 == 9 or i == n - 1 else 3
        scale = off_scale if depth == 0 else spec_scale
        out.append(_record(i, batch, depth, scale * _profile_ms(batch, depth,
                                                                KV_PER_REQUEST * batch)))
    return out


def _builder(spec, backend, records):
    if backend == "compiled":
        pytest.importorskip("numba")
    builder = FeatureBuilder(spec, PROFILE, backend=backend)
    builder.update_many(records)
    return builder


@pytest.mark.parametrize("backend", BACKENDS)
def test_off_priced_above_the_profile_is_capped_at_the_ceiling(backend):
    """Off measured at 2.5x the profile (the warm-ups of run 73): without the field off is
    priced far above the profile; with it, at exactly exp(0.1) x the profile's off price
    at the latest KV use; the speculative depths' prices are the same either way."""
    records = _stream(2.5)
    capped = _builder(CEILING, backend, records)
    whole = _builder(BASE, backend, records)
    assert abs(capped.profile_log_error) < BASE.latency_outlier_trust
    kv = records[-1].kv_used_tokens
    profile = np.array([_profile_ms(int(b), 0, kv) for b in AT]) / 1e3
    predicted = capped.latency_predictions_s(AT)
    np.testing.assert_allclose(predicted[:, 0], profile * math.exp(0.1), rtol=1e-9)
    assert (whole.latency_predictions_s(AT)[:, 0] > 1.3 * profile).all()
    np.testing.assert_array_equal(predicted[:, 1:], whole.latency_predictions_s(AT)[:, 1:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["cheap", "untrusted"])
def test_the_ceiling_leaves_off_alone_below_it_or_on_a_profile_far_off(backend, case):
    """Off measured below the profile (0.6x: the MoE at batch 1-23), and a server 2.5x the
    profile throughout (another server's profile: the mean log error over the trust), are
    priced as without the field, bit for bit."""
    records = _stream(0.6) if case == "cheap" else _stream(2.5, spec_scale=2.5)
    capped = _builder(CEILING, backend, records)
    if case == "untrusted":
        assert capped.profile_log_error > BASE.latency_outlier_trust
    np.testing.assert_array_equal(capped.observation_grid(),
                                  _builder(BASE, backend, records).observation_grid())


def test_both_backends_agree_with_the_ceiling():
    pytest.importorskip("numba")
    rng = np.random.default_rng(7)
    records = []
    for i in range(400):
        batch, depth = int(rng.integers(1, 64)), int(rng.choice([0, 3]))
        scale = float(rng.choice([0.6, 1.0, 2.5]))
        records.append(_record(i, batch, depth, scale * _profile_ms(batch, depth,
                                                                    KV_PER_REQUEST * batch)))
    grids = [_builder(CEILING, backend, records).observation_grid() for backend in BACKENDS]
    np.testing.assert_allclose(grids[0], grids[1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(grids[0], _builder(BASE, "numpy", records).observation_grid())


def test_an_old_file_reads_the_ceiling_off_and_bad_values_are_refused():
    data = CEILING.to_dict()
    assert data["latency_off_ceiling"] == 0.1
    del data["latency_off_ceiling"]
    assert FeatureSpec.from_dict(data).latency_off_ceiling == 0.0
    shipped = ExportedPolicy.load("controller/data/default_policy.npz")
    assert shipped.feature_spec.latency_off_ceiling == 0.0
    for value in (-0.1, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="latency_off_ceiling"):
            FeatureSpec(latency_off_ceiling=value)

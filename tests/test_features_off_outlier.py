"""``FeatureSpec.latency_off_outlier_ratio``: an off step measured over the ratio times the
profile's off price (the plugin's re-entry warm-up, 2.2-3x an off step on the H200 MoE)
enters the latency estimators at the ratio times, once the stream trusts the profile
(run 73's lock-in: docs/results/gpu22/LOCKIN.md). Both feature backends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder, FeatureSpec
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

PROFILE = load_profile("h200_qwen3_30b_a3b")
BASE = FeatureSpec(latency_model=3, latency_outlier_ratio=3.0)
CLIP = dataclasses.replace(BASE, latency_off_outlier_ratio=1.25)
BACKENDS = ["numpy", "compiled"]


def _profile_ms(batch: int, depth: int, kv: int) -> float:
    return 1e3 * PROFILE.step_latency_s(batch, depth, kv, 0, draft_extend=depth > 0,
                                        speculative_path=depth > 0)


def _record(i: int, batch: int, depth: int, latency_ms: float) -> StepRecord:
    accepted = np.full(batch if depth else 0, min(depth, 2), np.int8)
    return StepRecord("s", 0, i, 0.01 * i, batch, 0, batch, 900 * batch, 700_000, 0, depth,
                      accepted, latency_ms / 1e3)


def _exact(count: int) -> list[StepRecord]:
    """Decode steps at batch 1-8, off and depth 3 in runs of 10, each at the profile's
    price (the stream trusts the profile)."""
    out = []
    for i in range(count):
        batch, depth = 1 + i % 8, 3 if (i // 10) % 2 else 0
        out.append(_record(i, batch, depth, _profile_ms(batch, depth, 900 * batch)))
    return out


def _builder(spec, backend, records):
    if backend == "compiled":
        pytest.importorskip("numba")
    builder = FeatureBuilder(spec, PROFILE, backend=backend)
    builder.update_many(records)
    return builder


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dear_off_step_enters_at_the_ratio_times_the_profile(backend):
    """A warm-up-like off step at batch 48 (2.8x the profile's off price, under the general
    clip's 3x) prices off there as a step of exactly 1.25x would; without the field it
    enters whole and prices off far dearer."""
    at48 = _profile_ms(48, 0, 900 * 48)
    dear = [*_exact(60), _record(60, 48, 0, 2.8 * at48)]
    exact = [*_exact(60), _record(60, 48, 0, 1.25 * at48)]
    clipped = _builder(CLIP, backend, dear).latency_predictions_s(np.array([32, 48]))
    same = _builder(CLIP, backend, exact).latency_predictions_s(np.array([32, 48]))
    whole = _builder(BASE, backend, dear).latency_predictions_s(np.array([32, 48]))
    np.testing.assert_allclose(clipped, same, rtol=1e-12)
    assert whole[1, 0] > 1.3 * clipped[1, 0], (whole[:, 0], clipped[:, 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["speculative", "early", "untrusted", "cheap"])
def test_the_clip_leaves_other_steps_whole(backend, case):
    """Not clipped (the builder equals one without the field): a dear speculative step
    (the general clip's business), a dear off step before ``latency_outlier_warmup``
    measured steps, one on a stream whose steps sit far from the profile (another
    server's), and an off step under the ratio."""
    if case == "speculative":
        records = [*_exact(60), _record(60, 48, 3, 2.8 * _profile_ms(48, 3, 900 * 48))]
    elif case == "early":
        records = [*_exact(5), _record(5, 48, 0, 2.8 * _profile_ms(48, 0, 900 * 48))]
    elif case == "untrusted":
        slow = [dataclasses.replace(r, step_latency_s=2.5 * r.step_latency_s)
                for r in _exact(200)]
        records = [*slow, _record(200, 48, 0, 2.8 * _profile_ms(48, 0, 900 * 48))]
    else:
        records = [*_exact(60), _record(60, 48, 0, 1.2 * _profile_ms(48, 0, 900 * 48))]
    clip = _builder(CLIP, backend, records)
    if case == "untrusted":
        assert clip.profile_log_error > BASE.latency_outlier_trust
    np.testing.assert_array_equal(clip.observation_grid(),
                                  _builder(BASE, backend, records).observation_grid())


def test_both_backends_agree_with_the_clip():
    """The compiled backend clips the same steps as numpy (a mixed stream)."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(5)
    records = _exact(40)
    for i in range(40, 400):
        batch, depth = int(rng.integers(1, 64)), int(rng.choice([0, 3]))
        scale = float(rng.choice([1.0, 1.1, 2.5]))
        records.append(_record(i, batch, depth, scale * _profile_ms(batch, depth, 900 * batch)))
    grids = [_builder(CLIP, backend, records).observation_grid() for backend in BACKENDS]
    np.testing.assert_allclose(grids[0], grids[1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(grids[0], _builder(BASE, "numpy", records).observation_grid())


def test_an_old_file_reads_the_field_off_and_bad_values_are_refused():
    data = CLIP.to_dict()
    assert data["latency_off_outlier_ratio"] == 1.25
    del data["latency_off_outlier_ratio"]
    assert FeatureSpec.from_dict(data).latency_off_outlier_ratio == 0.0
    shipped = ExportedPolicy.load("controller/data/default_policy.npz")
    assert shipped.feature_spec.latency_off_outlier_ratio == 0.0
    for value in (1.0, 0.5, -2.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="latency_off_outlier_ratio"):
            FeatureSpec(latency_off_outlier_ratio=value)

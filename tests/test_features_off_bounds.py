"""Two opt-in bounds on off's price over the handed profile, for run 73's lock-in (a few
re-entry warm-ups counted as off priced off at batch 32-48 1.3-1.8x the profile and the
server; docs/results/gpu22/LOCKIN.md), both feature backends:

* ``FeatureSpec.latency_off_ceiling``: off's predicted latency at most exp(ceiling) times
  the profile's off price while the stream trusts the profile;
* ``FeatureSpec.latency_off_outlier_ratio``: an off step measured over the ratio times the
  profile's off price (the plugin's re-entry warm-up, 2.2-3x an off step on the H200 MoE)
  enters the latency estimators at the ratio times, once the stream trusts the profile.
"""

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
CLIP = dataclasses.replace(BASE, latency_off_outlier_ratio=1.25)
CEILING_24 = dataclasses.replace(CEILING, latency_off_ceiling_batch=24.0)
RISING = dataclasses.replace(CEILING, latency_off_ceiling_samples=2.0)
BACKENDS = ["numpy", "compiled"]
#: The file shipped in the twenty-first and twenty-second sessions, before the ceiling.
BEFORE = "docs/results/gpu21/policy_5c3d9060.npz"
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


# -- latency_off_outlier_ratio ---------------------------------------------------------


def _exact(count: int) -> list[StepRecord]:
    """Decode steps at batch 1-8, off and depth 3 in runs of 10, each at the profile's
    price (the stream trusts the profile)."""
    out = []
    for i in range(count):
        batch, depth = 1 + i % 8, 3 if (i // 10) % 2 else 0
        out.append(_record(i, batch, depth, _profile_ms(batch, depth, KV_PER_REQUEST * batch)))
    return out


def _mixed(seed: int, scales: tuple[float, ...], start: int = 0,
           warmup_share: float = 0.0) -> list[StepRecord]:
    """``_exact(start)``, then steps to 400 at random batch sizes 1-63, off or depth 3, each
    at one of ``scales`` x the profile; an off step flagged a re-entry warm-up with
    probability ``warmup_share``."""
    rng = np.random.default_rng(seed)
    records = _exact(start)
    for i in range(start, 400):
        batch, depth = int(rng.integers(1, 64)), int(rng.choice([0, 3]))
        scale = float(rng.choice(scales))
        record = _record(i, batch, depth,
                         scale * _profile_ms(batch, depth, KV_PER_REQUEST * batch))
        if warmup_share and depth == 0 and rng.random() < warmup_share:
            record = dataclasses.replace(record, warmup=True)
        records.append(record)
    return records


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dear_off_step_enters_at_the_ratio_times_the_profile(backend):
    """A warm-up-like off step at batch 48 (2.8x the profile's off price, under the general
    clip's 3x) prices off there as a step of exactly 1.25x would; without the field it
    enters whole and prices off far dearer."""
    at48 = _profile_ms(48, 0, KV_PER_REQUEST * 48)
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
        records = [*_exact(60), _record(60, 48, 3, 2.8 * _profile_ms(48, 3, KV_PER_REQUEST * 48))]
    elif case == "early":
        records = [*_exact(5), _record(5, 48, 0, 2.8 * _profile_ms(48, 0, KV_PER_REQUEST * 48))]
    elif case == "untrusted":
        slow = [dataclasses.replace(r, step_latency_s=2.5 * r.step_latency_s)
                for r in _exact(200)]
        records = [*slow, _record(200, 48, 0, 2.8 * _profile_ms(48, 0, KV_PER_REQUEST * 48))]
    else:
        records = [*_exact(60), _record(60, 48, 0, 1.2 * _profile_ms(48, 0, KV_PER_REQUEST * 48))]
    clip = _builder(CLIP, backend, records)
    if case == "untrusted":
        assert clip.profile_log_error > BASE.latency_outlier_trust
    np.testing.assert_array_equal(clip.observation_grid(),
                                  _builder(BASE, backend, records).observation_grid())


# -- both fields ------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "seed", "scales", "start"), [
    (CEILING, 7, (0.6, 1.0, 2.5), 0),  # off below, at and far above the profile
    (CLIP, 5, (1.0, 1.1, 2.5), 40),  # after 40 exact steps: the stream trusts the profile
])
def test_both_backends_agree(spec, seed, scales, start):
    """The compiled backend bounds the same steps as numpy (a mixed stream), and the bound
    changes the features."""
    pytest.importorskip("numba")
    records = _mixed(seed, scales, start)
    grids = [_builder(spec, backend, records).observation_grid() for backend in BACKENDS]
    np.testing.assert_allclose(grids[0], grids[1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(grids[0], _builder(BASE, "numpy", records).observation_grid())


@pytest.mark.parametrize(("spec", "field", "value", "bad"), [
    (CEILING, "latency_off_ceiling", 0.1, (-0.1, float("nan"), float("inf"), True, "0.1")),
    (CLIP, "latency_off_outlier_ratio", 1.25,
     (1.0, 0.5, -2.0, float("nan"), float("inf"), True, "2")),
    (CEILING_24, "latency_off_ceiling_batch", 24.0,
     (-1.0, float("nan"), float("inf"), True, "24")),
    (RISING, "latency_off_ceiling_samples", 2.0, (-1.0, float("nan"), float("inf"), True, "2")),
])
def test_an_old_file_reads_the_field_off_and_bad_values_are_refused(spec, field, value, bad):
    data = spec.to_dict()
    assert data[field] == value
    del data[field]
    assert getattr(FeatureSpec.from_dict(data), field) == 0.0
    before = ExportedPolicy.load(BEFORE)  # written before either field existed
    assert getattr(before.feature_spec, field) == 0.0
    for wrong in bad:
        with pytest.raises(ValueError, match=field):
            FeatureSpec(**{field: wrong})


# -- latency_off_ceiling_batch ----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ceiling_from_a_batch_bounds_off_only_there(backend):
    """Off measured at 2.5x the profile: with ``latency_off_ceiling_batch`` 24, off at batch
    8 is priced as without the ceiling (the warm-ups' excess kept where off runs often) and
    at batch 32 and 48 as with the ceiling at every batch; the other depths unchanged."""
    records = _stream(2.5)
    from_24 = _builder(CEILING_24, backend, records).latency_predictions_s(AT)
    everywhere = _builder(CEILING, backend, records).latency_predictions_s(AT)
    whole = _builder(BASE, backend, records).latency_predictions_s(AT)
    assert from_24[0, 0] == whole[0, 0] > 1.3 * everywhere[0, 0]
    np.testing.assert_array_equal(from_24[1:, 0], everywhere[1:, 0])
    np.testing.assert_array_equal(from_24[:, 1:], whole[:, 1:])


def test_the_ceiling_from_a_batch_agrees_across_backends():
    """A mixed stream at batch 1-63: the compiled backend bounds the same batch sizes."""
    pytest.importorskip("numba")
    records = _mixed(11, (0.6, 1.0, 2.5))
    grids = [_builder(CEILING_24, backend, records).observation_grid() for backend in BACKENDS]
    np.testing.assert_allclose(grids[0], grids[1], rtol=1e-5, atol=1e-6)
    for other in (CEILING, BASE):
        assert not np.allclose(grids[0], _builder(other, "numpy", records).observation_grid())


# -- latency_off_ceiling_samples --------------------------------------------------------


def _flagged(records: list[StepRecord]) -> list[StepRecord]:
    """``records`` with every off step flagged the plugin's re-entry warm-up."""
    return [dataclasses.replace(r, warmup=True) if r.steps_used == 0 else r for r in records]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ceiling_rises_to_what_off_measured_near_the_batch(backend):
    """Off measured at 2.5x the profile at every batch size, speculation at the profile
    (a profile that prices off too low, trusted): the bare ceiling holds off at 1.105x the
    profile; with ``latency_off_ceiling_samples`` off's 30 own steps raise it to what they
    measured (2.5x the profile), or to the regression's price where that is lower. Depths
    1-7 unchanged."""
    records = _stream(2.5)
    rising = _builder(RISING, backend, records).latency_predictions_s(AT)
    bare = _builder(CEILING, backend, records).latency_predictions_s(AT)
    whole = _builder(BASE, backend, records).latency_predictions_s(AT)
    kv = records[-1].kv_used_tokens
    measured = 2.5 * np.array([_profile_ms(int(b), 0, kv) for b in AT]) / 1e3
    assert (rising[:, 0] > 1.5 * bare[:, 0]).all(), (rising[:, 0], bare[:, 0])
    np.testing.assert_allclose(rising[:, 0], np.minimum(whole[:, 0], measured), rtol=0.1)
    np.testing.assert_array_equal(rising[:, 1:], whole[:, 1:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["warm-ups", "cheap", "run 73"])
def test_the_ceiling_does_not_rise_for_warmups_or_off_near_the_profile(backend, case):
    """The same ceiling as the bare one, bit for bit: off's dear steps all flagged re-entry
    warm-ups; off measured at 0.6x the profile; and run 73's mix (off at the profile,
    every other off step a flagged warm-up at 2.5x)."""
    if case == "warm-ups":
        records = _flagged(_stream(2.5))
    elif case == "cheap":
        records = _stream(0.6)
    else:
        records = []
        for i, r in enumerate(_stream(1.0)):
            if i % 20 == 9:  # every other off step
                r = dataclasses.replace(r, warmup=True, step_latency_s=2.5 * r.step_latency_s)
            records.append(r)
    rising = _builder(RISING, backend, records)
    np.testing.assert_array_equal(rising.observation_grid(),
                                  _builder(CEILING, backend, records).observation_grid())
    if case != "cheap":  # the warm-ups' excess is what the ceiling bounds
        assert not np.array_equal(rising.observation_grid(),
                                  _builder(BASE, backend, records).observation_grid())


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_dear_off_step_raises_the_ceiling_only_partly_and_only_near_it(backend):
    """One off step measured at 2.5x at batch 48 among exact ones elsewhere: off's price at
    batch 48 rises above the bare ceiling but well short of 2.5x (weight 1 - exp(-1/2));
    at batch 4 (two buckets and more away) it stays at the bare ceiling's."""
    at48 = _profile_ms(48, 0, KV_PER_REQUEST * 48)
    records = [*_exact(60), _record(60, 48, 0, 2.5 * at48)]
    at = np.array([4, 48])
    rising = _builder(RISING, backend, records).latency_predictions_s(at)
    bare = _builder(CEILING, backend, records).latency_predictions_s(at)
    assert rising[0, 0] == bare[0, 0]
    assert 1.2 * bare[1, 0] < rising[1, 0] < 2.0 * bare[1, 0], (rising[:, 0], bare[:, 0])


def test_the_rising_ceiling_agrees_across_backends():
    """A mixed stream at batch 1-63 with flagged warm-ups: both backends raise the
    ceiling at the same batch sizes by the same factors."""
    pytest.importorskip("numba")
    records = _mixed(13, (0.6, 1.0, 2.5), warmup_share=0.3)
    grids = [_builder(RISING, backend, records).observation_grid() for backend in BACKENDS]
    np.testing.assert_allclose(grids[0], grids[1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(grids[0], _builder(CEILING, "numpy", records).observation_grid())

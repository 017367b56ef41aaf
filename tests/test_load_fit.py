"""env.sim.load_fit: the KV and prefill terms come back from steps made with known coefficients."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env.sim.cost_model import CostProfile, ServerLimits
from env.sim.load_fit import (
    StepArrays,
    fit_load_profile,
    fit_speculative_on_plain,
    load_points,
    prefill_attributed,
)

SERVER = ServerLimits(max_running_requests=64, kv_capacity_tokens=200_000,
                      chunked_prefill_tokens=8192)
#: Depth-0 columns of c_request (batch), c_token (batch + prompt) and c_prefill_token
#: (prompt) are dependent: a plain-decode fit frees two of them.
PLAIN = ("c_fixed", "c_request", "c_prefill_token")
SPEC = ("c_fixed", "c_request", "c_token", "c_prefill_token", "c_steps0_kv", "c_verify",
        "c_draft")


def truth_profile(**coefficients: float) -> CostProfile:
    return CostProfile("truth", SERVER, **coefficients)


def synthetic_steps(truth: CostProfile, rng: np.random.Generator, n: int = 4000,
                    spec_every: int = 0, warmup_factor: float = 1.0) -> StepArrays:
    """Decode steps whose KV use varies apart from the batch size, and prefills.

    With ``spec_every`` a block of speculative steps (depths 1, 3, 5) runs every that many
    steps, entered through a depth-0 warm-up that costs ``warmup_factor`` x a plain decode.
    """
    batch = rng.integers(1, 49, n)
    kv = batch * rng.integers(200, 1300, n)  # long and short contexts at every batch size
    prefill = np.where(rng.random(n) < 0.15, rng.choice([16, 100, 300, 1000, 3000], n), 0)
    batch = np.where(prefill > 0, 0, batch)
    depth = np.zeros(n, dtype=np.int64)
    if spec_every:
        for start in range(spec_every // 2, n - 20, spec_every):
            depth[start:start + 20] = rng.choice([1, 3, 5])
    # depth-0 decode steps are the off path: a plain decode, not on the speculative path
    latency = truth.step_latency_array(batch, depth, kv, prefill, draft_extend=prefill > 0,
                                       speculative_path=depth > 0)
    if spec_every:
        warm = np.flatnonzero((depth[1:] > 0) & (depth[:-1] == 0) & (batch[:-1] > 0))
        latency[warm] *= warmup_factor
    return StepArrays(batch, depth, kv.astype(float), prefill, latency)


@settings(max_examples=15, deadline=None)
@given(fixed=st.floats(2e-3, 8e-3), request=st.floats(1e-5, 2e-4),
       prefill=st.floats(2e-6, 3e-5), seed=st.integers(0, 2**16))
def test_plain_fit_recovers_per_request_and_prefill_costs(fixed, request, prefill, seed):
    truth = truth_profile(c_fixed=fixed, c_request=request, c_prefill_token=prefill)
    steps = synthetic_steps(truth, np.random.default_rng(seed))
    fitted, _ = fit_load_profile(steps, CostProfile("template", SERVER), PLAIN, ties={})
    for name in PLAIN:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.02)


@settings(max_examples=10, deadline=None)
@given(kv=st.floats(5e-8, 8e-7), verify=st.floats(1e-4, 2e-3), seed=st.integers(0, 2**16))
def test_spec_fit_recovers_speculative_path_kv_cost(kv, verify, seed):
    truth = truth_profile(c_fixed=5e-3, c_request=4e-5, c_token=5e-6, c_prefill_token=1e-5,
                          c_steps0_kv=kv, c_verify=verify, c_draft=2e-4)
    steps = synthetic_steps(truth, np.random.default_rng(seed), spec_every=60)
    fitted, _ = fit_load_profile(steps, CostProfile("template", SERVER), SPEC, ties={})
    assert fitted.c_steps0_kv == pytest.approx(kv, rel=0.05)
    assert fitted.c_kv == 0.0
    # the plain decode steps, the majority, were made without any KV cost and stay so
    plain = {"draft_extend": False, "speculative_path": False}
    assert fitted.step_latency_s(32, 0, 40_000, **plain) == pytest.approx(
        truth.step_latency_s(32, 0, 0, **plain), rel=0.02)


@pytest.mark.parametrize("share", [1.0, 0.25])
def test_speculative_terms_fitted_on_a_plain_profile_find_the_draft_token_share(share):
    """The MoE's speculative server as its plain profile + verify terms (run 9): the
    plain terms stay, the verify terms and a draft token's share of experts are found."""
    plain = truth_profile(c_fixed=3.4e-3, c_request=1.4e-5, c_moe=1.3e-2, c_kv=4e-8,
                          c_prefill_token=1e-5, moe_active_fraction=8 / 128)
    truth = plain.replace(c_verify=1.8e-3, c_verify_token=7e-5, c_steps0_kv=7e-7,
                          moe_draft_token_share=share)
    steps = synthetic_steps(truth, np.random.default_rng(7), spec_every=40)
    fitted, report, by_share = fit_speculative_on_plain([steps], plain)
    assert fitted.moe_draft_token_share == share and min(by_share.values()) == by_share[share]
    # (points are group means at the group's median KV within 4k-token bins: a few % off)
    for name in ("c_verify", "c_verify_token", "c_steps0_kv"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.1)
    for name in ("c_fixed", "c_request", "c_moe", "c_kv", "c_prefill_token"):
        assert getattr(fitted, name) == getattr(plain, name)  # never bent to the spec steps
    assert report.median_abs_error < 0.01
    with pytest.raises(ValueError, match="no speculative decode step"):
        fit_speculative_on_plain([synthetic_steps(truth, np.random.default_rng(7))], plain)
    # its points: the speculative decode steps alone, no plain decode, no prefill
    points = load_points([steps], speculative_only=True)
    assert (points.depth > 0).all() and (points.prefill_tokens == 0).all()
    assert len(points) < len(load_points([steps]))
    with pytest.raises(ValueError, match="exclude each other"):
        load_points([steps], plain_only=True, speculative_only=True)


@given(batch=st.integers(1, 64), depth=st.integers(0, 7), prefill=st.integers(1, 8192),
       kv=st.integers(0, 200_000))
def test_c_steps0_kv_is_paid_by_speculative_path_decode_steps_only(batch, depth, prefill, kv):
    profile = truth_profile(c_fixed=5e-3, c_request=4e-5, c_steps0_kv=4e-7, c_verify=1e-3)
    base = profile.replace(c_steps0_kv=0.0)
    # prefill steps and plain decode steps (off path): no such term
    assert profile.step_latency_s(0, 0, kv, prefill) == base.step_latency_s(0, 0, kv, prefill)
    off = {"draft_extend": False, "speculative_path": False}
    assert profile.step_latency_s(batch, 0, kv, **off) == base.step_latency_s(batch, 0, kv, **off)
    # verify steps and SGLang's steps=0: linear in the KV tokens
    for d in (max(depth, 1), 0):
        extra = profile.step_latency_s(batch, d, kv) - base.step_latency_s(batch, d, kv)
        assert extra == pytest.approx(4e-7 * kv, abs=1e-12)
    array = profile.step_latency_array([batch, batch, 0], [depth, 0, 0], kv, [0, 0, prefill],
                                       [True, False, True], [True, False, True])
    scalar = [profile.step_latency_s(batch, depth, kv, 0, True, True),
              profile.step_latency_s(batch, 0, kv, 0, False, False),
              profile.step_latency_s(0, 0, kv, prefill, True, True)]
    assert array == pytest.approx(scalar)


def test_prefill_cost_recorded_on_its_neighbour_is_moved_back_and_recovered():
    truth = truth_profile(c_fixed=5e-3, c_request=4e-5, c_prefill_token=2e-5)
    rng = np.random.default_rng(7)
    steps = synthetic_steps(truth, rng, n=6000)
    # Overlap scheduling: 60% of each prefill's time is recorded on the decode step before.
    latency = steps.latency_s.copy()
    before = np.flatnonzero((steps.prefill_tokens[1:] > 0) & (steps.batch_size[:-1] > 0))
    moved = 0.6 * latency[before + 1]
    latency[before] += moved
    latency[before + 1] -= moved
    shifted = StepArrays(steps.batch_size, steps.depth, steps.kv_tokens, steps.prefill_tokens,
                         latency)
    restored = prefill_attributed(shifted)
    assert restored.sum() == pytest.approx(latency.sum())
    fitted, _ = fit_load_profile(shifted, CostProfile("template", SERVER), PLAIN, ties={})
    assert fitted.c_prefill_token == pytest.approx(2e-5, rel=0.05)
    assert fitted.c_request == pytest.approx(4e-5, rel=0.05)


def test_warm_up_steps_next_to_speculation_are_left_out():
    truth = truth_profile(c_fixed=5e-3, c_request=5e-5, c_verify=2e-3)
    steps = synthetic_steps(truth, np.random.default_rng(3), spec_every=100, warmup_factor=3.0)
    points = load_points(steps)
    decode0 = (points.depth == 0) & (points.prefill_tokens == 0)
    predicted = truth.step_latency_array(points.batch_size[decode0], 0, 0, 0,
                                         draft_extend=False, speculative_path=False)
    assert np.all(points.latency_s[decode0] < 1.5 * predicted)
    unguarded = load_points(steps, switch_guard=0)
    d0 = (unguarded.depth == 0) & (unguarded.prefill_tokens == 0)
    assert np.any(unguarded.latency_s[d0] > 1.5 * truth.step_latency_array(
        unguarded.batch_size[d0], 0, 0, 0, draft_extend=False, speculative_path=False))


def test_step_arrays_reject_ragged_columns():
    with pytest.raises(ValueError, match="kv_tokens has 2 entries, expected 3"):
        StepArrays(np.ones(3), np.zeros(3), np.ones(2), np.zeros(3), np.ones(3))


def test_measured_runs_reads_offswitch_layout_and_names_skipped(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts/h200"))
    from measured_runs import read_run_dir

    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    (tmp_path / "moe_nospec.json").write_text(json.dumps(
        {"model": "models_moe", "sweep": {"8": summary}, "headline": summary}))
    (tmp_path / "dense_acc3.5_replay.json").write_text(json.dumps(
        {"model": "models", "acceptance": 3.5, "headline_ppo": summary}))
    (tmp_path / "notes.json").write_text("{}")
    cells, skipped = read_run_dir(tmp_path)
    keys = sorted(c.key() for c in cells)
    assert keys == ["nospec headline 40s no_spec", "nospec one_batch C=8 no_spec",
                    "spec_off@3.5 headline 40s ppo"]
    assert {c.model for c in cells if c.server == "nospec"} == {"moe"}
    assert list(skipped) == ["notes.json"]
    (tmp_path / "dense_off.json").write_text(json.dumps({"sweep_off": {"1": {"oops": 1}}}))
    with pytest.raises(ValueError, match=r"dense_off\.json:sweep_off\.1"):
        read_run_dir(tmp_path)


def test_phases_cut_a_trace_of_several_runs_at_its_longest_pauses():
    # three runs of 40 steps 10 ms apart, 2 s and 3 s pauses between them; a 5 s pause in
    # the warm-up (first step) is not a cut
    times = np.r_[0.0, 5.0 + np.arange(39) * 0.01]
    times = np.r_[times, times[-1] + 2.0 + np.arange(40) * 0.01]
    times = np.r_[times, times[-1] + 3.0 + np.arange(40) * 0.01]
    n = len(times)
    steps = StepArrays(np.arange(n), np.zeros(n), np.zeros(n), np.zeros(n), np.ones(n),
                       time_s=times)
    first, second, third = steps.phases(3)
    assert [len(p.latency_s) for p in (first, second, third)] == [40, 40, 40]
    assert second.batch_size[0] == 40 and third.batch_size[0] == 80
    with pytest.raises(ValueError, match="needs time_s"):
        StepArrays(np.ones(4), np.zeros(4), np.zeros(4), np.zeros(4), np.ones(4)).phases(2)


def test_within_batch_kv_slope_finds_the_kv_cost_a_joint_fit_cannot_place():
    from env.sim.load_fit import within_batch_kv_slope

    rng = np.random.default_rng(0)
    batch = np.repeat([8, 32, 48], 200)
    # about 330 cached tokens per request: KV moves with the batch, plus a spread within
    kv = batch * 330.0 + rng.uniform(-3000, 3000, len(batch))
    latency = 5e-3 + 2e-4 * batch + 35e-9 * kv + rng.normal(0, 5e-5, len(batch))
    n = len(batch)
    steps = StepArrays(batch, np.zeros(n), kv, np.zeros(n), latency)
    assert within_batch_kv_slope(steps) == pytest.approx(35e-9, rel=0.1)
    # speculative steps are not depth 0's
    spec = dataclasses.replace(steps, depth=np.full(n, 3))
    with pytest.raises(ValueError, match="depth-0 decode steps"):
        within_batch_kv_slope(spec)
    assert within_batch_kv_slope(spec, depth=3) == pytest.approx(35e-9, rel=0.1)


def test_a_run_can_lend_its_prefill_steps_alone():
    n = 40
    batch = np.where(np.arange(n) % 10 == 5, 0, 8)
    prefill = np.where(batch == 0, 512, 0)
    latency = np.where(batch == 0, 30e-3, 6e-3)
    steps = StepArrays(batch, np.zeros(n), np.full(n, 3000.0), prefill, latency)
    both = load_points(steps)
    only = load_points(dataclasses.replace(steps, decodes_measured=False))
    assert (both.prefill_tokens == 0).any()
    assert (only.prefill_tokens > 0).all()
    np.testing.assert_allclose(only.latency_s, both.latency_s[both.prefill_tokens > 0])


def test_step_medians_keep_clean_steps_of_one_depth():
    from env.sim.load_fit import step_medians

    n = 60
    batch = np.full(n, 8)
    depth = np.where(np.arange(n) < 30, 0, 3)
    prefill = np.zeros(n, dtype=np.int64)
    prefill[10] = 512
    latency = np.where(depth == 0, 6e-3, 12e-3)
    latency[[9, 11]] = 40e-3  # next to the prefill: left out
    steps = StepArrays(batch, depth, np.full(n, 2000.0), prefill, latency)
    plain, three = step_medians(steps, 0), step_medians(steps, 3)
    assert plain[8][0] == pytest.approx(6e-3) and three[8][0] == pytest.approx(12e-3)
    # depth-0 steps within 5 of a speculative one are warm-ups, not plain steps
    assert step_medians(dataclasses.replace(steps, latency_s=np.where(
        (np.arange(n) >= 25) & (np.arange(n) < 30), 1.0, latency)), 0)[8][0] == pytest.approx(6e-3)
    assert step_medians(steps, 5) == {}


def test_a_trace_holding_two_recording_sessions_is_refused():
    """Run 8's first trace copies held earlier servers' files (a warm machine kept the
    folder): the two step series interleave, so the fit must refuse, naming the cause."""
    from env.traces.trace_format import RequestColumns, StepRecord, Trace

    def step(i: int, t: float, depth: int) -> StepRecord:
        return StepRecord("h200", 0, i, t, 1, 0, 1, 300, 10**6, 0, depth,
                          np.array([], np.int8), 0.004)

    one = [step(i, 0.01 * i, 0) for i in range(5)]
    assert len(StepArrays.from_trace(Trace(RequestColumns.empty(), one)).latency_s) == 5
    other = [step(i, 0.01 * i + 0.005, 3) for i in range(3)]
    with pytest.raises(ValueError, match="several recording sessions"):
        StepArrays.from_trace(Trace(RequestColumns.empty(), one + other))

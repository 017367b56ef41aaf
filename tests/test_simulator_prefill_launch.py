"""The prefill's launch booked on the decode step before it (``CostProfile.prefill_launch_s``,
``prefill_launch_hidden``; ``env/sim/simulator.py``, "The prefill's launch")."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import CostProfile, ServerLimits, load_profile, profile_from_dict
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.workloads import ClosedLoop, Workload
from tests.test_simulator import _drain

LIMITS = ServerLimits(max_running_requests=8, kv_capacity_tokens=200_000,
                      chunked_prefill_tokens=1024)
BASE = CostProfile(name="t", server=LIMITS, c_fixed=5e-3, c_request=1e-4, c_token=2e-6,
                   c_verify=5e-4, c_draft=4e-4, c_extend=4e-4, c_prefill_token=1.5e-5)
#: Booked 6 ms less 0.3 of the step's own latency: 6 - 0.3 * (5.1-7 ms) > 0 everywhere.
LAUNCH = dataclasses.replace(BASE, prefill_launch_s=6e-3, prefill_launch_hidden=0.3)


class _OldInterface:
    """A profile as the simulator knew them before the launch: ``step_latency_s`` only."""

    def __init__(self, profile: CostProfile) -> None:
        self._profile = profile
        self.server = profile.server

    def step_latency_s(self, *args, **kwargs) -> float:
        return self._profile.step_latency_s(*args, **kwargs)


def _workload(seed: int, n: int = 120, rate: float = 40.0) -> Workload:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate, n))
    return Workload("t", arrival, rng.integers(20, 1500, n).astype(np.int32),
                    rng.integers(1, 60, n).astype(np.int32))


def _run(profile, workload, *, finish_lag: int = 1, depths=(0, 3, 3, 1), seed: int = 0):
    """Every record of a run (depths cycled over the decode steps) and the simulator."""
    config = SchedulerConfig(max_running_requests=8, kv_capacity_tokens=200_000,
                             chunked_prefill_tokens=1024, finish_lag_steps=finish_lag)
    sim = Simulator(profile, SGLangSimulatedAcceptance(2.5, batch_wide=False), workload,
                    config, seed=seed)
    return _drain(sim, list(depths)), sim


def _same_schedule(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.is_decode, x.batch_size, x.prefill_tokens, x.steps_used,
                x.waiting_requests, x.running_requests, x.kv_used_tokens) == (
            y.is_decode, y.batch_size, y.prefill_tokens, y.steps_used,
            y.waiting_requests, y.running_requests, y.kv_used_tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("finish_lag", [0, 1])
def test_the_launch_lands_on_the_decode_step_before_a_prefill_and_nowhere_else(seed,
                                                                               finish_lag):
    wl = _workload(seed)
    old, _ = _run(BASE, wl, finish_lag=finish_lag, seed=seed)
    new, _ = _run(LAUNCH, wl, finish_lag=finish_lag, seed=seed)
    _same_schedule(old, new)
    booked_steps = 0
    def back_to_back(i: int) -> bool:  # no idle gap: the prefill was launched meanwhile
        return old[i + 1].time_s == pytest.approx(old[i].time_s + old[i].step_latency_s,
                                                  abs=1e-12)

    for i, (o, n) in enumerate(zip(old, new, strict=True)):
        before_prefill = (o.is_decode and i + 1 < len(old) and not old[i + 1].is_decode
                          and back_to_back(i))
        after_booked = not o.is_decode and i > 0 and old[i - 1].is_decode and back_to_back(i - 1)
        if before_prefill:
            booked = LAUNCH.prefill_launch_booked_s(o.step_latency_s)
            assert booked > 0
            assert n.step_latency_s == pytest.approx(o.step_latency_s + booked, abs=1e-12)
            assert n.time_s == pytest.approx(o.time_s, abs=1e-9)
            booked_steps += 1
        elif after_booked:  # launched at the step's own end, run after the booking
            booked = LAUNCH.prefill_launch_booked_s(old[i - 1].step_latency_s)
            assert n.step_latency_s == pytest.approx(o.step_latency_s - booked, abs=1e-12)
            assert n.time_s == pytest.approx(o.time_s + booked, abs=1e-9)
            assert n.time_s + n.step_latency_s == pytest.approx(
                o.time_s + o.step_latency_s, abs=1e-9)
        else:
            assert n.step_latency_s == o.step_latency_s
            assert n.time_s == pytest.approx(o.time_s, abs=1e-9)
    assert booked_steps > 10  # the workload has such steps at all


@pytest.mark.parametrize("seed", [0, 3])
def test_the_sum_of_step_latencies_and_the_clock_are_unchanged(seed):
    wl = _workload(seed)
    old, old_sim = _run(BASE, wl, seed=seed)
    new, new_sim = _run(LAUNCH, wl, seed=seed)
    assert sum(r.step_latency_s for r in new) == pytest.approx(
        sum(r.step_latency_s for r in old), rel=1e-12)
    assert new_sim.time_s == pytest.approx(old_sim.time_s, rel=1e-12)
    # Time is moved, not made: the decode steps carry more, the prefills less.
    decode = [(o.step_latency_s, n.step_latency_s) for o, n in zip(old, new, strict=True)
              if o.is_decode]
    assert sum(n for _, n in decode) > sum(o for o, _ in decode) + 0.01
    # Answers of a step before a prefill come at its new end; first tokens are unchanged.
    old_stats, new_stats = old_sim.stats(), new_sim.stats()
    np.testing.assert_allclose(new_stats.first_token_s, old_stats.first_token_s, atol=1e-9)
    later = new_stats.finish_s - old_stats.finish_s
    assert (later >= -1e-9).all() and (later > 1e-6).any()
    assert later.max() <= LAUNCH.prefill_launch_s + 1e-9


def test_a_prefill_cheaper_than_its_booking_keeps_zero_and_the_rest_stays_added():
    # One request decoding when a second, short one arrives: its prefill costs about 5 ms,
    # the booking 200 ms (after it nothing else arrives, so the schedule stays the same).
    big = dataclasses.replace(BASE, prefill_launch_s=0.2, prefill_launch_hidden=0.0)
    wl = Workload("t", np.array([0.0, 0.05]), np.array([500, 10], np.int32),
                  np.array([30, 5], np.int32))
    old, _ = _run(BASE, wl)
    new, _ = _run(big, wl)
    _same_schedule(old, new)
    i = next(i for i, r in enumerate(old) if i and not r.is_decode and old[i - 1].is_decode)
    assert old[i].step_latency_s < 0.2
    assert new[i].step_latency_s == 0.0
    assert new[i - 1].step_latency_s == pytest.approx(old[i - 1].step_latency_s + 0.2)
    assert sum(r.step_latency_s for r in new) == pytest.approx(
        sum(r.step_latency_s for r in old) + 0.2 - old[i].step_latency_s, rel=1e-12)


def test_the_launch_hides_behind_a_long_decode_step():
    profile = dataclasses.replace(BASE, prefill_launch_s=8e-3, prefill_launch_hidden=0.36)
    assert profile.prefill_launch_booked_s(5e-3) == pytest.approx(8e-3 - 0.36 * 5e-3)
    assert profile.prefill_launch_booked_s(30e-3) == 0.0
    # a step that hides it all books nothing, and its prefill keeps its whole cost
    hidden = dataclasses.replace(BASE, prefill_launch_s=1e-3, prefill_launch_hidden=1.0)
    wl = _workload(5, n=40)
    old, _ = _run(BASE, wl, seed=5)
    new, _ = _run(hidden, wl, seed=5)
    assert [r.step_latency_s for r in new] == [r.step_latency_s for r in old]


@pytest.mark.parametrize("closed", [False, True])
def test_zero_reproduces_the_simulator_without_it_exactly(monkeypatch, closed):
    def never(*_args, **_kwargs):
        raise AssertionError("a profile with prefill_launch_s = 0 booked a launch")

    monkeypatch.setattr(Simulator, "_book_prefill_launch", never)
    wl = (ClosedLoop(concurrency=6, prompt_tokens=300, output_tokens=40,
                     requests_per_client=5) if closed else _workload(6))
    zero, zero_sim = _run(BASE, wl, seed=6)
    old, old_sim = _run(_OldInterface(BASE), wl, seed=6)
    assert len(zero) == len(old)
    for a, b in zip(zero, old, strict=True):
        for f in dataclasses.fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if isinstance(va, np.ndarray):
                np.testing.assert_array_equal(va, vb)
            else:
                assert va == vb, f.name
    assert zero_sim.time_s == old_sim.time_s
    np.testing.assert_array_equal(zero_sim.stats().finish_s, old_sim.stats().finish_s)


def test_closed_loop_books_the_launch_too():
    wl = ClosedLoop(concurrency=6, prompt_tokens=300, output_tokens=40, requests_per_client=5)
    old, old_sim = _run(BASE, wl, seed=7)
    new, new_sim = _run(LAUNCH, wl, seed=7)
    _same_schedule(old, new)
    assert any(n.step_latency_s > o.step_latency_s for o, n in zip(old, new, strict=True))
    assert new_sim.time_s == pytest.approx(old_sim.time_s, rel=1e-12)


def test_a_reset_forgets_the_prefill_the_last_decode_step_found_due():
    # advance() reuses the decision the decode step just made (``_due_after_step``); a
    # reset in between (an episode cut at its horizon) must not carry it into the next one.
    wl = _workload(8)
    config = SchedulerConfig(max_running_requests=8, kv_capacity_tokens=200_000,
                             chunked_prefill_tokens=1024, finish_lag_steps=1)
    sim = Simulator(LAUNCH, SGLangSimulatedAcceptance(2.5, batch_wide=False), wl, config,
                    seed=8)
    sim.advance()
    while not sim.decode(3).before_prefill:
        sim.advance()
    sim.reset()
    fresh = Simulator(LAUNCH, SGLangSimulatedAcceptance(2.5, batch_wide=False), wl, config,
                      seed=8)
    for a, b in zip(sim.advance(), fresh.advance(), strict=True):
        assert (a.time_s, a.prefill_tokens, a.step_latency_s) == (
            b.time_s, b.prefill_tokens, b.step_latency_s)
    assert sim.time_s == fresh.time_s


def test_profile_fields_load_save_and_validate(tmp_path):
    from env.sim.cost_model import save_profile

    path = save_profile(LAUNCH, tmp_path / "p.yaml")
    again = load_profile(path)
    assert (again.prefill_launch_s, again.prefill_launch_hidden) == (6e-3, 0.3)
    # a profile without it writes neither field (shipped files without it unchanged)
    assert "prefill_launch_s" not in save_profile(BASE, tmp_path / "b.yaml").read_text()
    for bad in (-1e-3, float("nan"), True):
        with pytest.raises(ValueError):
            dataclasses.replace(BASE, prefill_launch_s=bad)
    data = LAUNCH.to_dict()
    data["cost"]["prefill_launch_hidden"] = -0.1
    with pytest.raises(ValueError):
        profile_from_dict(data)


@pytest.mark.parametrize("name, fitted", [("h200_llama31_8b", (8.0e-3, 0.36)),
                                          ("h200_llama31_8b_recorded", (8.0e-3, 0.36)),
                                          ("h200_qwen3_30b_a3b", (4.8e-3, 0.24)),
                                          ("h100_llama31_8b", (0.0, 0.0)),
                                          ("blackwell_tp8", (0.0, 0.0))])
def test_the_shipped_profiles_carry_the_measured_launch(name, fitted):
    profile = load_profile(name)
    assert (profile.prefill_launch_s, profile.prefill_launch_hidden) == pytest.approx(fitted)


@pytest.mark.parametrize("profile", [LAUNCH, dataclasses.replace(BASE, prefill_launch_s=1e-3,
                                                                  prefill_launch_hidden=1.0)])
@pytest.mark.parametrize("finish_lag", [0, 1])
def test_before_prefill_flags_the_decode_step_a_prefill_follows_and_nothing_else(profile,
                                                                                  finish_lag):
    wl = _workload(8)
    old, _ = _run(BASE, wl, finish_lag=finish_lag, seed=8)
    new, _ = _run(profile, wl, finish_lag=finish_lag, seed=8)
    _same_schedule(old, new)
    assert all(r.before_prefill is None for r in old)  # 0: flags nothing, as before
    flagged = 0
    for i, (o, n) in enumerate(zip(old, new, strict=True)):
        follows = (o.is_decode and i + 1 < len(old) and not old[i + 1].is_decode
                   and old[i + 1].time_s == pytest.approx(o.time_s + o.step_latency_s,
                                                          abs=1e-12))
        assert n.before_prefill is follows, i  # (the hidden profile books 0 and still flags)
        flagged += follows
    assert flagged > 10

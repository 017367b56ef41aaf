"""The decision loop: the feedback lag, the horizon's time accounting, the SLO count."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env.features import FeatureSpec, Observation
from env.rollout import DecisionLoop, rollout
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import Simulator
from env.traces.workloads import ClosedLoop

PROFILE = load_profile("h200_llama31_8b")


def _loop(concurrency: int = 4, output: int = 40, requests: int | None = 2,
          **options) -> DecisionLoop:
    workload = ClosedLoop(concurrency, 64, output, requests_per_client=requests)
    # Acceptance of mean 3.5: 2 or 3 drafts at random, so the seed matters.
    return DecisionLoop(Simulator(PROFILE, SGLangSimulatedAcceptance(3.5), workload), **options)


class _Static:
    def __init__(self, depth: int) -> None:
        self.name, self.depth = f"static_{depth}", depth

    def reset(self, sim=None) -> None:
        pass

    def act(self, obs) -> int:
        return self.depth


@pytest.mark.parametrize("lag", [1, 2, 3, 5])
def test_a_decision_sees_exactly_the_steps_up_to_its_own_minus_the_lag(lag):
    loop = _loop(feedback_lag=lag)
    seen: list[int] = []
    update = loop.features.update
    loop.features.update = lambda record: (seen.append(record.step_index), update(record))[1]
    obs = loop.reset(seed=0)
    checked = 0
    while obs is not None:
        due = loop.sim.step_index  # the step this decision is for
        assert not seen or seen[-1] <= due - lag
        if due - lag >= 0:  # every step up to due - lag has been seen, in order
            assert seen == list(range(due - lag + 1)), (due, seen[-3:])
            checked += 1
        obs, _ = loop.step(3)
    assert checked > 10


@pytest.mark.parametrize("keep", [False, True])
def test_a_kept_stream_sees_every_step_once_the_episode_ends(keep):
    """A stream carried to a later load (``keep_features``) has folded every record of the
    episode, the last ``lag`` ones included, as a real controller would have received
    them; a stream started afresh need not."""
    loop = _loop(feedback_lag=3)
    seen: list[int] = []
    update = loop.features.update
    loop.features.update = lambda record: (seen.append(record.step_index), update(record))[1]
    rollout(loop, _Static(3), seed=0, keep_features=keep)
    steps = loop.sim.step_index
    if keep:
        assert seen == list(range(steps))
    else:  # the lag held the last records back; a fresh start discards them
        assert seen == list(range(len(seen))) and len(seen) < steps


def test_a_lag_below_one_is_refused():
    with pytest.raises(ValueError) as info:
        _loop(feedback_lag=0)
    assert str(info.value) == "feedback_lag must be >= 1 (a step's own result is never known)"


@settings(max_examples=15, deadline=None)
@given(horizon=st.floats(0.02, 1.5), depth=st.integers(0, 7))
def test_time_and_tokens_stop_at_the_horizon(horizon, depth):
    loop = _loop(concurrency=8, output=400, requests=None, horizon_s=horizon)
    obs = loop.reset(seed=1)
    assert loop.tokens == loop.sim.output_tokens_total > 0  # the first prefill counts
    assert loop.elapsed_s == loop.sim.time_s
    while obs is not None:
        tokens0, t0 = loop.sim.output_tokens_total, loop.sim.time_s
        obs, last = loop.step(depth)
        committed, t1 = loop.sim.output_tokens_total - tokens0, loop.sim.time_s
        if not last.truncated:  # whole steps count in full
            assert (last.tokens, last.elapsed_s) == (committed, pytest.approx(t1 - t0))
            assert obs.batch_size == loop.sim.batch_size  # the batch the decision is for
    assert last.truncated is True and last.terminated is False
    # The step that crosses the horizon counts the share of it that lies inside.
    fraction = (horizon - t0) / (t1 - t0)
    assert last.elapsed_s == pytest.approx(horizon - t0, rel=1e-9)
    assert last.tokens == pytest.approx(committed * fraction, rel=1e-9)
    assert last.slo_violating_tokens == 0.0  # no SLO given
    assert loop.elapsed_s == pytest.approx(horizon, rel=1e-9)
    assert loop.throughput_tok_s == pytest.approx(loop.tokens / horizon, rel=1e-9)


def test_the_slow_tokens_of_the_crossing_step_are_prorated_too():
    loop = _loop(concurrency=8, output=400, requests=None, horizon_s=0.2, slo_tpot_s=1e-9)
    obs = loop.reset(seed=1)
    while obs is not None:
        t0 = loop.sim.time_s
        obs, last = loop.step(3)
    fraction = (0.2 - t0) / (loop.sim.time_s - t0)
    slow = int(last.record.accepted_drafts.astype(np.int64).sum()) + last.record.batch_size
    assert 0 < fraction < 1
    assert last.slo_violating_tokens == pytest.approx(slow * fraction, rel=1e-9)


def test_a_zero_horizon_ends_at_reset():
    loop = _loop(horizon_s=0.0, slo_tpot_s=0.01)
    assert loop.reset(seed=0) is None and loop.finished
    result = rollout(loop, _Static(1), seed=0)
    assert result.decisions == 0 and result.slo_goodput_tok_s is None
    assert np.isnan(result.mean_tpot_ms) and np.isnan(result.mean_e2e_s)  # none finished


def test_the_loop_is_built_from_its_arguments():
    spec, prior = FeatureSpec(max_depth=7, ema_alpha=0.3), PROFILE
    loop = _loop(feature_spec=spec, cost_prior=prior)
    assert loop.features.spec is spec and loop.features.cost_prior is prior
    assert _loop().feedback_lag == 3  # overlap scheduling's lag, the default
    loop.reset(seed=0)
    assert loop.steps_chosen.tolist() == [0] * 8


def test_seeds_reach_the_simulator():
    def run(seed: int, static: bool):
        loop = _loop(concurrency=8, requests=None, horizon_s=0.3)
        if static:
            return loop.run_static(3, seed=seed)
        return rollout(loop, _Static(3), seed=seed).throughput_tok_s

    for static in (True, False):
        assert run(1, static) == run(1, static) != run(2, static)


class _Spy(_Static):
    def reset(self, sim=None) -> None:
        self.sim = sim

    def act(self, obs) -> int:
        assert isinstance(obs, Observation)
        return self.depth


def test_rollout_hands_the_policy_the_simulator_and_observations():
    loop = _loop()
    policy = _Spy(2)
    rollout(loop, policy, seed=0)
    assert policy.sim is loop.sim


def test_summary_means_come_from_the_requests():
    loop = _loop(concurrency=64, output=30, requests=None, horizon_s=0.5)
    result = rollout(loop, _Static(3), seed=0)
    stats = loop.sim.stats()
    started = ~np.isnan(stats.first_token_s)
    assert 0 < started.sum() < started.size  # some requests wait for their prefill
    assert result.finished_requests == int(stats.finished.sum()) > 0
    assert result.mean_ttft_s == pytest.approx(
        float(np.mean(stats.first_token_s[started] - stats.arrival_s[started])))
    assert result.mean_tpot_ms == pytest.approx(1e3 * float(stats.tpot_s.mean()))
    assert result.mean_e2e_s == pytest.approx(float(stats.e2e_s.mean()))
    assert all(type(n) is int for n in result.steps_chosen) and len(result.steps_chosen) == 8


def test_an_episode_without_horizon_ends_when_the_requests_are_done():
    loop = _loop()
    result = rollout(loop, _Static(2), seed=0)
    assert result.finished_requests == 8 and result.output_tokens == 8 * 40
    assert result.elapsed_s == pytest.approx(loop.sim.time_s)
    assert result.throughput_tok_s == pytest.approx(320 / loop.sim.time_s)
    assert result.decisions == sum(result.steps_chosen)
    assert result.steps_chosen[2] == result.decisions  # every step at the depth chosen
    assert result.slo_goodput_tok_s is None
    assert result.mean_tpot_ms > 0 and result.mean_e2e_s > result.mean_ttft_s > 0
    assert result.as_dict()["policy"] == "static_2"


def test_run_static_equals_a_rollout_of_the_static_policy():
    loop = _loop(horizon_s=0.3, requests=None)
    throughput = loop.run_static(3, seed=4)
    assert loop.decisions > 0 and throughput > 0
    assert rollout(loop, _Static(3), seed=4).throughput_tok_s == throughput


def test_slo_counts_the_tokens_of_requests_slower_than_the_target():
    records = []
    loop = _loop(slo_tpot_s=1e-9)  # every decode token misses it
    obs = loop.reset(seed=0)
    while obs is not None:
        obs, outcome = loop.step(3)
        records.append(outcome)
    committed = sum(int(o.record.accepted_drafts.astype(np.int64).sum()) + o.record.batch_size
                    for o in records)
    assert sum(o.slo_violating_tokens for o in records) == committed
    assert loop.slo_violating_tokens == committed
    assert rollout(loop, _Static(0), seed=0).slo_goodput_tok_s == pytest.approx(
        (loop.tokens - loop.slo_violating_tokens) / loop.elapsed_s)
    # Off steps carry no accepted drafts: one token per request.
    loop = _loop(slo_tpot_s=1e-9)
    loop.reset(seed=0)
    _, outcome = loop.step(0)
    assert outcome.slo_violating_tokens == outcome.record.batch_size > 0
    loop = _loop(slo_tpot_s=10.0)  # none does
    assert rollout(loop, _Static(3), seed=0).slo_goodput_tok_s == pytest.approx(
        loop.throughput_tok_s)


def test_slo_uses_the_per_token_latency_of_each_request():
    loop = _loop(concurrency=6)
    loop.reset(seed=0)
    loop.step(0)
    _, outcome = loop.step(3)  # speculating
    record = outcome.record
    per_token = record.step_latency_s / (record.accepted_drafts.astype(np.int64) + 1)
    target = float(np.median(per_token))
    loop2 = _loop(concurrency=6, slo_tpot_s=target)
    loop2.reset(seed=0)
    loop2.step(0)
    _, outcome2 = loop2.step(3)
    slow = per_token > target
    assert outcome2.slo_violating_tokens == (record.accepted_drafts.astype(np.int64)
                                              + 1)[slow].sum()


def test_a_horizon_falling_exactly_where_a_decode_step_ends():
    """The step whose decode ends exactly at the horizon is the last: nothing after it (a
    prefill the simulator would run next) counts, and no further decision is asked for."""
    reference = _loop(concurrency=2, output=6, requests=None)
    reference.reset(seed=0)
    k, prefilled = 0, False
    while not prefilled and k < 500:
        t0, index = reference.sim.time_s, reference.sim.step_index
        _, outcome = reference.step(2)
        k += 1
        prefilled = reference.sim.step_index > index + 1  # a prefill step ran after it
    assert prefilled
    end = t0 + outcome.record.step_latency_s  # where step k's decode ended
    loop = _loop(concurrency=2, output=6, requests=None, horizon_s=end)
    loop.reset(seed=0)
    for _ in range(k):
        tokens0, index = loop.sim.output_tokens_total, loop.sim.step_index
        obs, last = loop.step(2)
    assert last.truncated and obs is None and loop.decisions == k
    assert loop.sim.step_index == index + 1  # the prefill step did not run
    assert loop.elapsed_s == end
    assert last.elapsed_s == pytest.approx(last.record.step_latency_s, rel=1e-12)
    assert last.tokens == loop.sim.output_tokens_total - tokens0  # in full


class _Pattern:
    def __init__(self, depths: list[int]) -> None:
        self.name, self.depths, self.i = "pattern", depths, 0

    def reset(self, sim=None) -> None:
        self.i = 0

    def act(self, obs) -> int:
        self.i += 1
        return self.depths[(self.i - 1) % len(self.depths)]


@pytest.mark.parametrize("warmup", [True, False])
def test_steps_chosen_counts_the_depth_decided_and_warmups_apart(warmup):
    """A decision for depth > 0 right after off runs as the warm-up (depth 0 in its
    record): ``steps_chosen`` counts the depth decided, ``warmups`` those decisions."""
    loop = _loop(concurrency=4, output=60)
    loop.sim.config = dataclasses.replace(loop.sim.config, reentry_warmup=warmup)
    ran = []
    decode = loop.sim.decode
    loop.sim.decode = lambda depth: (ran.append(r := decode(depth)), r)[1]
    result = rollout(loop, _Pattern([0, 3, 3]), seed=0)
    assert result.decisions == sum(result.steps_chosen) > 30
    asked = [(0, 3, 3)[i % 3] for i in range(result.decisions)]
    assert result.steps_chosen == [asked.count(d) for d in range(8)]
    transitions = sum(a == 0 < b for a, b in itertools.pairwise(asked))
    assert result.warmups == (transitions if warmup else 0)
    assert sum(r.steps_used == 0 for r in ran) == result.steps_chosen[0] + result.warmups


def test_warmups_are_counted_where_they_ran_while_the_plugin_holds_a_depth():
    """With ``min_switch_steps`` a decision may run another depth than it asked (the
    held one): ``warmups`` counts the steps that ran as the warm-up, not every decision
    whose record differs from it."""
    loop = _loop(concurrency=4, output=60)
    loop.sim.config = dataclasses.replace(loop.sim.config, reentry_warmup=True,
                                          min_switch_steps=4)
    warm = []
    decode = loop.sim.decode

    def logged(depth):
        record = decode(depth)
        warm.append(loop.sim.last_warmup)
        return record

    loop.sim.decode = logged
    result = rollout(loop, _Pattern([0, 3, 3, 3, 0, 3]), seed=0)
    assert result.warmups == sum(warm) > 0
    assert result.decisions > 30

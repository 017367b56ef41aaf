"""Scheduler-model invariants of the simulator, checked on random workloads."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from env.sim.cost_model import prefill_pairs
from env.sim.simulator import SchedulerConfig, Simulator


@dataclass
class _Table:
    offsets: np.ndarray
    values: np.ndarray


class _RandomAcceptance:
    """Uniform random accepted drafts per position (any table is a valid input)."""

    max_depth = 7

    def draw(self, output_tokens, request_class, rng):
        output_tokens = np.asarray(output_tokens, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(output_tokens)])
        values = rng.integers(0, self.max_depth + 1, size=int(offsets[-1])).astype(np.int8)
        return _Table(offsets, values)


class _LinearCost:
    """A simple positive step cost; the invariants must hold for any."""

    def step_latency_s(self, batch, depth, kv, prefill, draft_extend=True, speculative_path=True,
                       prefill_pairs=0.0, prefill_cached_tokens=0.0):
        return 1e-3 * (5 + 0.1 * batch * (depth + 1) + 0.4 * depth + 1e-4 * kv + 1e-3 * prefill
                       + 1e-7 * prefill_pairs + 1e-5 * prefill_cached_tokens
                       + (0.3 if draft_extend else 0.0)
                       + (0.2 * batch if speculative_path or depth else 0.0))


@dataclass(frozen=True)
class _Workload:
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    request_class: None = None
    prefix_blocks: np.ndarray | None = None
    prefix_block_tokens: int = 64

    def __len__(self) -> int:
        return len(self.arrival_s)


@dataclass(frozen=True)
class _ClosedLoop:
    concurrency: int
    requests_per_client: int | None
    prompt: int
    output: int
    start_interval_s: float = 0.0

    def sample_lengths(self, rng, n):
        return np.full(n, self.prompt), rng.integers(1, self.output + 1, size=n)


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 25))
    prompt = np.array(draw(st.lists(st.integers(1, 600), min_size=n, max_size=n)))
    output = np.array(draw(st.lists(st.integers(1, 120), min_size=n, max_size=n)))
    gaps = np.array(draw(st.lists(st.floats(0.0, 0.05), min_size=n, max_size=n)))
    biggest = int((prompt + output).max()) + 8
    config = SchedulerConfig(
        max_running_requests=draw(st.integers(1, 12)),
        kv_capacity_tokens=biggest + draw(st.integers(0, 3000)),
        chunked_prefill_tokens=draw(st.integers(8, 1024)),
        zero_step=draw(st.sampled_from(["off", "sglang_steps0"])),
        skip_zero_step_draft_extend=draw(st.booleans()),
        cold_recovery_accept_fraction=draw(st.sampled_from([0.0, 0.5, 1.0])),
        reentry_warmup=draw(st.booleans()),
        stale_accept_loss=draw(st.sampled_from([0.0, 0.3])),
        finish_lag_steps=draw(st.sampled_from([0, 1, 2])),
        prefix_cache=draw(st.booleans()),
    )
    depths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=12))
    # prompts of 64-token blocks drawn from a few shared prefixes
    stems = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    blocks = [np.arange(-(-int(p) // 64)) + 1000 * stem
              for p, stem in zip(prompt, stems, strict=True)]
    return (_Workload(np.cumsum(gaps), prompt, output, prefix_blocks=blocks), config, depths,
            draw(st.integers(0, 99)))


class _ConstantAcceptance:
    """Every position accepts ``k`` drafts."""

    max_depth = 7

    def __init__(self, k: int) -> None:
        self.k = k

    def draw(self, output_tokens, request_class, rng):
        output_tokens = np.asarray(output_tokens, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(output_tokens)])
        return _Table(offsets, np.full(int(offsets[-1]), self.k, dtype=np.int8))


def _drain(sim: Simulator, depths: list[int], max_steps: int = 100_000, rides=None):
    """Run ``sim`` to the end; ``rides``, if a list, gets the decode records of batches of
    finished requests only (``finish_lag_steps``: they commit no token)."""
    records = []
    i = 0
    while not sim.done:
        records.extend(sim.advance())
        if sim.done:
            break
        before = sim.output_tokens_total
        records.append(sim.decode(depths[i % len(depths)]))
        if rides is not None and sim.output_tokens_total == before:
            rides.append(records[-1])
        i += 1
        assert i < max_steps, "simulation did not finish"
    return records


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_invariants_hold_on_random_workloads(scenario):
    _check_invariants(*scenario)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_warmup_follows_the_plugins_off_switch(scenario):
    """Whatever the workload and decisions, a decode step runs as the warm-up exactly
    where the plugin's ``OffSwitch.choose`` turns the asked depth into steps=0: asked for
    depth > 0 with an off step since the last draft extend (with the off path and
    ``reentry_warmup``); it drafts nothing, commits one token per live request, and costs
    SGLang's steps=0 with the extend. Every other step runs the depth asked. Its record's
    ``warmup`` says which (True there, False on every other record of the off path, None
    on SGLang's steps=0: as the plugin with and without its off path)."""
    workload, config, depths, seed = scenario
    sim = Simulator(_LinearCost(), _RandomAcceptance(), workload, config, seed=seed)
    cost = _LinearCost()
    stale = False  # OffSwitch.stale
    known = config.zero_step == "off"
    i = 0
    while not sim.done:
        for prefill in sim.advance():
            assert prefill.warmup is (False if known else None)
        if sim.done:
            break
        asked = depths[i % len(depths)]
        i += 1
        tokens0 = sim.output_tokens_total
        live = int((sim.remaining_tokens() > 0).sum())
        retractions = sim.retractions
        record = sim.decode(asked)
        warmup = config.zero_step == "off" and config.reentry_warmup and stale and asked > 0
        if asked == 0:
            stale = True
        elif warmup:
            stale = False
        assert record.steps_used == (0 if warmup else asked)
        assert record.warmup is (warmup if known else None)
        if warmup:
            assert record.accepted_drafts.size == 0
            if sim.retractions == retractions:  # (a retraction takes requests out first)
                assert sim.output_tokens_total - tokens0 == live
            assert record.step_latency_s == pytest.approx(cost.step_latency_s(
                record.batch_size, 0, record.kv_used_tokens, 0, draft_extend=True,
                speculative_path=True))
        assert i < 100_000


def test_a_batch_of_finished_requests_rides_without_making_room():
    """Found by hypothesis: with a finish lag, a decode step whose batch held only
    finished requests made room for a speculative step by freeing them all, and ran with
    an empty batch. Their ride was launched before they were known finished; it keeps
    nothing, so it needs no room."""
    prompts = [1] * 19 + [77, 579, 492, 2, 311, 545]
    outputs = [1, 1, 1, 7, 1, 1, 1, 1, 1, 2, 6, 5, 1, 1, 4, 1, 2, 1, 1, 1, 1, 1, 3, 3, 4]
    workload = _Workload(np.zeros(25), np.array(prompts), np.array(outputs))
    config = SchedulerConfig(max_running_requests=3, kv_capacity_tokens=864,
                             chunked_prefill_tokens=27, zero_step="sglang_steps0",
                             stale_accept_loss=0.3, finish_lag_steps=2)
    _check_invariants(workload, config, [6] + [0] * 11, 0)


def _check_invariants(workload, config, depths, seed):
    sim = Simulator(_LinearCost(), _RandomAcceptance(), workload, config, seed=seed)
    rides: list = []
    records = _drain(sim, depths, rides=rides)
    stats = sim.stats()

    # Every request finished: none lost, none produced more or less than its length.
    assert stats.finished.all()
    assert sim.output_tokens_total == int(workload.output_tokens.sum())
    assert (sim.requests.generated[: len(workload)] == workload.output_tokens).all()
    # Time only moves forward; each request finishes after its first token, after arrival.
    times = np.array([r.time_s for r in records])
    assert (np.diff(times) > 0).all()
    assert (stats.first_token_s >= stats.arrival_s).all()
    assert (stats.finish_s >= stats.first_token_s).all()
    for r in records:
        # KV capacity is never exceeded, speculative reservation included (a batch of
        # finished requests riding one more step reserves nothing: it keeps no token).
        reserve = r.batch_size * (r.steps_used + 1) if r.is_decode else r.prefill_tokens
        if any(r is ride for ride in rides):
            reserve = 0
        assert r.kv_used_tokens + reserve <= config.kv_capacity_tokens
        assert r.running_requests <= config.max_running_requests
        assert r.prefill_tokens <= config.chunked_prefill_tokens
        if r.is_decode:
            assert 1 <= r.batch_size <= config.max_running_requests
            assert r.accepted_drafts.size in (0, r.batch_size)
            assert (r.accepted_drafts <= r.steps_used).all()
    assert sim.kv_used == 0


def test_kv_pressure_retracts_and_still_finishes_everything():
    rng = np.random.default_rng(0)
    n = 40
    workload = _Workload(np.zeros(n), rng.integers(50, 300, n), rng.integers(100, 400, n))
    config = SchedulerConfig(max_running_requests=32, kv_capacity_tokens=2500,
                             chunked_prefill_tokens=512)
    sim = Simulator(_LinearCost(), _RandomAcceptance(), workload, config, seed=0)
    records = _drain(sim, [7, 0, 3])
    assert sim.retractions > 0
    assert sim.stats().finished.all()
    assert sim.output_tokens_total == int(workload.output_tokens.sum())
    assert all(r.kv_used_tokens + r.batch_size * (r.steps_used + 1) <= 2500
               for r in records if r.is_decode)


def test_counterfactual_depth_is_min_of_max_depth_acceptance():
    """One request, no competition: tokens per step follow min(A[p], d) + 1 exactly."""
    workload = _Workload(np.array([0.0]), np.array([10]), np.array([400]))
    for depth in (1, 3, 7):
        sim = Simulator(_LinearCost(), _RandomAcceptance(), workload, SchedulerConfig(), seed=3)
        table = sim.requests.acc_values[: 400].copy()
        position = 1  # the prefill step commits the first token
        for record in _drain(sim, [depth]):
            if not record.is_decode:
                continue
            expected = min(int(table[position]), depth)
            assert record.accepted_drafts.tolist() == [expected]
            position += min(expected + 1, 400 - position)
        assert position == 400


def test_replaying_at_max_depth_reproduces_the_table_runs():
    """At depth D the committed-token sequence is 1 + A at the visited positions."""
    workload = _Workload(np.array([0.0]), np.array([5]), np.array([300]))
    sim = Simulator(_LinearCost(), _RandomAcceptance(), workload, SchedulerConfig(), seed=11)
    table = sim.requests.acc_values[:300].copy()
    visited, p = [], 1
    while p < 300:
        visited.append(int(table[p]))
        p += int(table[p]) + 1
    accepted = [int(r.accepted_drafts[0]) for r in _drain(sim, [7]) if r.is_decode]
    assert accepted == visited


def test_skip_zero_step_extend_makes_first_speculative_step_cold():
    workload = _Workload(np.array([0.0]), np.array([5]), np.array([500]))
    for mode in ("off", "sglang_steps0"):
        # (off without the plugin's warm-up: that cold re-entry is reentry_warmup=False's)
        config = SchedulerConfig(zero_step=mode, skip_zero_step_draft_extend=True,
                                 cold_recovery_accept_fraction=0.0, reentry_warmup=False)
        sim = Simulator(_LinearCost(), _RandomAcceptance(), workload, config, seed=5)
        records = [r for r in _drain(sim, [0, 0, 3, 3]) if r.is_decode]
        # Steps follow 0,0,3,3,...: every first step of a depth-3 pair accepted nothing.
        pairs = list(itertools.pairwise(records))
        firsts = [b for a, b in pairs if b.steps_used == 3 and a.steps_used == 0]
        seconds = [b for a, b in pairs if b.steps_used == 3 and a.steps_used == 3]
        assert firsts and all(int(r.accepted_drafts.sum()) == 0 for r in firsts), mode
        assert sum(int(r.accepted_drafts.sum()) for r in seconds) > 0, mode


def test_sglang_steps0_with_extend_stays_warm():
    workload = _Workload(np.array([0.0]), np.array([5]), np.array([500]))
    config = SchedulerConfig(zero_step="sglang_steps0", cold_recovery_accept_fraction=0.0)
    sim = Simulator(_LinearCost(), _ConstantAcceptance(2), workload, config, seed=5)
    records = [r for r in _drain(sim, [0, 3]) if r.is_decode and r.steps_used == 3]
    assert all(int(r.accepted_drafts[0]) == 2 for r in records)


def test_zero_step_costs_off_vs_sglang_steps0_vs_skipped_extend():
    """Off is a server without speculation: cheaper than SGLang's steps=0, with or
    without its draft extend (the profile's speculative-path terms)."""
    workload = _Workload(np.array([0.0]), np.array([5]), np.array([50]))
    latencies = {}
    for mode, skip in (("off", False), ("sglang_steps0", False), ("sglang_steps0", True)):
        sim = Simulator(_LinearCost(), _RandomAcceptance(), workload,
                        SchedulerConfig(zero_step=mode, skip_zero_step_draft_extend=skip), seed=0)
        sim.advance()
        record = sim.decode(0)
        latencies[mode, skip] = record.step_latency_s
        assert record.step_latency_s == pytest.approx(_LinearCost().step_latency_s(
            1, 0, record.kv_used_tokens, 0, **sim.config.latency_flags(0)))
    assert latencies["off", False] < latencies["sglang_steps0", True] < latencies[
        "sglang_steps0", False]


def test_off_period_reentry_penalty_and_lasting_loss():
    """Without the warm-up, the first speculative step after an off period keeps
    ``cold_recovery_accept_fraction`` of its drafts; requests that decoded while off keep
    ``1 - stale_accept_loss`` after."""
    workload = _Workload(np.array([0.0]), np.array([5]), np.array([400]))

    def accepted(**config):
        config = SchedulerConfig(reentry_warmup=False, **config)
        sim = Simulator(_LinearCost(), _ConstantAcceptance(4), workload, config, seed=0)
        return [int(r.accepted_drafts[0]) for r in _drain(sim, [0, 4, 4, 4]) if r.is_decode
                and r.steps_used]

    assert accepted(cold_recovery_accept_fraction=1.0)[:6] == [4] * 6
    assert accepted(cold_recovery_accept_fraction=0.5)[:6] == [2, 4, 4] * 2
    lasting = accepted(cold_recovery_accept_fraction=0.5, stale_accept_loss=0.5)
    assert lasting[:6] == [1, 2, 2] * 2


def _decode_steps(config: SchedulerConfig, asked: list[int], output: int = 400,
                  k: int = 4) -> tuple[Simulator, list]:
    """One request decoding at the depths ``asked`` in turn: the simulator and, per
    decision, (depth asked, its record, draft KV stale before it)."""
    workload = _Workload(np.array([0.0]), np.array([5]), np.array([output]))
    sim = Simulator(_LinearCost(), _ConstantAcceptance(k), workload, config, seed=0)
    steps = []
    while not sim.done:
        sim.advance()
        if sim.done:
            break
        depth = asked[len(steps) % len(asked)]
        steps.append((depth, sim.warmup_due, sim.decode(depth)))
    return sim, steps


@pytest.mark.parametrize("pattern", [[0, 4, 4, 4], [0, 0, 3, 0, 2, 2], [0, 5], [2, 0, 1]])
def test_reentry_runs_one_warmup_per_off_to_on_transition(pattern):
    """As ``OffSwitch.choose``: the first step asked for depth > 0 after an off step runs
    SGLang's steps=0 with the draft extend (depth 0 in its record, one token, the
    sglang_steps0 cost); the next step asked for depth > 0 drafts warm at that depth."""
    config = SchedulerConfig(cold_recovery_accept_fraction=0.0, stale_accept_loss=0.0,
                             reentry_warmup=True)
    _, steps = _decode_steps(config, pattern)
    cost = _LinearCost()
    ran_off = False  # the plugin's OffSwitch.stale: an off step since the last extend
    warmups = 0
    for asked, due, record in steps:
        assert due == ran_off
        if asked == 0:
            assert record.steps_used == 0 and record.accepted_drafts.size == 0
            assert record.step_latency_s == pytest.approx(cost.step_latency_s(
                1, 0, record.kv_used_tokens, 0, draft_extend=False, speculative_path=False))
            ran_off = True
        elif ran_off:  # the warm-up
            warmups += 1
            assert record.steps_used == 0 and record.accepted_drafts.size == 0
            assert record.step_latency_s == pytest.approx(cost.step_latency_s(
                1, 0, record.kv_used_tokens, 0, draft_extend=True, speculative_path=True))
            ran_off = False
        else:  # warm: every draft the table accepts (no cold penalty at fraction 0)
            assert record.steps_used == asked
            assert record.accepted_drafts.tolist() == [min(4, asked)]
    transitions = sum(1 for (a, _, _), (b, _, _) in itertools.pairwise(steps) if a == 0 < b)
    assert warmups == transitions > 0


def test_warmup_commits_one_token_and_keeps_stale_kv_of_positions_decoded_off():
    """The warm-up commits one token per request; requests that decoded while off keep
    their lasting loss after it (``stale_accept_loss``), and the first drafting step after
    it has no cold penalty."""
    config = SchedulerConfig(cold_recovery_accept_fraction=0.0, stale_accept_loss=0.5,
                             reentry_warmup=True)
    sim, steps = _decode_steps(config, [0, 4, 4, 4], output=60)
    kv = [record.kv_used_tokens for _, _, record in steps]
    committed = np.diff(kv).tolist()
    assert committed[:4] == [1, 1, 3, 3]  # off, warm-up, then 4 drafts halved to 2 (+1)
    assert [r.accepted_drafts.tolist() for _, _, r in steps[:4]] == [[], [], [2], [2]]
    assert sim.stats().finished.all()


@pytest.mark.parametrize("stale_loss", [0.0, 0.5])
def test_true_accepted_after_warmup_is_what_the_step_after_it_accepts(stale_loss):
    """The oracle's look past a due warm-up: ``true_accepted(d, after_warmup=True)`` is
    what the drafting step after the warm-up accepts (one position on, warm draft)."""
    workload = _Workload(np.zeros(6), np.full(6, 5), np.array([3, 40, 2, 90, 60, 1]))
    config = SchedulerConfig(cold_recovery_accept_fraction=0.5, stale_accept_loss=stale_loss,
                             reentry_warmup=True)
    sim = Simulator(_LinearCost(), _RandomAcceptance(), workload, config, seed=4)
    sim.advance()
    sim.decode(0)
    assert sim.warmup_due
    for depth in (1, 4, 7):
        trial = copy.deepcopy(sim)
        predicted = trial.true_accepted(depth, after_warmup=True)
        assert not trial.true_accepted(depth).any()  # the warm-up itself drafts nothing
        live = trial.remaining_tokens() > 1
        assert trial.decode(depth).steps_used == 0
        n = trial.batch_size  # (requests the warm-up finished are gone)
        record = trial.decode(depth)
        assert record.steps_used == depth and n == int(live.sum())
        assert record.accepted_drafts.tolist() == predicted[live].tolist()


def test_reentry_warmup_false_reproduces_the_cold_stream():
    """``reentry_warmup=False`` is the simulator before the warm-up: the first step back
    drafts at the asked depth from a cold draft."""
    config = SchedulerConfig(cold_recovery_accept_fraction=0.5, reentry_warmup=False)
    _, steps = _decode_steps(config, [0, 4, 4])
    assert all(record.steps_used == asked and not due for asked, due, record in steps)
    assert [r.accepted_drafts.tolist() for _, _, r in steps[:3]] == [[], [2], [4]]


@pytest.mark.parametrize("mode,skip", [("sglang_steps0", False), ("sglang_steps0", True)])
def test_no_warmup_on_sglang_steps0(mode, skip):
    """The warm-up is the plugin's off path's: SGLang's own steps=0 never runs one."""
    config = SchedulerConfig(zero_step=mode, skip_zero_step_draft_extend=skip)
    _, steps = _decode_steps(config, [0, 4])
    assert all(record.steps_used == asked and not due for asked, due, record in steps)


def test_prefill_after_the_warmup_runs_the_draft_extend():
    """As the plugin's ``OffSwitch.prefill_off`` (``stale``): a prefill after an off step
    skips the draft's extend, one after the warm-up runs it."""
    workload = _Workload(np.array([0.0, 0.012, 0.05]), np.array([5, 7, 9]),
                         np.array([400, 400, 400]))
    sim = Simulator(_LinearCost(), _ConstantAcceptance(2), workload,
                    SchedulerConfig(reentry_warmup=True), seed=0)
    prefills, due = [], []
    while len(prefills) < 3:
        for record in sim.advance():
            prefills.append((record, sim.warmup_due))
        # off until the second request joins, then back on (warm-up, then depth 2)
        depth = 0 if len(prefills) < 2 else 2
        due.append(sim.warmup_due)
        sim.decode(depth)
    (first, _), (second, stale2), (third, stale3) = prefills
    cost = _LinearCost()
    for record, extend in ((first, True), (second, False), (third, True)):
        assert record.step_latency_s == pytest.approx(cost.step_latency_s(
            0, 0, record.kv_used_tokens, record.prefill_tokens, draft_extend=extend))
    assert stale2 and not stale3 and True in due


@pytest.mark.parametrize("skip", [True, False])
def test_a_prefill_while_off_skips_the_draft_extend_and_leaves_its_requests_stale(skip):
    """As the plugin's ``SPECCTL_OFF_PREFILL=skip``: a prefill after an off step costs no
    draft extend, and its request drafts from stale KV once speculation is back."""
    workload = _Workload(np.array([0.0, 0.02]), np.array([5, 7]), np.array([400, 400]))
    config = SchedulerConfig(cold_recovery_accept_fraction=1.0, stale_accept_loss=0.5,
                             skip_prefill_while_off=skip)
    sim = Simulator(_LinearCost(), _ConstantAcceptance(4), workload, config, seed=0)
    prefills, accepted = [], []
    while not sim.done and len(accepted) < 3:
        records = sim.advance()
        prefills += [r for r in records if not r.is_decode]
        if sim.done:
            break
        second_joined = len(prefills) == 2
        record = sim.decode(4 if second_joined else 0)
        if record.steps_used and record.batch_size == 2:
            accepted.append(record.accepted_drafts.tolist())
    first, second = prefills
    # The first prefill came before any off step: the draft's extend ran.
    assert first.step_latency_s == pytest.approx(_LinearCost().step_latency_s(
        0, 0, first.kv_used_tokens, 5, draft_extend=True))
    assert second.step_latency_s == pytest.approx(_LinearCost().step_latency_s(
        0, 0, second.kv_used_tokens, 7, draft_extend=not skip))
    # The first request decoded while off: stale either way; the second only if skipped.
    assert accepted == [[2, 2 if skip else 4]] * 3


def test_bad_zero_step_mode_is_rejected():
    with pytest.raises(ValueError, match="zero_step"):
        SchedulerConfig(zero_step="steps0")


def test_closed_loop_keeps_concurrency_and_stops_after_requests_per_client():
    loop = _ClosedLoop(concurrency=6, requests_per_client=3, prompt=50, output=40)
    sim = Simulator(_LinearCost(), _RandomAcceptance(), loop, SchedulerConfig(), seed=1)
    records = _drain(sim, [2])
    assert sim.requests.size == 18
    assert sim.stats().finished.all()
    assert max(r.running_requests for r in records) <= 6
    # Every client has at most one request in flight.
    clients = sim.requests.client[: sim.requests.size]
    assert sorted(np.bincount(clients).tolist()) == [3] * 6


def test_closed_loop_clients_start_one_after_another():
    loop = _ClosedLoop(concurrency=5, requests_per_client=1, prompt=20, output=30,
                       start_interval_s=0.5)
    sim = Simulator(_LinearCost(), _RandomAcceptance(), loop, SchedulerConfig(), seed=2)
    _drain(sim, [3])
    stats = sim.stats()
    order = np.argsort(sim.requests.client[: sim.requests.size])
    assert np.allclose(stats.arrival_s[order], [0.0, 0.5, 1.0, 1.5, 2.0])
    assert (stats.first_token_s >= stats.arrival_s).all() and stats.finished.all()


@pytest.mark.parametrize("overhead", [0.0, 0.05])
def test_closed_loop_stops_sending_at_send_until_and_drains(overhead):
    """loadgen's closed loop: send while the loop runs, then wait for every answer."""
    from env.traces.workloads import ClosedLoop

    loop = ClosedLoop(4, prompt_tokens=50, output_tokens=40, start_interval_s=0.4,
                      client_overhead_s=overhead, send_until_s=1.0)
    sim = Simulator(_LinearCost(), _RandomAcceptance(), loop, SchedulerConfig(), seed=3)
    _drain(sim, [2])
    stats = sim.stats()
    clients = sim.requests.client[: sim.requests.size]
    assert stats.finished.all() and sim.done
    assert (stats.arrival_s - overhead < 1.0).all()  # nothing sent at or after 1 s
    assert set(clients.tolist()) == {0, 1, 2}  # the client due at 1.2 s never starts
    for client in (0, 1, 2):  # each sent until its last answer came after the deadline
        mine = clients == client
        assert stats.finish_s[mine].max() >= 1.0
        assert np.sort(stats.finish_s[mine])[-2:-1].max(initial=0.0) < 1.0
    with pytest.raises(ValueError, match="send_until_s"):
        ClosedLoop(4, prompt_tokens=50, output_tokens=40, send_until_s=0.0)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_finished_request_rides_the_overlap_schedulers_next_step(lag):
    """SGLang's overlap scheduler launches step k+1 before it reads step k's results: every
    request of the recorded H200 traces rode one decode step more than its tokens needed.
    The client has its answer after step k; the slot is busy through step k+1."""
    from env.traces.workloads import ClosedLoop

    loop = ClosedLoop(1, prompt_tokens=20, output_tokens=30, requests_per_client=3)
    config = SchedulerConfig(finish_lag_steps=lag)
    sim = Simulator(_LinearCost(), _ConstantAcceptance(2), loop, config, seed=4)
    records = _drain(sim, [3])
    # 29 tokens after the prefill's first, 3 a step: 10 steps that produce, then the ride.
    runs, count = [], 0
    for r in records:
        if r.is_decode:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    runs.append(count)
    assert runs == [10 + lag] * 3
    stats = sim.stats()
    decode_ends = np.array([r.time_s + r.step_latency_s for r in records if r.is_decode])
    # each answer comes at the end of its 10th step, before the ride
    assert np.isin(np.round(stats.finish_s, 12), np.round(decode_ends, 12)).all()
    nxt = np.argsort(stats.arrival_s)
    gap = stats.first_token_s[nxt][1:] - stats.finish_s[nxt][:-1]
    ride = [r.step_latency_s for r in records if r.is_decode][10]  # the first ride (lag 1)
    assert (gap > ride).all() if lag else (gap < ride).all()
    assert sim.kv_used == 0 and stats.finished.all()
    with pytest.raises(ValueError, match="finish_lag_steps"):
        SchedulerConfig(finish_lag_steps=-1)


def _prefill_tokens_per_request(prompts, blocks, arrivals, *, cache, capacity=100_000,
                                output=4):
    wl = _Workload(np.array(arrivals, float), np.array(prompts), np.full(len(prompts), output),
                   prefix_blocks=[np.array(b) for b in blocks])
    config = SchedulerConfig(kv_capacity_tokens=capacity, prefix_cache=cache)
    sim = Simulator(_LinearCost(), _ConstantAcceptance(0), wl, config, seed=0)
    records = []
    while not sim.done:
        records.extend(sim.advance())
        if sim.done:
            break
        records.append(sim.decode(1))
        # the cache only ever holds what the batch leaves free
        assert sim.kv_used + sim._cache_tokens <= capacity
    assert sim.stats().finished.all() and sim.kv_used == 0
    return [r.prefill_tokens for r in records if not r.is_decode]


def test_the_radix_cache_skips_a_prefix_an_earlier_request_left():
    """SGLang's radix cache: a prompt's leading 64-token blocks that a finished request
    left are not computed again (at least one token is)."""
    prompts, arrivals = [300, 300, 200], [0.0, 10.0, 20.0]
    blocks = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 9, 10]]
    assert _prefill_tokens_per_request(prompts, blocks, arrivals, cache=False) == prompts
    assert _prefill_tokens_per_request(prompts, blocks, arrivals, cache=True) == [
        300, 1, 200 - 128]


def test_running_requests_share_a_cached_prefix():
    """A prefix in the cache is found by a request arriving while another one that uses it
    still runs (SGLang's radix tree shares it), and stays cached after both finish."""
    a = [1, 2, 3, 4, 5]
    # 100 output tokens take about 0.6 s: the second request arrives during the first's
    # decode, the third after both, the fourth (a prefix of its own) in between
    got = _prefill_tokens_per_request([300, 300, 200, 300], [a, a, [7, 8, 9, 10], a],
                                      [0.0, 0.05, 0.1, 10.0], cache=True, output=100)
    assert got == [300, 1, 200, 1]


def test_the_radix_cache_evicts_the_least_recently_used_prefix():
    """With room for about one prompt beside the batch, the older prefix goes first,
    from its tail."""
    a, b, c = [1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28]
    got = _prefill_tokens_per_request([300, 300, 500, 300, 300], [a, b, c, b, a],
                                      [0.0, 10.0, 20.0, 30.0, 40.0], cache=True,
                                      capacity=1000)
    # C (500) needs 100 tokens of A's room, the least recent: A loses its tail (44 + 64
    # tokens; leaves first, as SGLang's radix tree), B survives whole
    assert got == [300, 300, 500, 1, 300 - 192]


def test_request_larger_than_kv_cache_is_rejected_with_its_index():
    workload = _Workload(np.array([0.0, 1.0]), np.array([10, 900]), np.array([10, 200]))
    with pytest.raises(ValueError, match="request 1 needs"):
        Simulator(_LinearCost(), _RandomAcceptance(), workload,
                  SchedulerConfig(kv_capacity_tokens=1000))


class _PairCounter(_LinearCost):
    """Remembers the attention token pairs and cached tokens each prefill step was charged."""

    def __init__(self) -> None:
        self.pairs: list[float] = []
        self.cached: list[float] = []

    def step_latency_s(self, batch, depth, kv, prefill, draft_extend=True, speculative_path=True,
                       prefill_pairs=0.0, prefill_cached_tokens=0.0):
        if prefill:
            self.pairs.append(prefill_pairs)
            self.cached.append(prefill_cached_tokens)
        return super().step_latency_s(batch, depth, kv, prefill, draft_extend, speculative_path,
                                      prefill_pairs, prefill_cached_tokens)


def test_a_chunked_prompt_pays_its_attention_pairs_once_each():
    """A 1,000-token prompt in chunks of 300: each chunk's tokens attend to the chunks
    before it, so the steps are charged 300*301/2, then 300*300 + 300*301/2, ... and
    1000*1001/2 in all, as if it were one step; two whole prompts in one step add up."""
    cost = _PairCounter()
    workload = _Workload(np.array([0.0]), np.array([1000]), np.array([5]))
    sim = Simulator(cost, _RandomAcceptance(), workload, SchedulerConfig(
        chunked_prefill_tokens=300), seed=0)
    _drain(sim, [1])
    assert cost.pairs == [prefill_pairs(300, done) for done in (0, 300, 600)] + [
        prefill_pairs(100, 900)]
    assert sum(cost.pairs) == pytest.approx(1000 * 1001 / 2)
    assert cost.cached == [0, 300, 600, 900]  # each chunk reads the chunks before it

    cost = _PairCounter()
    two = _Workload(np.array([0.0, 0.0]), np.array([40, 70]), np.array([5, 5]))
    _drain(Simulator(cost, _RandomAcceptance(), two, SchedulerConfig(), seed=0), [1])
    assert cost.pairs == [40 * 41 / 2 + 70 * 71 / 2]
    assert cost.cached == [0]


def test_a_prompt_after_a_cached_prefix_is_charged_its_cached_tokens():
    """With the radix cache on, the second prompt of one prefix computes only its last
    token (SGLang computes at least one) and is charged the 299 cached tokens it reads
    and their pairs with it; without the cache it reads none."""
    for cache, want_cached in ((True, [0, 299]), (False, [0, 0])):
        cost = _PairCounter()
        wl = _Workload(np.array([0.0, 10.0]), np.array([300, 300]), np.array([4, 4]),
                       prefix_blocks=[np.arange(1, 6), np.arange(1, 6)])
        sim = Simulator(cost, _ConstantAcceptance(0), wl,
                        SchedulerConfig(kv_capacity_tokens=100_000, prefix_cache=cache), seed=0)
        _drain(sim, [1])
        assert cost.cached == want_cached
        assert cost.pairs[1] == (prefill_pairs(1, 299) if cache else prefill_pairs(300))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([0, 1, 2, 4, 7]), st.booleans())
def test_the_plugins_min_switch_hold_then_its_off_switch(scenario, hold, warm):
    """With ``min_switch_steps``, each decode step runs what the plugin runs: the depth
    asked, unless the last switch was fewer than that many scheduler steps ago (prefills
    counted, as SGLang's ``forward_ct``), then the depth switched to; then the plugin's
    own ``OffSwitch.choose`` (the warm-up on the first step back on, with the off path
    and ``reentry_warmup``). Transcribed from ``sglang_hooks/policy.py``."""
    from collections import Counter

    from sglang_hooks.offswitch import OffSwitch

    workload, config, depths, seed = scenario
    config = dataclasses.replace(config, zero_step="off", reentry_warmup=warm,
                                 min_switch_steps=hold)
    sim = Simulator(_LinearCost(), _RandomAcceptance(), workload, config, seed=seed)
    switch = OffSwitch(Counter())
    switch.ready = warm  # without the warm-up simulated, off and on as asked
    current, switched_at = -1, 0
    i = held = 0
    while not sim.done:
        sim.advance()
        if sim.done:
            break
        asked = depths[i % len(depths)]
        i += 1
        step = sim.step_index  # the launch's forward_ct
        steps = asked
        if steps != current:
            if hold > 1 and current >= 0 and 0 <= step - switched_at < hold:
                steps = current
                held += 1
            else:
                current, switched_at = steps, step
        ran = switch.choose(steps)
        record = sim.decode(asked)
        assert record.steps_used == ran
        assert sim.last_warmup == (ran == 0 < steps)
        assert i < 100_000
    if hold <= 1:
        assert held == 0

"""Baseline policies behave as their definitions say."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from agents.policies import (
    GoodputGreedyPolicy,
    OraclePolicy,
    SGLangAdaptivePolicy,
    StaticTablePolicy,
    make_policy,
)
from env.features import FeatureBuilder, FeatureSpec
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.schema import StepRecord
from env.traces.workloads import ClosedLoop


def _obs(batch: int, records=(), rates=None):
    builder = FeatureBuilder()
    builder.update_many(records)
    obs = builder.observation(batch)
    if rates is not None:  # a known acceptance estimate
        expected = np.concatenate([[0.0], np.cumsum(np.cumprod(rates))])
        obs = obs.__class__(**{**obs.__dict__, "accept_rate": np.asarray(rates),
                               "expected_accepted": expected})
    return obs


def _verify(i: int, batch: int, steps: int, accepted: int) -> StepRecord:
    return StepRecord(server="t", rank=0, step_index=i, time_s=float(i), batch_size=batch,
                      waiting_requests=0, running_requests=batch, kv_used_tokens=1000,
                      kv_capacity_tokens=100_000, prefill_tokens=0, steps_used=steps,
                      accepted_drafts=np.full(batch if steps else 0, accepted, np.int8),
                      step_latency_s=0.01)


def test_make_policy_names_and_errors():
    assert make_policy("no_spec").act(_obs(4)) == 0
    assert make_policy("static_5").act(_obs(4)) == 5
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic")
    with pytest.raises(ValueError, match="depth must lie"):
        make_policy("static_9")
    with pytest.raises(ValueError, match="needs a cost profile"):
        make_policy("oracle")


def test_vllm_table_by_batch_size():
    table = StaticTablePolicy()
    assert [table.act(_obs(b)) for b in (1, 16, 17, 64, 65, 200, 600)] == [5, 5, 4, 3, 1, 0, 0]


def test_sglang_rule_raises_with_good_acceptance_and_is_off_from_batch_64():
    policy = SGLangAdaptivePolicy(initial_steps=3)
    assert policy.act(_obs(4)) == 3
    records = [_verify(i, 4, 3, 3) for i in range(40)]  # every draft accepted
    assert policy.act(_obs(4, records)) == 5  # EMA 3 -> EMA + 1 = 4 -> up to candidate 5
    records = [_verify(40 + i, 4, 5, 5) for i in range(40)]
    assert policy.act(_obs(4, records)) == 7
    poor = [_verify(100 + i, 4, 7, 0) for i in range(60)]  # nothing accepted
    assert policy.act(_obs(4, poor)) == 1
    assert policy.act(_obs(64)) == 0 and policy.act(_obs(300)) == 0


def test_sglang_rule_waits_for_warmup_and_decides_every_interval():
    config = {"1": {"candidate_steps": [1, 3, 5, 7], "warmup_batches": 10,
                    "update_interval": 5}}
    policy = SGLangAdaptivePolicy(config, initial_steps=1)
    good = [_verify(i, 2, 1, 1) for i in range(10)]
    assert policy.act(_obs(2, good)) == 1  # still warming up
    assert policy.act(_obs(2, [_verify(10 + i, 2, 1, 1) for i in range(4)])) == 1
    assert policy.act(_obs(2, [_verify(14, 2, 1, 1)])) == 3  # 5th verify after warm-up


def test_goodput_greedy_follows_the_cost_model():
    rates = np.full(7, 0.8)
    h200 = GoodputGreedyPolicy(load_profile("h200_llama31_8b"), max_depth=7)
    blackwell = GoodputGreedyPolicy(load_profile("blackwell_tp8"), max_depth=7)
    assert h200.act(_obs(8, rates=rates)) >= 2
    assert blackwell.act(_obs(64, rates=rates)) == 0
    assert h200.act(_obs(8, rates=np.full(7, 0.01))) == 0
    # On the H200 a step on the speculative path costs ~0.2 ms per request more than
    # one without (measured): at batch 64 off beats speculating when off is really
    # off, but not against SGLang's steps=0, which pays that cost too.
    assert h200.act(_obs(64, rates=rates)) == 0
    steps0 = GoodputGreedyPolicy(load_profile("h200_llama31_8b"), max_depth=7,
                                 sim_config=SchedulerConfig(zero_step="sglang_steps0"))
    assert steps0.act(_obs(64, rates=rates)) >= 2


def test_oracle_picks_the_true_per_step_best():
    profile = load_profile("h200_llama31_8b")
    sim = Simulator(profile, SGLangSimulatedAcceptance(3.5), ClosedLoop(16, 256, 200), seed=0)
    sim.advance()
    oracle = OraclePolicy(profile, max_depth=7)
    oracle.reset(sim)
    choice = oracle.act(_obs(16))
    # Independent of the oracle's own arithmetic: run the step at every depth on a copy
    # of the simulator and compare the tokens it committed per second of its latency.
    rates = []
    for d in range(8):
        trial = copy.deepcopy(sim)
        before = trial.output_tokens_total
        record = trial.decode(d)
        rates.append((trial.output_tokens_total - before) / record.step_latency_s)
    assert choice == int(np.argmax(rates))
    assert len(set(np.round(rates, 9))) == 8  # no tie hides a wrong choice


def test_oracle_prices_reentry_as_the_warmup_and_the_step_after_it():
    """After an off step the next step asked for depth > 0 is the warm-up
    (``reentry_warmup``): the oracle prices each depth as the warm-up and the drafting
    step after it together, so it comes back on where speculation pays (one step alone
    never would: the warm-up commits what off does, at a higher cost)."""
    profile = load_profile("h200_llama31_8b")
    sim = Simulator(profile, SGLangSimulatedAcceptance(3.5), ClosedLoop(16, 256, 200),
                    SchedulerConfig(reentry_warmup=True), seed=0)
    sim.advance()
    sim.decode(0)
    assert sim.warmup_due
    oracle = OraclePolicy(profile, max_depth=7)
    oracle.reset(sim)
    choice = oracle.act(_obs(16))
    rates = []
    for d in range(8):  # independently: run the steps on a copy of the simulator
        trial = copy.deepcopy(sim)
        before = trial.output_tokens_total
        latency = sum(trial.decode(d).step_latency_s for _ in range(1 if d == 0 else 2))
        rates.append((trial.output_tokens_total - before) / latency)
    assert choice == int(np.argmax(rates)) > 0
    assert len(set(np.round(rates, 9))) == 8  # no tie hides a wrong choice


def test_the_oracle_decides_alike_with_and_without_the_launch_booking():
    """The booking moves a prefill's launch onto the decode step before it without
    changing any step's total, so the oracle's choices (hence the denominator of
    ``oracle_fraction``) do not depend on it. In this window of the MoE it is off on 71%
    of the steps; priced with the booking it would be off on 24%
    (``docs/results/sim23/oracle_booking.py``'s variant)."""
    from env.rollout import DecisionLoop, rollout
    from env.traces.workloads import shipped_workload

    booked = load_profile("h200_qwen3_30b_a3b")
    assert booked.prefill_launch_s > 0
    zero = dataclasses.replace(booked, prefill_launch_s=0.0, prefill_launch_hidden=0.0)
    workload = shipped_workload("azure_conv").window(200.0, 40.0)
    runs = []
    for profile in (booked, zero):
        sim = Simulator(profile, SGLangSimulatedAcceptance(3.0), workload, seed=0)
        loop = DecisionLoop(sim, cost_prior=profile)
        result = rollout(loop, OraclePolicy(profile, sim.config.max_depth), seed=0)
        runs.append((loop.steps_chosen.copy(), result.throughput_tok_s, sim.time_s))
    (chosen_a, tok_a, end_a), (chosen_b, tok_b, end_b) = runs
    np.testing.assert_array_equal(chosen_a, chosen_b)
    assert 0.3 < chosen_a[0] / chosen_a.sum() < 0.95  # off and on both chosen
    assert tok_a == pytest.approx(tok_b, rel=1e-9)
    assert end_a == pytest.approx(end_b, rel=1e-12)


def test_goodput_online_measures_off_one_and_deepest_before_trusting_its_model():
    from agents.policies import GoodputOnlinePolicy

    policy = GoodputOnlinePolicy(max_depth=7, warmup_gap=1)
    builder = FeatureBuilder()
    probes = []
    for i in range(12):
        action = policy.act(builder.observation(8))
        probes.append(action)
        builder.update(_verify(i, 8, action, min(action, 1)))
    assert {0, 1, 7} <= set(probes[:3])
    # Measured: speculation at this server costs nothing extra, drafts are accepted:
    # after the probes it speculates.
    assert probes[-1] > 0


def _timed(i: int, batch: int, steps: int, accepted: int, latency_s: float) -> StepRecord:
    return StepRecord(server="t", rank=0, step_index=i, time_s=float(i), batch_size=batch,
                      waiting_requests=0, running_requests=batch, kv_used_tokens=1000,
                      kv_capacity_tokens=100_000, prefill_tokens=0, steps_used=steps,
                      accepted_drafts=np.full(batch if steps else 0, accepted, np.int8),
                      step_latency_s=latency_s)



def _priced(profile, batch: int, kv: int, depth: int, accepted: int, start: int,
            n: int) -> list[StepRecord]:
    """``n`` decode records from step ``start`` at ``batch`` and ``depth``, each request
    accepting ``accepted`` drafts, timed as ``profile`` prices them with ``kv`` KV tokens."""
    latency = profile.step_latency_s(batch, depth, kv, 0, draft_extend=depth > 0,
                                     speculative_path=depth > 0)
    return [dataclasses.replace(_timed(start + i, batch, depth, accepted, latency),
                                kv_used_tokens=kv) for i in range(n)]

def test_goodput_explore_measures_what_the_observation_only_guesses():
    from agents.policies import GoodputExplorePolicy

    blackwell = load_profile("blackwell_tp8")
    teacher = GoodputExplorePolicy(blackwell, max_depth=7)
    greedy = GoodputGreedyPolicy(blackwell, max_depth=7)
    # No profile, only off measured: the feature module's generic prior says speculating
    # is nearly free, so the observation prefers a deep depth; the teacher (true costs:
    # speculation is ruinous at batch 64) keeps off, which is measured: still off.
    off = [_timed(i, 64, 0, 0, 0.07) for i in range(20)]
    builder = FeatureBuilder()
    builder.update_many(off)
    obs = builder.observation(64)
    rate = (1 + obs.expected_accepted) / obs.latency_pred_s
    assert int(np.argmax(rate)) > 0 and obs.cost_samples[1:].sum() == 0
    assert greedy.act(obs) == 0
    # ...so it measures the cheapest depth that looks better instead of imitating the
    # knowledge of the true cost, which the student cannot have.
    assert teacher.act(obs) == 1
    # Once depth 1 was measured (and costs what it does: 5x off), the estimate agrees: off.
    slow = [_timed(20 + i, 64, 1, 1, 0.37) for i in range(10)]
    for record in slow:
        record.accepted_drafts[::4] = 0  # 3 in 4 first drafts accepted
    builder.update_many(slow)
    assert teacher.act(builder.observation(64)) == 0
    # With the true profile the estimate is the truth: nothing to measure, greedy's choice.
    exact = FeatureBuilder(cost_prior=blackwell)
    exact.update_many(off)
    assert teacher.act(exact.observation(64)) == greedy.act(exact.observation(64)) == 0


def test_goodput_explore_measures_a_cheaper_depth_when_the_measured_one_contradicts_the_profile():
    from agents.policies import GoodputExplorePolicy

    # The teacher's "true" costs are the handed profile's: by them the deepest depth pays
    # (every draft accepted), so greedy runs it. The server measures it at twice that (as
    # the H200 MoE at acceptance 2.5 did with its first profile), and the estimate charges
    # the cheaper depths with the same excess: the deepest still looks best. But the
    # profile is contradicted, so what it says of the cheaper depths is suspect too: the
    # teacher measures one instead of acting on a cost the student cannot know.
    moe = load_profile("h200_qwen3_30b_a3b")
    teacher = GoodputExplorePolicy(moe, max_depth=7)
    greedy = GoodputGreedyPolicy(moe, max_depth=7)

    def at(depth: int, times: float, start: int, n: int) -> list[StepRecord]:
        latency = times * moe.step_latency_s(48, depth, 1000, 0, draft_extend=depth > 0,
                                             speculative_path=depth > 0)
        return [_timed(start + i, 48, depth, depth, latency) for i in range(n)]

    builder = FeatureBuilder(cost_prior=moe)
    builder.update_many(at(7, 2.0, 0, 40))
    obs = builder.observation(48)
    rate = (1 + obs.expected_accepted) / obs.latency_pred_s
    assert obs.cost_profile_error > 0.6 and obs.cost_samples[:7].max() == 0
    assert int(np.argmax(rate)) == 7 and greedy.act(obs) == 7
    probe = teacher.act(obs)
    assert probe < 7
    # That depth measured (at its prior: the excess was the deep depth's own) until the
    # recent profile error has decayed: the estimate now knows, and the teacher follows
    # its true costs again.
    builder.update_many(at(probe, 1.0, 40, 12))
    obs = builder.observation(48)
    assert obs.cost_samples[probe] > 1
    assert teacher.act(obs) == greedy.act(obs)
    # Measured as the profile says: nothing contradicts it, no probing.
    agrees = FeatureBuilder(cost_prior=moe)
    agrees.update_many(at(7, 1.0, 0, 40))
    obs = agrees.observation(48)
    assert abs(obs.cost_profile_error) < 0.01
    assert GoodputExplorePolicy(moe, max_depth=7).act(obs) == greedy.act(obs) == 7


def test_goodput_explore_measures_acceptance_it_never_saw_when_speculating_looks_close():
    from agents.policies import GoodputExplorePolicy

    # A closed loop that starts at batch 32 on the H200: with the features' acceptance
    # prior, off looks a few per cent better than speculating, so greedy stays off (and
    # escapes only on a probe budget the student cannot see). The teacher measures the
    # acceptance at depth 1 instead; once it is measured (high), greedy's choice again.
    h200 = load_profile("h200_llama31_8b")
    teacher = GoodputExplorePolicy(h200, max_depth=7)
    greedy = GoodputGreedyPolicy(h200, max_depth=7)

    def at(depth: int, accepted: int, start: int, n: int) -> list[StepRecord]:
        return _priced(h200, 32, 10_000, depth, accepted, start, n)

    builder = FeatureBuilder(cost_prior=h200)
    builder.update_many(at(0, 0, 0, 20))
    obs = builder.observation(32)
    rate = (1 + obs.expected_accepted) / obs.latency_pred_s
    assert rate[0] > rate[1:].max() > 0.95 * rate[0]
    assert greedy.act(obs) == 0
    assert teacher.act(obs) == 1
    builder.update_many(at(1, 1, 20, 2) + at(1, 1, 22, 4))  # the first one back is left out
    obs = builder.observation(32)
    assert teacher.act(obs) == greedy.act(obs) > 0


def test_goodput_explore_accept_margin_measures_acceptance_at_a_full_batch():
    from agents.policies import GoodputExplorePolicy

    # 64 clients on the H200 run at its cap, batch 48: on the features' acceptance prior
    # the best depth looks about 20% below off, outside the default 5% margin, so the
    # teacher stays off (greedy too: it escapes on a hidden budget only, after hundreds
    # of steps) where the first position accepts 0.99 and depth 3 is 7% faster.
    # accept_margin=0.25 measures at depth 1; once measured, greedy's choice again.
    h200 = load_profile("h200_llama31_8b")
    kv = 48 * 384

    def at(depth: int, accepted: int, start: int, n: int) -> list[StepRecord]:
        return _priced(h200, 48, kv, depth, accepted, start, n)

    builder = FeatureBuilder(cost_prior=h200)
    builder.update_many(at(0, 0, 0, 20))
    obs = builder.observation(48)
    for options in ({}, {"accept_prior_strength": 1.0}):
        default = GoodputExplorePolicy(h200, max_depth=7, **options)
        wide = GoodputExplorePolicy(h200, max_depth=7, accept_margin=0.25, **options)
        expected = default.measured_expected(obs)
        rate = (1 + expected) / obs.latency_pred_s
        assert 0.75 * rate[0] < rate[1:].max() < 0.9 * rate[0]
        assert default.act(obs) == 0
        assert wide.act(obs) == 1
    builder.update_many(at(3, 3, 20, 2) + at(3, 3, 22, 4))  # the first one back is left out
    obs = builder.observation(48)
    assert wide.act(obs) == GoodputGreedyPolicy(h200, max_depth=7).act(obs) > 0
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="accept_margin must lie in"):
            make_policy("goodput_explore", profile=h200, options={"accept_margin": bad})


def test_goodput_explore_weaker_acceptance_prior_reads_the_measured_rate():
    from agents.policies import GoodputExplorePolicy

    # Batch 1 at depth 1, one first draft in ten accepted over 40 steps: the feature
    # module's prior (0.7, 4 pseudo-requests) keeps the estimate well above 0.1; the
    # teacher undoes that prior from the vector's rate and trial count and applies a
    # weaker one.
    h200 = load_profile("h200_llama31_8b")
    records = [_timed(i, 1, 1, 1 if i % 10 == 0 else 0, 0.01) for i in range(40)]
    builder = FeatureBuilder(cost_prior=h200)
    builder.update_many(records)
    obs = builder.observation(1)
    same = GoodputExplorePolicy(h200, max_depth=7, accept_prior_strength=4.0)
    np.testing.assert_allclose(same.measured_expected(obs), obs.expected_accepted, atol=1e-5)
    assert GoodputExplorePolicy(h200, max_depth=7).measured_expected(obs) is obs.expected_accepted
    weak = GoodputExplorePolicy(h200, max_depth=7, accept_prior_strength=1.0)
    measured = weak.measured_expected(obs)
    assert obs.expected_accepted[1] > 0.15
    assert 0.08 < measured[1] < 0.13
    # Deeper positions inherit the first one's weaker estimate: every depth expects less.
    assert (measured[1:] < obs.expected_accepted[1:]).all()
    assert (np.diff(measured) >= 0).all()


def test_make_policy_options_reach_goodput_explore_only():
    h200 = load_profile("h200_llama31_8b")
    teacher = make_policy("goodput_explore", profile=h200, options={"accept_prior_strength": 1.0})
    assert teacher.accept_prior_strength == 1.0
    with pytest.raises(ValueError, match="'goodput_greedy' takes no options"):
        make_policy("goodput_greedy", profile=h200, options={"accept_prior_strength": 1.0})
    with pytest.raises(ValueError, match=r"bad options.*nosuch"):
        make_policy("goodput_explore", profile=h200, options={"nosuch": 1})


def test_off_hysteresis_keeps_speculation_on_near_break_even_only():
    from agents.policies import _GreedyRule

    latency = np.full(8, 0.01)
    near = np.array([1.04, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])  # off 4% above depth 1
    far = near.copy()
    far[0] = 1.06  # off 6% above depth 1
    plain = _GreedyRule(7)
    assert plain.choose(near, latency, current=1) == 0  # beyond the 3% hysteresis: off
    sticky = _GreedyRule(7, off_hysteresis=0.05)
    assert sticky.choose(near, latency, current=1) == 1
    assert sticky.choose(far, latency, current=1) == 0
    # It holds only a running depth: from off, off stays the choice.
    assert sticky.choose(near, latency, current=0) == 0
    # Kept on, the best speculative depth still wins where it beats the running one.
    deeper = np.array([1.045, 1.0, 1.035, 0.8, 0.7, 0.6, 0.5, 0.4])
    assert sticky.choose(deeper, latency, current=1) == 2


def test_off_hysteresis_reaches_goodput_explore_and_is_checked():
    h200 = load_profile("h200_llama31_8b")
    teacher = make_policy("goodput_explore", profile=h200, options={"off_hysteresis": 0.05})
    assert teacher.greedy.rule.off_hysteresis == 0.05
    assert make_policy("goodput_explore", profile=h200).greedy.rule.off_hysteresis == 0.0
    with pytest.raises(ValueError, match="off_hysteresis must be >= 0"):
        make_policy("goodput_explore", profile=h200, options={"off_hysteresis": -0.1})


def test_a_trained_policy_is_fed_its_own_file_s_features():
    """specctl-eval and the sweep build a ppo policy's features from its file's spec (e.g.
    latency_model 2); every other policy gets the environment's."""
    from agents.policies import ExportedPolicyAdapter, StaticPolicy
    from controller.policy_file import ExportedPolicy
    from env.features import FeatureSpec

    spec = FeatureSpec(latency_model=2)
    adapter = ExportedPolicyAdapter(ExportedPolicy.random(spec, seed=1))
    assert adapter.feature_spec(FeatureSpec()) == spec
    assert StaticPolicy(2).feature_spec(FeatureSpec()) == FeatureSpec()


@pytest.mark.parametrize("candidates", [None, (0, 1, 3, 5), (0, 3, 5), (1, 3)])
@pytest.mark.parametrize("probing", [0, 1, 2])
def test_the_adapter_decides_as_the_daemon_over_the_servers_candidate_steps(candidates,
                                                                             probing):
    """The simulator's ppo adapter, given the steps a server offers, masks the policy's
    other actions as controller.decider.evaluate does (the arg-max, the guard, the probe:
    the probe's depth 1 is not offered by (0, 3, 5), so it probes at 3 there)."""
    from types import SimpleNamespace

    from agents.policies import ExportedPolicyAdapter
    from controller.decider import allowed_actions, evaluate
    from controller.policy_file import ExportedPolicy
    from env.guard import NO_GUARD, GuardSpec

    spec = FeatureSpec()
    policy = ExportedPolicy.random(spec, seed=3)
    # a guard that acts on these random rows now and then (its margin is a log price)
    guard = GuardSpec(margin=-0.2, confidence=0.01, max_profile_error=1.0)
    adapter = ExportedPolicyAdapter(policy, guard=guard, candidates=candidates)
    actions = np.asarray(policy.actions)
    allowed = allowed_actions(actions, candidates)
    rng = np.random.default_rng(7)
    rows = len(spec.batch_grid)
    chosen = set()
    guarded = 0
    for _ in range(20):
        grid = rng.normal(0.0, 1.0, size=(rows, spec.size)).astype(np.float32)
        index = evaluate(policy, [grid.copy()], [allowed], [probing] if probing else None,
                         policy.probe, guard)[0][0]
        unguarded = evaluate(policy, [grid.copy()], [allowed], [probing] if probing else None,
                             policy.probe, NO_GUARD)[0][0]
        guarded += int((index != unguarded).sum())
        for row in range(rows):
            obs = SimpleNamespace(vector=grid[row].copy(), probing=probing)
            got = adapter.act(obs)
            assert got == actions[index[row]]
            chosen.add(got)
    # the guard's path is exercised where it can act (off offered, no off probe)
    assert guarded > 0 or probing == 2 or (candidates is not None and 0 not in candidates)
    if candidates is not None:
        assert chosen <= set(candidates)
    elif probing != 2:  # the random policy picks actions no server above offers
        assert chosen - {0, 1, 3, 5}


def test_candidates_that_leave_no_action_are_refused():
    from agents.policies import ExportedPolicyAdapter
    from controller.policy_file import ExportedPolicy

    policy = ExportedPolicy.random(FeatureSpec(), actions=[0, 2, 4], seed=1)
    with pytest.raises(ValueError, match="no action of the policy"):
        ExportedPolicyAdapter(policy, candidates=(1, 3))
    with pytest.raises(ValueError, match="takes no candidate steps"):
        make_policy("static_3", candidates=(0, 3))

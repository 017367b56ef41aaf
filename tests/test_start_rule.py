"""``ProbeSpec.start_off``: the start rule. In a stream without a cost profile, while no
speculative depth holds a cost sample, once one speculative step the decider decided has
run (not the re-entry warm-up after off), every decision is off (``PROBE_START``) until a
speculative sample arrives or ``start_off`` decisions have passed (then another try); and
no decision of that phase is held by the plugin's switch hold (``unheld``), in the plugin
(the DECISION's ``flags``) and in the simulator alike. 0 (the default, every policy file
without the field) is no rule, byte for byte and decision for decision."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
import pytest

from controller.decider import StreamDecider, choose, steps_at
from controller.policy_file import ExportedPolicy
from controller.wire import Decision, WireError, decode, encode_decision
from env.features import FeatureBuilder
from env.probe import DEFAULT_PROBE, NOT_PROBING, PROBE_START, ProbeSpec
from env.rollout import DecisionLoop
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.workloads import ClosedLoop
from tests.lockstep import decode_record

BACKENDS = ("numpy", "compiled")
RULE = ProbeSpec(start_off=6)
SHIPPED = "docs/results/nopro26/policy_baef2897.npz"


def builder(backend: str, spec: ProbeSpec = RULE, profile=None) -> FeatureBuilder:
    return FeatureBuilder(None, profile, backend, probe=spec)


def states(features: FeatureBuilder) -> tuple[int, bool]:
    return features.probing, features.unheld


# -- the field ------------------------------------------------------------------------


def test_the_default_is_no_rule_and_the_field_travels_only_when_set(tmp_path):
    assert DEFAULT_PROBE.start_off == 0
    assert "start_off" not in DEFAULT_PROBE.to_dict()  # old files' bytes unchanged
    shipped = ExportedPolicy.load(SHIPPED)
    assert shipped.probe.start_off == 0
    again = dataclasses.replace(shipped, probe=dataclasses.replace(shipped.probe, start_off=0))
    path = again.save_named_by_hash(tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest().startswith("baef2897")
    assert ProbeSpec.from_dict(RULE.to_dict()) == RULE and RULE.to_dict()["start_off"] == 6
    for bad in (-1, 1025, 1.5, True):
        with pytest.raises(ValueError, match=r"probe\.start_off"):
            ProbeSpec(start_off=bad)


# -- the rule, in each feature backend --------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_after_one_speculative_step_decisions_are_off_and_unheld_until_its_sample(backend):
    features = builder(backend)
    assert states(features) == (NOT_PROBING, True)  # open from the start: unheld
    features.decided(7)  # the first decision speculates (no warm-up at a stream's start)
    assert states(features) == (PROBE_START, True)
    features.decided(0)
    features.update(decode_record(0, 7, 128, 0.66))  # its latency: a depth-7 sample
    assert states(features) == (NOT_PROBING, False)  # measured: the rule is done
    features.decided(7)
    assert states(features) == (NOT_PROBING, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_warm_up_after_off_is_not_counted(backend):
    features = builder(backend)
    features.decided(0)
    features.decided(3)  # runs as the re-entry warm-up (depth 0): measures nothing
    assert features.probing == NOT_PROBING
    features.decided(3)
    assert features.probing == PROBE_START


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_a_sample_another_try_after_start_off_decisions(backend):
    features = builder(backend)
    features.decided(1)
    seen = []
    for _ in range(RULE.start_off + 1):
        seen.append(features.probing)
        features.decided(0)
    assert seen == [PROBE_START] * RULE.start_off + [NOT_PROBING]
    # an off record (its latency kept) and a dropped speculative one measure no depth > 0
    features.update(decode_record(0, 0, 8, 0.01))
    features.update(decode_record(1, 1, 8, 0.0))
    assert features.unheld
    features.decided(1)  # after the rule's off decisions: the re-entry warm-up
    assert features.probing == NOT_PROBING
    features.decided(1)
    assert features.probing == PROBE_START


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_a_profile_or_without_the_field_nothing_changes(backend):
    profile = load_profile("h200_llama31_8b")
    for features in (builder(backend, RULE, profile), builder(backend, DEFAULT_PROBE)):
        for depth in (7, 7, 0, 7):
            features.decided(depth)
            assert states(features) == (NOT_PROBING, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_copy_keeps_the_rules_state_and_a_reset_opens_it_again(backend):
    features = builder(backend)
    features.decided(2)
    copy = features.copy()
    assert states(copy) == (PROBE_START, True)
    copy.update(decode_record(0, 2, 8, 0.02))
    assert states(copy) == (NOT_PROBING, False) and states(features) == (PROBE_START, True)
    features.reset()
    assert states(features) == (NOT_PROBING, True)


def _backend_traces(spec: ProbeSpec, seed: int, decisions: list[int],
                    recorded: list[int]) -> list[list]:
    """Per backend, 60 random decisions (from ``decisions``; what ``decided`` returned)
    and, a lag later, random decode records (depths from ``recorded``; the speculative
    ones' latency dropped until step 40), with the states after each."""
    traces = []
    for backend in BACKENDS:
        features, trace = builder(backend, spec), []
        rng = np.random.default_rng(seed)
        for step in range(60):
            trace.append(features.decided(int(rng.choice(decisions))))
            if step > 3:
                depth = int(rng.choice(recorded))
                latency = 0.0 if depth and step < 40 else 0.01
                features.update(decode_record(step, depth, 8, latency))
            trace.append(states(features))
        traces.append(trace)
    return traces


def test_both_backends_agree_record_by_record():
    traces = _backend_traces(RULE, 0, [0, 0, 1, 3], [0, 1])
    assert traces[0] == traces[1]
    assert (PROBE_START, True) in traces[0] and (NOT_PROBING, False) in traces[0]


def test_the_deciders_turn_every_speculating_row_off():
    policy = ExportedPolicy.load(SHIPPED)
    rows = len(policy.feature_spec.batch_grid)
    grid = np.zeros((rows, policy.feature_spec.size), dtype=np.float32)
    steps, _, _ = choose(policy, np.asarray(policy.actions), [grid], [None], [PROBE_START])
    assert (steps == 0).all()


# -- the simulator's hold and the decision loop -----------------------------------------


def _sim(min_switch_steps: int = 4) -> Simulator:
    return Simulator(load_profile("h200_llama31_8b"), SGLangSimulatedAcceptance(3.5),
                     ClosedLoop(8, 64, 200),
                     SchedulerConfig(min_switch_steps=min_switch_steps), seed=0)


def _ran(sim: Simulator, asks: list[tuple[int, bool]]) -> list[int]:
    sim.reset(0)
    sim.advance()
    out = []
    for depth, unheld in asks:
        out.append(sim.decode(depth, unheld=unheld).steps_used)
        sim.advance()
    return out


def test_the_simulator_neither_holds_an_unheld_switch_nor_holds_after_it():
    sim = _sim()
    assert _ran(sim, [(7, False), (0, False), (0, False), (0, False), (0, False)]) == [7] * 4 + [0]
    assert _ran(sim, [(7, False), (0, True), (0, True), (3, False)])[:3] == [7, 0, 0]
    # a switch after unheld decisions is not held by them ...
    ran = _ran(sim, [(7, False), (0, True), (5, False), (0, False)])
    assert ran[1] == 0 and ran[2] in (0, 5)  # (0 where the re-entry warm-up runs)
    # ... but the next ordinary switch holds as before
    assert ran[3] == ran[2]


def test_in_the_decision_loop_one_speculative_step_then_off_until_its_sample():
    """A policy that always asks depth 7, no cost profile: the rule lets one depth-7 step
    run, then off (not held by the simulator's 4-step hold) until that step's latency
    reaches the features, then the policy's choice again."""
    loop = DecisionLoop(_sim(), None, feedback_lag=3, probe=RULE)
    obs = loop.reset(0)
    ran, probing = [], []
    while obs is not None and len(ran) < 12:
        probing.append(obs.probing)
        depth = 0 if obs.probing == PROBE_START else 7
        obs, outcome = loop.step(depth)
        ran.append(outcome.record.steps_used)
    assert ran[0] == 7 and probing[0] == NOT_PROBING
    first_back = probing.index(NOT_PROBING, 1)
    assert set(probing[1:first_back]) == {PROBE_START} and 3 <= first_back <= RULE.start_off
    assert ran[1:first_back] == [0] * (first_back - 1)
    assert 7 in ran[first_back:]
    assert not loop.features.unheld


# -- local mode and the wire ---------------------------------------------------------------


def test_local_mode_marks_the_rules_decisions_unheld():
    policy = ExportedPolicy.load(SHIPPED)
    policy = dataclasses.replace(policy, probe=dataclasses.replace(policy.probe, start_off=6))
    local = StreamDecider(policy, None)
    decisions = [local.decide(decode_record(i, 0, 128, 0.036)) for i in range(3)]
    assert all(d.unheld for d in decisions)
    chosen = [steps_at(d.batch_grid, d.steps, 128) for d in decisions]
    assert chosen[0] > 0  # the priors price speculation cheap at a full batch: then off
    assert chosen[1:] == [0, 0] and local.builder.probing == PROBE_START
    shipped = StreamDecider(ExportedPolicy.load(SHIPPED), None)
    plain = [shipped.decide(decode_record(i, 0, 128, 0.036)) for i in range(3)]
    assert steps_at(plain[0].batch_grid, plain[0].steps, 128) == chosen[0]
    assert all(steps_at(d.batch_grid, d.steps, 128) > 0 for d in plain)  # speculates on
    assert not any(d.unheld for d in plain)


def test_an_unheld_decision_travels_as_a_ninth_item_and_others_stay_eight():
    plain = Decision(3, 9, "p", (1, 64), (3, 0))
    unheld = Decision(3, 9, "p", (1, 64), (0, 0), unheld=True)
    assert len(msgpack.unpackb(encode_decision(plain))) == 8
    assert len(msgpack.unpackb(encode_decision(unheld))) == 9
    assert decode(encode_decision(unheld)) == unheld
    assert decode(encode_decision(plain)) == plain
    items = msgpack.unpackb(encode_decision(plain))
    assert decode(msgpack.packb([*items, 0])) == plain
    for bad in (2, 3, -1, True, "1"):
        with pytest.raises(WireError, match="flags"):
            decode(msgpack.packb([*items, bad]))
    fallback = msgpack.unpackb(encode_decision(Decision.fallback(3, 9, "p")))
    with pytest.raises(WireError, match="flags"):
        decode(msgpack.packb([*fallback, 1]))


def _daemon_against_local(tmp_path, name: str, records=None,
                          **probe_changes) -> list[Decision]:
    """``records`` (default: six decode records at batch 128) without a profile, sent to
    ``specctl-serve`` under the shipped file's parent with ``probe_changes``: each decision
    equals local mode's for the same record (steps and ``unheld``) and travels as nine
    items exactly when unheld. Returns the daemon's decisions."""
    import os

    from controller.reload import PolicyHolder
    from controller.server import ControllerServer, ServeOptions
    from controller.wire import encode_step
    from tests.test_controller_serve import Client

    policy = ExportedPolicy.load(SHIPPED)
    policy = dataclasses.replace(policy, probe=dataclasses.replace(policy.probe,
                                                                   **probe_changes))
    path = tmp_path / "policy.npz"
    policy.save(path)
    server = ControllerServer(PolicyHolder(path), ServeOptions(
        endpoint=f"inproc://{name}-{os.getpid()}", answers_per_poll=1))
    client = Client(server.endpoint, server._context)
    local = StreamDecider(ExportedPolicy.load(path), None)
    try:
        sent = []
        if records is None:
            records = [decode_record(step, 0, 128, 0.036) for step in range(1, 7)]
        for record in records:
            record = dataclasses.replace(record, server="s")
            client.send(encode_step(record))
            assert server.poll_once(100) == 1
            frame = client.sock.recv()
            got, want = decode(frame), local.decide(record)
            assert (got.batch_grid, got.steps, got.unheld) == (
                want.batch_grid, want.steps, want.unheld)
            assert len(msgpack.unpackb(frame)) == (9 if got.unheld else 8)
            sent.append(got)
        return sent
    finally:
        client.sock.close(0)
        server.close()


def test_the_daemon_decides_and_marks_as_local_mode(tmp_path):
    """``specctl-serve`` under a policy with the rule: the same decisions as local mode fed
    the same records, the rule's marked ``unheld`` and sent as nine items."""
    sent = _daemon_against_local(tmp_path, "start-rule", start_off=6)
    assert all(d.unheld for d in sent)
    assert [steps_at(d.batch_grid, d.steps, 128) > 0 for d in sent[:3]] == [
        True, False, False]


def test_a_prefill_record_under_the_rule_is_counted_at_the_last_decode_batch(tmp_path):
    """A prefill's TELEMETRY while the rule is open (the first decision ran a depth at
    batch 128): local mode answers it as the daemon does, counting what it runs at the
    latest decode record's batch (it raised AttributeError before)."""
    first = decode_record(1, 0, 128, 0.036)
    prefill = dataclasses.replace(decode_record(2, 0, 1, 0.030), prefill_tokens=512,
                                  batch_size=1)
    records = [first, prefill, *(decode_record(step, 0, 128, 0.036) for step in (3, 4))]
    sent = _daemon_against_local(tmp_path, "start-rule-prefill", records, start_off=6)
    assert all(d.unheld for d in sent)
    # the prefill's answer is off at batch 128: the rule counted the first decision's depth
    assert [steps_at(d.batch_grid, d.steps, 128) > 0 for d in sent] == [
        True, False, False, False]


# -- start_depth: the rule only after an unmeasured step at that depth or deeper -----------

DEEP = ProbeSpec(start_off=6, start_depth=3)


def test_start_depth_defaults_to_every_depth_and_travels_only_when_set(tmp_path):
    assert DEFAULT_PROBE.start_depth == 0 and RULE.start_depth == 0
    assert "start_depth" not in RULE.to_dict()  # 4c5ff8da's bytes unchanged
    shipped = ExportedPolicy.load(SHIPPED)
    rule = dataclasses.replace(shipped, probe=dataclasses.replace(shipped.probe, start_off=6,
                                                                  start_depth=0))
    path = rule.save_named_by_hash(tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest().startswith("4c5ff8da")
    assert ProbeSpec.from_dict(DEEP.to_dict()) == DEEP and DEEP.to_dict()["start_depth"] == 3
    for bad in (-1, 128, 2.5, True):
        with pytest.raises(ValueError, match=r"probe\.start_depth"):
            ProbeSpec(start_off=6, start_depth=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shallow_step_is_held_and_not_counted_a_deep_one_is(backend):
    features = builder(backend, DEEP)
    assert states(features) == (NOT_PROBING, True)  # open: its decisions may be unheld
    assert features.decided(1) is False and features.decided(2) is False  # held, as today
    assert features.probing == NOT_PROBING
    assert features.decided(3) is True  # unheld and counted: off from now
    assert states(features) == (PROBE_START, True)
    assert [features.decided(0) for _ in range(DEEP.start_off)] == [True] * DEEP.start_off
    assert features.probing == NOT_PROBING  # no sample came: another try
    assert features.decided(0) is False  # an off decision the rule did not force: held
    assert features.decided(7) is True  # the re-entry warm-up: runs at once, not counted
    assert features.probing == NOT_PROBING
    assert features.decided(7) is True and features.probing == PROBE_START


@pytest.mark.parametrize("backend", BACKENDS)
def test_at_start_depth_0_every_decision_of_the_open_rule_is_unheld(backend):
    features = builder(backend)
    assert features.decided(1) is True and features.probing == PROBE_START
    assert features.decided(0) is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shallow_steps_sample_closes_the_rule(backend):
    features = builder(backend, DEEP)
    features.decided(1)
    features.update(decode_record(0, 1, 8, 0.012))
    assert states(features) == (NOT_PROBING, False)
    assert features.decided(7) is False and features.probing == NOT_PROBING


def test_both_backends_agree_under_start_depth():
    traces = _backend_traces(DEEP, 1, [0, 0, 1, 2, 3, 7], [0, 2])
    assert traces[0] == traces[1]
    assert (PROBE_START, True) in traces[0] and False in traces[0] and True in traces[0]


def _loop_ran(probe: ProbeSpec, asks: list[int]) -> tuple[list[int], list[int]]:
    loop = DecisionLoop(_sim(), None, feedback_lag=3, probe=probe)
    obs = loop.reset(0)
    ran, probing = [], []
    for ask in asks:
        probing.append(obs.probing)
        obs, outcome = loop.step(0 if obs.probing == PROBE_START else ask)
        ran.append(outcome.record.steps_used)
    return ran, probing


def test_in_the_decision_loop_a_shallow_first_step_runs_held_as_without_the_rule():
    asks = [1, 0, 0, 0, 0, 0, 0, 0]
    plain, _ = _loop_ran(DEFAULT_PROBE, asks)
    assert plain[:4] == [1, 1, 1, 1]  # the simulator's 4-step hold
    assert _loop_ran(DEEP, asks) == (plain, [NOT_PROBING] * len(asks))
    ran, probing = _loop_ran(RULE, asks)  # start_depth 0: one step, then off at once
    assert ran[:2] == [1, 0] and probing[1] == PROBE_START


def test_in_the_decision_loop_a_deep_step_under_start_depth_is_one_step_then_off():
    ran, probing = _loop_ran(DEEP, [7] * 12)
    assert _loop_ran(RULE, [7] * 12) == (ran, probing)
    assert ran[0] == 7 and probing[1] == PROBE_START and ran[1] == 0


def _first_choice() -> int:
    shipped = StreamDecider(ExportedPolicy.load(SHIPPED), None)
    decision = shipped.decide(decode_record(0, 0, 128, 0.036))
    return steps_at(decision.batch_grid, decision.steps, 128)


def test_local_mode_under_start_depth():
    first = _first_choice()
    assert first > 1
    shipped = ExportedPolicy.load(SHIPPED)
    plain = StreamDecider(shipped, None)
    want = [plain.decide(decode_record(i, 0, 128, 0.036)) for i in range(4)]
    # deeper than the network's first choice: the decisions of the file without the rule
    above = dataclasses.replace(shipped, probe=dataclasses.replace(
        shipped.probe, start_off=6, start_depth=first + 1))
    local = StreamDecider(above, None)
    got = [local.decide(decode_record(i, 0, 128, 0.036)) for i in range(4)]
    assert [(d.batch_grid, d.steps, d.unheld) for d in got] == [
        (d.batch_grid, d.steps, False) for d in want]
    # at it: one step, then off, unheld
    at = dataclasses.replace(above, probe=dataclasses.replace(above.probe, start_depth=first))
    local = StreamDecider(at, None)
    got = [local.decide(decode_record(i, 0, 128, 0.036)) for i in range(3)]
    assert [steps_at(d.batch_grid, d.steps, 128) for d in got] == [first, 0, 0]
    assert all(d.unheld for d in got)


@pytest.mark.parametrize("above", [False, True])
def test_the_daemon_decides_and_marks_as_local_mode_under_start_depth(tmp_path, above):
    """Under ``start_depth`` the daemon decides and marks as local mode: with the first
    choice at ``start_depth`` the rule's decisions are unheld; with it shallower, none."""
    first = _first_choice()
    sent = _daemon_against_local(tmp_path, f"start-depth-{above}", None, start_off=6,
                                 start_depth=first + above)
    assert any(d.unheld for d in sent) is (not above)

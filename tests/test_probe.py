"""The acceptance probe (env/probe.py): when it fires, what it costs, that it is off when
turned off, and that the simulator's policy adapter, the daemon and local mode probe on
the same steps of the same telemetry."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agents.policies import ExportedPolicyAdapter
from controller.decider import StreamDecider
from controller.policy_file import ExportedPolicy, PolicyFileError
from controller.reload import PolicyHolder
from controller.server import ControllerServer, ServeOptions
from controller.wire import Hello, decode, encode_hello, pack_telemetry
from env.features import FeatureBuilder, FeatureSpec
from env.guard import guard_columns
from env.probe import (
    DEFAULT_PROBE,
    NO_PROBE,
    NOT_PROBING,
    PROBE_FIRST,
    ProbeSpec,
    apply_probe,
    could_pay,
)
from env.rollout import DecisionLoop, rollout
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.schema import StepRecord
from env.traces.workloads import ClosedLoop
from tests.lockstep import (
    copied_probe_states,
    decode_record,
    lockstep,
    off_policy,
    probe_states,
    sim,
    with_meta,
)

BACKENDS = ("numpy", "compiled")


def off_stream(n: int, start: int = 0) -> list[StepRecord]:
    return [decode_record(start + i) for i in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_never_measured_acceptance_is_probed_once_the_budget_covers_it(backend):
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(None, profile, backend, probe=DEFAULT_PROBE)
    flags = probe_states(builder, off_stream(2000))
    fired = [i for i, f in enumerate(flags) if f]
    assert fired, "an off stream that never measured acceptance must be probed"
    # two records per probe (DEFAULT_PROBE.steps), consecutive
    assert fired[1] == fired[0] + 1 and len(fired) % DEFAULT_PROBE.steps == 0
    # not at once: the budget (1% of the off time) must first cover the probe's extra cost
    extra = (builder.latency_predictions_s(48)[1] - builder.latency_predictions_s(48)[0])
    needed = DEFAULT_PROBE.steps * extra / (DEFAULT_PROBE.share * 0.006)
    assert fired[0] >= needed - 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_probe_costs_at_most_its_share_of_the_time_off(backend):
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(None, profile, backend, probe=DEFAULT_PROBE)
    n = 20_000
    probes = sum(probe_states(builder, off_stream(n))) / DEFAULT_PROBE.steps
    predicted = builder.latency_predictions_s(48)
    extra = DEFAULT_PROBE.steps * (predicted[1] - predicted[0])
    assert probes >= 2  # it keeps probing while acceptance stays unmeasured
    assert probes * extra <= DEFAULT_PROBE.share * n * 0.006 + extra


@pytest.mark.parametrize("backend", BACKENDS)
def test_fresh_acceptance_is_not_probed_stale_is(backend):
    spec = ProbeSpec(stale_after=300)
    builder = FeatureBuilder(None, load_profile("h200_llama31_8b"), backend, probe=spec)
    measured = [decode_record(i, steps=3, accepted=3) for i in range(20)]
    probe_states(builder, measured)
    assert builder.acceptance_age() == (0, True)
    flags = probe_states(builder, off_stream(spec.stale_after, start=20))
    assert not any(flags)  # measured within stale_after decode steps: nothing to probe
    flags = probe_states(builder, off_stream(3000, start=20 + spec.stale_after))
    assert any(flags)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_probe_is_deterministic_and_copies_with_the_features(backend):
    stream = off_stream(1500)
    profile = load_profile("h200_llama31_8b")
    first = probe_states(FeatureBuilder(None, profile, backend, probe=DEFAULT_PROBE), stream)
    second = copied_probe_states(FeatureBuilder(None, profile, backend, probe=DEFAULT_PROBE),
                                 stream, decode_record(10_000))
    assert first == second and any(first)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_start_probe_runs_from_a_new_streams_first_decision(backend):
    """``start_probe`` records at a stream's start probe before any off step (the budget
    would take ~360 off steps at batch 48); a reset stream starts over; 0 is none."""
    profile = load_profile("h200_llama31_8b")
    spec = ProbeSpec(start_probe=2)
    builder = FeatureBuilder(None, profile, backend, probe=spec)
    assert builder.probing == PROBE_FIRST  # before any telemetry
    assert probe_states(builder, off_stream(3)) == [PROBE_FIRST, NOT_PROBING, NOT_PROBING]
    builder.reset()
    assert builder.probing == PROBE_FIRST
    assert FeatureBuilder(None, profile, backend, probe=DEFAULT_PROBE).probing == NOT_PROBING
    copied = copied_probe_states(FeatureBuilder(None, profile, backend, probe=spec),
                                 off_stream(3), decode_record(100))
    assert copied == [PROBE_FIRST, NOT_PROBING, NOT_PROBING]
    # only with a cost profile, and only while no acceptance is measured
    unprofiled = FeatureBuilder(None, None, backend, probe=spec)
    assert unprofiled.probing == NOT_PROBING
    unprofiled.reset()
    assert unprofiled.probing == NOT_PROBING
    measured = FeatureBuilder(None, profile, backend, probe=DEFAULT_PROBE)
    probe_states(measured, [decode_record(i, steps=3, accepted=3) for i in range(5)])
    measured.set_probe(spec)  # a reload mid-stream
    assert measured.probing == NOT_PROBING
    fresh = FeatureBuilder(None, profile, backend, probe=DEFAULT_PROBE)
    fresh.set_probe(spec)  # before any record: a new stream
    assert fresh.probing == PROBE_FIRST


def test_both_backends_probe_on_the_same_records():
    profile = load_profile("h200_llama31_8b")
    stream = off_stream(1200) + [decode_record(1200 + i, steps=1) for i in range(5)] + off_stream(
        2000, start=1205)
    traces = [probe_states(FeatureBuilder(None, profile, b, probe=ProbeSpec(stale_after=500)),
                            stream) for b in BACKENDS]
    assert traces[0] == traces[1] and sum(traces[0]) >= 4


def test_no_probe_when_disabled():
    builder = FeatureBuilder(None, load_profile("h200_llama31_8b"), probe=NO_PROBE)
    assert builder.probe_tracker is None
    assert not any(probe_states(builder, off_stream(5000)))
    builder = FeatureBuilder(None, load_profile("h200_llama31_8b"))  # no probe given: none
    assert not any(probe_states(builder, off_stream(5000)))


def test_probe_rows_change_only_the_rows_left_off():
    actions = np.array([0, 1, 2, 3, 5])
    index = np.array([[0, 3, 0, 4], [0, 0, 2, 0]])
    apply_probe(ProbeSpec(depth=2), index, actions, [True, False], [None, None])
    assert index.tolist() == [[2, 3, 2, 4], [0, 0, 2, 0]]
    allowed = np.array([True, False, False, True, True])  # the server offers 0, 3, 5
    assert ProbeSpec(depth=1).action_index(actions, allowed) == 3
    assert ProbeSpec(depth=7).action_index(actions, allowed) == 4  # the largest below
    assert ProbeSpec().action_index(actions, np.array([True] + [False] * 4)) is None


def test_the_start_probe_probes_only_rows_where_some_depth_could_pay():
    """A row is probed where a depth's latency ratio over off is below the tokens a step
    commits at ``start_accept`` per position (depth 3 at 0.9: 3.439), not where it is
    above; the budgeted acceptance probe (state 1) probes every row left off."""
    spec = FeatureSpec(max_depth=3)
    columns = guard_columns(spec)
    actions = np.array([0, 1, 3])
    ratios = np.array([[1.5, 3.0, 3.3], [2.5, 3.2, 3.6], [2.1, 2.2, 3.5]])  # depths 1-3
    observations = np.zeros((3, spec.size), dtype=np.float32)
    observations[:, columns.latency[1:]] = np.log(ratios) / 3.0
    # depth 1 pays at 1.9 (row 0), depth 3 at 3.439 (row 2's 3.5 does not); depth 2 is
    # not an action, so row 1's 3.2 at depth 2 (< 3.71) is never asked
    assert could_pay(observations, columns.latency, actions, 0.9).tolist() == [True, False,
                                                                             False]
    assert could_pay(observations, columns.latency, actions, 1.0).tolist() == [True, True,
                                                                             True]
    index = np.zeros((1, 3), dtype=np.intp)
    apply_probe(ProbeSpec(start_probe=2), index, actions, [PROBE_FIRST], [None],
                observations, columns.latency)
    assert index.tolist() == [[1, 0, 0]]
    index = np.zeros((1, 3), dtype=np.intp)
    apply_probe(ProbeSpec(start_probe=2), index, actions, [True], [None])
    assert index.tolist() == [[1, 1, 1]]
    with pytest.raises(ValueError, match="start probe needs the observations"):
        apply_probe(ProbeSpec(start_probe=2), index, actions, [PROBE_FIRST], [None])


def test_probe_settings_are_checked_and_travel_in_the_policy_file(tmp_path):
    with pytest.raises(ValueError, match=r"probe\.share"):
        ProbeSpec(share=0.0)
    with pytest.raises(ValueError, match=r"probe\.depth"):
        ProbeSpec(depth=0)
    with pytest.raises(ValueError, match=r"probe: unknown fields"):
        DEFAULT_PROBE.override({"budget": 1})
    with pytest.raises(ValueError, match="probe: expected an object"):
        ProbeSpec.from_dict([1])
    assert DEFAULT_PROBE.override({"enabled": False, "share": None}) == NO_PROBE
    policy = ExportedPolicy.random(seed=1)
    assert policy.probe == DEFAULT_PROBE  # a file without a probe gets the default
    changed = dataclasses.replace(policy, probe=ProbeSpec(share=0.02, stale_after=10))
    changed.save(tmp_path / "p.npz")
    assert ExportedPolicy.load(tmp_path / "p.npz").probe == ProbeSpec(share=0.02,
                                                                      stale_after=10)
    # start_probe: checked, left out of a file at 0 (older files keep their bytes)
    with pytest.raises(ValueError, match=r"probe\.start_probe"):
        ProbeSpec(start_probe=65)
    with pytest.raises(ValueError, match=r"probe\.start_accept"):
        ProbeSpec(start_accept=0.0)
    assert not {"start_probe", "start_accept"} & set(DEFAULT_PROBE.to_dict())
    assert ProbeSpec.from_dict(ProbeSpec(start_probe=2).to_dict()).start_probe == 2
    bad = with_meta(tmp_path / "p.npz", probe={**ProbeSpec().to_dict(), "steps": 0})
    with pytest.raises(PolicyFileError, match=r"field 'probe': probe\.steps"):
        ExportedPolicy.loads(bad, "bad.npz")


def test_the_simulator_and_local_mode_probe_the_same_steps(tmp_path):
    """The env path (DecisionLoop + ExportedPolicyAdapter) and a StreamDecider fed the same
    released records decide the same steps, probes included."""
    profile = load_profile("h200_llama31_8b")
    policy = off_policy()
    loop = DecisionLoop(sim(), None, feedback_lag=3, horizon_s=4.0, cost_prior=profile)
    choices = lockstep(loop, policy, profile)
    assert len(choices) > 300 and sum(c > 0 for c in choices) >= DEFAULT_PROBE.steps


def test_the_simulator_and_local_mode_run_the_same_start_probe():
    """The shipped policy with the start probe, on the full dense H200: the simulator's
    adapter and a StreamDecider fed the same records decide the same steps, and the first
    decisions compared speculate (the probe's rows, read from the observations)."""
    profile = load_profile("h200_llama31_8b")
    shipped = ExportedPolicy.load("controller/data/default_policy.npz")
    policy = dataclasses.replace(shipped, probe=dataclasses.replace(shipped.probe,
                                                                   start_probe=2))
    loop = DecisionLoop(sim(64), None, feedback_lag=3, horizon_s=2.0, cost_prior=profile)
    choices = lockstep(loop, policy, profile)
    assert len(choices) > 50 and choices[0] > 0


def _full_batch_off_step(i: int) -> bytes:
    """Telemetry of step ``i`` of a server at batch 48 with 16 waiting, running off."""
    return pack_telemetry("srv", 0, i, i * 0.006, 48, 16, 48, 50_000, 500_000, 0,
                          0, b"", 0, 0.006)


def _probing_decisions(server: ControllerServer) -> float:
    return server.metrics.registry.get_sample_value("specctl_probing_decisions_total")


def test_the_daemon_probes_as_local_mode(tmp_path):
    path = tmp_path / "policy.npz"
    off_policy().save(path)
    profile = load_profile("h200_llama31_8b")
    server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint="inproc://probe"),
                              cost_prior=profile)
    local = StreamDecider(ExportedPolicy.load(path), (0, 1, 3), profile)
    probed = 0
    try:
        peer = (b"peer", "")
        server.handle_frame(peer, encode_hello(Hello("srv", 0, (0, 1, 3))), {})
        for i in range(1500):
            frame = _full_batch_off_step(i)
            pending: dict = {}
            server.handle_frame(peer, frame, pending)
            (_, remote), = server.decide(pending)
            mine = local.decide(decode(frame))
            assert mine == remote, f"step {i}"
            probed += any(remote.steps)
        counted = _probing_decisions(server)
    finally:
        server.close()
    assert probed >= 2
    assert counted == probed  # the policy is off on every row: each probing decision shows


def test_the_daemon_runs_the_start_probe_as_local_mode(tmp_path):
    """A new stream's first decisions probe in the daemon as in local mode, and both
    count them; a second server connecting later starts its own."""
    path = tmp_path / "policy.npz"
    off_policy(ProbeSpec(start_probe=2)).save(path)
    profile = load_profile("h200_llama31_8b")
    server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint="inproc://start"),
                              cost_prior=profile)
    probed = []
    try:
        for name in ("a", "b"):
            local = StreamDecider(ExportedPolicy.load(path), (0, 1, 3), profile)
            peer = (name.encode(), "")
            server.handle_frame(peer, encode_hello(Hello(name, 0, (0, 1, 3))), {})
            for i in range(6):
                frame = pack_telemetry(name, 0, i, i * 0.006, 48, 16, 48, 50_000, 500_000,
                                       0, 0, b"", 0, 0.006)
                pending: dict = {}
                server.handle_frame(peer, frame, pending)
                (_, remote), = server.decide(pending)
                assert local.decide(decode(frame)) == remote, f"server {name}, step {i}"
                probed.append(any(remote.steps))
        counted = _probing_decisions(server)
    finally:
        server.close()
    # each stream: the decision on its first record probes, then the policy's own (off)
    assert probed == [True] + [False] * 5 + [True] + [False] * 5
    assert counted == 2


def test_serving_without_the_probe(tmp_path):
    """``specctl-serve probe.enabled=false`` (ServeOptions.probe) and SPECCTL_PROBE=0
    (StreamDecider's override): the policy's own decisions, never a probe."""
    path = tmp_path / "policy.npz"
    off_policy().save(path)
    profile = load_profile("h200_llama31_8b")
    server = ControllerServer(PolicyHolder(path), ServeOptions(
        endpoint="inproc://noprobe", probe={"enabled": False}), cost_prior=profile)
    local = StreamDecider(ExportedPolicy.load(path), None, profile, probe={"enabled": False})
    try:
        peer = (b"peer", "")
        for i in range(1500):
            frame = _full_batch_off_step(i)
            pending: dict = {}
            server.handle_frame(peer, frame, pending)
            (_, remote), = server.decide(pending)
            assert remote == local.decide(decode(frame))
            assert not any(remote.steps)
        assert _probing_decisions(server) == 0
    finally:
        server.close()


@pytest.mark.parametrize("warmup, restarts", [
    (False, False),
    pytest.param(True, False, marks=pytest.mark.xfail(strict=True, reason=(
        "with the plugin's re-entry warm-up simulated (reentry_warmup), the default "
        "two-step probe at depth 1 is the warm-up (depth 0) and one drafting step that "
        "the features drop as a cold re-entry (features.py: steps > 0 after steps 0), so "
        "it measures nothing and the stream stays off: docs/results/warm17/README.md"))),
    (True, True),
])
def test_a_cold_dense_h200_at_64_clients_speculates_with_the_probe(warmup, restarts):
    """The shipped policy, cold, at 64 clients on the dense H200 (batch 48, 16 waiting):
    on the prior it never speculates, so it never measures acceptance; with the probe it
    measures it and runs speculation (docs/POLICY_PROBE.md). With the plugin's warm-up
    simulated it does so once its features take the step after the warm-up as warm
    (``FeatureSpec.warmup_restarts_draft``)."""
    policy = ExportedPolicy.load("controller/data/default_policy.npz")
    if restarts:
        policy = dataclasses.replace(policy, feature_spec=dataclasses.replace(
            policy.feature_spec, drop_warmup_latency=True, warmup_restarts_draft=True))
    profile = load_profile("h200_llama31_8b")
    results = {}
    for name, probe in (("off", NO_PROBE), ("on", DEFAULT_PROBE)):
        simulator = Simulator(profile, SGLangSimulatedAcceptance(3.5),
                              ClosedLoop(64, 256, 256),
                              SchedulerConfig(max_running_requests=48, reentry_warmup=warmup),
                              seed=5)
        loop = DecisionLoop(simulator, policy.feature_spec, feedback_lag=3, horizon_s=6.0,
                            cost_prior=profile)
        results[name] = rollout(loop, ExportedPolicyAdapter(policy, probe=probe), seed=5)
    assert results["off"].steps_chosen[0] == results["off"].decisions  # off throughout
    # ~360 off steps (2.1 s) until 1% of the time off pays for the probe, then speculation
    assert sum(results["on"].steps_chosen[1:]) > 100
    assert results["on"].throughput_tok_s > results["off"].throughput_tok_s


def test_the_start_probe_keeps_a_full_dense_h200_fresh():
    """The shipped policy on the dense H200 at 64 clients (batch 48), where every request
    that decodes while off keeps stale draft state (``stale_accept_loss``): without the
    start probe it goes off on its first decision, on the prior, and the later probe
    measures only stale acceptance; with it, acceptance is measured first and the stream
    speculates from the start (``docs/results/startprobe28/``)."""
    policy = ExportedPolicy.load("controller/data/default_policy.npz")
    profile = load_profile("h200_llama31_8b")
    results = {}
    for start in (0, 2):
        simulator = Simulator(profile, SGLangSimulatedAcceptance(3.5), ClosedLoop(64, 256, 256),
                              SchedulerConfig(max_running_requests=48, reentry_warmup=True,
                                              stale_accept_loss=0.28), seed=5)
        loop = DecisionLoop(simulator, policy.feature_spec, feedback_lag=3, horizon_s=4.0,
                            cost_prior=profile)
        probe = dataclasses.replace(policy.probe, start_probe=start)
        results[start] = rollout(loop, ExportedPolicyAdapter(policy, probe=probe), seed=5)
    without, with_start = results[0], results[2]
    assert without.steps_chosen[0] >= 0.9 * without.decisions
    assert sum(with_start.steps_chosen[1:]) >= 0.9 * with_start.decisions
    assert with_start.throughput_tok_s > 1.03 * without.throughput_tok_s


def test_the_start_probe_leaves_a_server_where_nothing_could_pay_off():
    """On ``blackwell_tp8`` at 64 clients a depth-1 step costs ~6x off and depth 7 ~7x:
    no depth would pay even at acceptance 0.9, so the start probe runs no step there and
    the stream serves as without it (the first candidate probed five steps: -5%)."""
    policy = ExportedPolicy.load("controller/data/default_policy.npz")
    profile = load_profile("blackwell_tp8")
    runs = []
    for start in (0, 2):
        simulator = Simulator(profile, SGLangSimulatedAcceptance(2.5), ClosedLoop(64, 32, 256),
                              SchedulerConfig(max_running_requests=64, reentry_warmup=True),
                              seed=5)
        loop = DecisionLoop(simulator, policy.feature_spec, feedback_lag=3, horizon_s=8.0,
                            cost_prior=profile)
        probe = dataclasses.replace(policy.probe, start_probe=start)
        runs.append(rollout(loop, ExportedPolicyAdapter(policy, probe=probe), seed=5))
    assert list(runs[0].steps_chosen) == list(runs[1].steps_chosen)
    assert runs[1].steps_chosen[0] >= 0.95 * runs[1].decisions > 90
    assert runs[0].throughput_tok_s == runs[1].throughput_tok_s


def test_specctl_serve_says_which_probe_and_guard_serve(tmp_path):
    """``specctl-serve probe.enabled=false guard.enabled=false``: the start-up line says
    the probe and the goodput guard are off."""
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1).save(path)
    lines = {}
    for flag in ("true", "false"):
        process = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", f"policy={path}",
             f"endpoint=ipc://{tmp_path}/s-{flag}.sock", f"probe.enabled={flag}",
             f"guard.enabled={flag}"],
            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            lines[flag] = next((line for line in process.stdout if "serving policy" in line), "")
        finally:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=30)
    assert "acceptance probe off" in lines["false"]
    assert "acceptance probe {'enabled': True" in lines["true"]
    assert "goodput guard off" in lines["false"]
    assert "goodput guard {'enabled': True" in lines["true"]


def test_specctl_eval_evaluates_a_copy_with_the_probe_changed(tmp_path):
    from omegaconf import OmegaConf

    from agents.evaluate import _with_rule_changes

    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1).save(path)
    unchanged = OmegaConf.create({"enabled": None, "share": None})
    assert _with_rule_changes(str(path), unchanged, tmp_path / "out") == str(path)
    copy = _with_rule_changes(str(path), OmegaConf.create({"enabled": False, "share": None}),
                       tmp_path / "out")
    assert ExportedPolicy.load(copy).probe == NO_PROBE
    with pytest.raises(ValueError, match=r"specctl-eval probe\.steps"):
        _with_rule_changes(str(path), OmegaConf.create({"steps": 0}), tmp_path / "out")

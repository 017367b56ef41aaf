"""The off probe (env/probe.py, ``ProbeSpec.off_*``): when it fires, that a confirmed
prediction is not probed again and a wrong one is, that a trusted profile is not probed,
that it is off by default (a policy file without it decides as before), that it travels
in the policy file, and that the simulator, the daemon and local mode apply it on the
same steps of the same telemetry."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controller.decider import StreamDecider
from controller.policy_file import ExportedPolicy, PolicyFileError
from controller.reload import PolicyHolder
from controller.server import ControllerServer, ServeOptions
from controller.wire import decode, encode_step
from env.features import FeatureBuilder
from env.guard import GuardSpec
from env.probe import (
    DEFAULT_PROBE,
    NOT_PROBING,
    PROBE_ACCEPTANCE,
    PROBE_OFF,
    ProbeSpec,
    ProbeTracker,
    apply_probe,
)
from env.rollout import DecisionLoop
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.schema import StepRecord
from env.traces.workloads import ClosedLoop
from tests.lockstep import decode_record, lockstep, probe_states, with_meta

BACKENDS = ("numpy", "compiled")
OFF_PROBE = ProbeSpec(off_share=0.2)


def step(i: int, steps: int, batch: int = 64, latency_s: float = 0.04) -> StepRecord:
    """A decode record of ``batch`` requests at ``steps``, each accepting one draft."""
    return decode_record(i, steps, batch, latency_s)


def speculating(n: int, start: int = 0, batch: int = 64) -> list[StepRecord]:
    return [step(start + i, 3, batch) for i in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_off_unmeasured_while_speculating_is_probed_once_the_budget_covers_it(backend):
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(None, profile, backend, probe=OFF_PROBE)
    flags = probe_states(builder, speculating(400))
    fired = [i for i, f in enumerate(flags) if f]
    assert fired and all(flags[i] == PROBE_OFF for i in fired)
    assert fired[:2] == [fired[0], fired[0] + 1]  # off_steps (2) records, consecutive
    # not at once: 20% of the speculative time must first cover two off steps
    off_s = builder.latency_predictions_s(64)[0]
    assert fired[0] >= OFF_PROBE.off_steps * off_s / (OFF_PROBE.off_share * 0.04) - 2
    # the default probe (and so every policy file without off_share) has no off probe
    plain = FeatureBuilder(None, profile, backend, probe=DEFAULT_PROBE)
    assert not any(probe_states(plain, speculating(400)))


def _probe_then_off(builder: FeatureBuilder, scale: float) -> int:
    """Speculate until the off probe fires, then run two off steps at ``scale`` times the
    off latency the features predicted; the next record index."""
    i = 0
    while builder.probing != PROBE_OFF:
        builder.update(step(i, 3))
        i += 1
        assert i < 1000, "the off probe never fired"
    predicted = float(builder.latency_predictions_s(64)[0])
    builder.update(step(i, 3))
    builder.update(step(i + 1, 3))  # the records decided before the probe (feedback lag)
    for j in (2, 3):
        builder.update(step(i + j, 0, latency_s=scale * predicted))
    return i + 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_confirmed_off_prediction_is_not_probed_again_a_wrong_one_is(backend):
    profile = load_profile("h200_llama31_8b")
    confirmed = FeatureBuilder(None, profile, backend, probe=OFF_PROBE)
    start = _probe_then_off(confirmed, 1.0)
    assert not any(probe_states(confirmed, speculating(3000, start)))  # long after: still known
    # another batch size (bucket 8-15) is unmeasured: probed there
    assert PROBE_OFF in probe_states(confirmed, speculating(400, start + 3000, batch=8))
    wrong = FeatureBuilder(None, profile, backend, probe=OFF_PROBE)
    start = _probe_then_off(wrong, 0.25)  # off 4x cheaper than predicted
    later = probe_states(wrong, speculating(3000, start))
    # measured: not probed while the two off steps count (2 * 0.995^n >= 0.5: n < 277)
    assert not any(later[:270]) and PROBE_OFF in later


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_profile_the_measurements_confirm_is_not_off_probed_unless_asked(backend):
    """``off_trust``: with a profile whose predictions the measured steps match (the mean
    log error within it) the off probe waits; a profile 30% off, or none, is probed."""
    profile = load_profile("h200_llama31_8b")
    trusting = ProbeSpec(off_share=0.2, off_trust=0.05)

    def profiled(n: int, scale: float) -> list[StepRecord]:
        latency = scale * profile.step_latency_s(64, 3, 50_000, 0)
        return [step(i, 3, latency_s=latency) for i in range(n)]

    assert not any(probe_states(FeatureBuilder(None, profile, backend, probe=trusting),
                         profiled(600, 1.0)))
    assert PROBE_OFF in probe_states(FeatureBuilder(None, profile, backend, probe=OFF_PROBE),
                              profiled(600, 1.0))
    assert PROBE_OFF in probe_states(FeatureBuilder(None, profile, backend, probe=trusting),
                              profiled(600, 1.3))
    assert PROBE_OFF in probe_states(FeatureBuilder(None, None, backend, probe=trusting),
                              profiled(600, 1.0))


def test_off_coverage_counts_the_bucket_and_half_its_neighbours_forgotten():
    tracker = ProbeTracker(OFF_PROBE)
    tracker.off_weights[6], tracker.off_stamps[6] = 2.0, 0  # batch 64-127
    tracker.off_weights[4], tracker.off_stamps[4] = 1.0, 0  # batch 16-31
    assert tracker.off_coverage(64, 0.5) == 2.0 and tracker.off_coverage(127, 0.5) == 2.0
    assert tracker.off_coverage(32, 0.5) == 1.5  # half of each neighbour
    assert tracker.off_coverage(8, 0.5) == 0.5 and tracker.off_coverage(4, 0.5) == 0.0
    tracker.decode_steps = 2
    assert tracker.off_coverage(64, 0.5) == 0.5  # 2 * 0.5^2


def test_both_backends_off_probe_on_the_same_records():
    profile = load_profile("h200_llama31_8b")
    stream = (speculating(300) + [step(300 + i, 0, latency_s=0.01) for i in range(3)]
              + speculating(3000, 303) + speculating(300, 3303, batch=8))
    traces = [probe_states(FeatureBuilder(None, profile, b, probe=OFF_PROBE), stream)
              for b in BACKENDS]
    assert traces[0] == traces[1] and traces[0].count(PROBE_OFF) >= 4


def test_the_off_probe_copies_with_the_features():
    profile = load_profile("h200_llama31_8b")
    stream = speculating(600)
    first = probe_states(FeatureBuilder(None, profile, probe=OFF_PROBE), stream)
    builder = FeatureBuilder(None, profile, probe=OFF_PROBE)
    second = []
    for r in stream:  # the daemon's copies must not share the budget or the coverage
        builder.update(r)
        copy = builder.copy()
        second.append(copy.probing)
        copy.update(step(10_000, 0, latency_s=0.01))
    assert first == second and PROBE_OFF in first


def test_off_probe_rows_turn_only_speculation_off():
    actions = np.array([0, 1, 2, 3, 5])
    index = np.array([[0, 3, 0, 4], [0, 1, 2, 0], [1, 2, 3, 4]])
    no_off = np.array([False, True, True, True, True])
    apply_probe(DEFAULT_PROBE, index, actions, [PROBE_OFF, NOT_PROBING, PROBE_OFF],
                [None, None, no_off])
    assert index.tolist() == [[0, 0, 0, 0], [0, 1, 2, 0], [1, 2, 3, 4]]
    index = np.array([[0, 3, 0, 4]])  # the acceptance probe as before (True counts as it)
    apply_probe(ProbeSpec(depth=2), index, actions, [True], [None])
    assert index.tolist() == [[2, 3, 2, 4]]
    apply_probe(ProbeSpec(depth=1), index, actions, [PROBE_ACCEPTANCE], [None])
    assert index.tolist() == [[2, 3, 2, 4]]


def test_off_probe_settings_are_checked_and_travel_in_the_policy_file(tmp_path):
    for name, bad in (("off_share", -0.1), ("off_share", 1.5), ("off_steps", 0),
                      ("off_samples", 0.0), ("off_confirm", -1.0), ("off_share", True),
                      ("off_trust", -0.1)):
        with pytest.raises(ValueError, match=rf"probe\.{name}"):
            ProbeSpec(**{name: bad})
    policy = ExportedPolicy.random(seed=1)
    assert policy.probe.off_share == 0.0
    changed = dataclasses.replace(policy, probe=ProbeSpec(off_share=0.1, off_steps=3,
                                                          off_trust=0.05))
    changed.save(tmp_path / "p.npz")
    loaded = ExportedPolicy.load(tmp_path / "p.npz")
    assert loaded.probe == ProbeSpec(off_share=0.1, off_steps=3, off_trust=0.05)
    # a file written before these fields (the policy shipped until the fourteenth
    # session) has no off probe
    before = ExportedPolicy.load("docs/results/h200/policy_ffcabc92.npz")
    assert before.probe.off_share == 0.0
    bad = with_meta(tmp_path / "p.npz", probe={**loaded.probe.to_dict(), "off_steps": 0})
    with pytest.raises(PolicyFileError, match=r"field 'probe': probe\.off_steps"):
        ExportedPolicy.loads(bad, "bad.npz")


def depth1_policy(probe: ProbeSpec) -> ExportedPolicy:
    """A policy that always chooses depth 1: only the off probe runs off."""
    policy = ExportedPolicy.random(seed=2, hidden=(8,), name="d1")
    policy.biases[-1][1] = 1e3
    return dataclasses.replace(policy, probe=probe, guard=GuardSpec(enabled=False))


def test_the_simulator_and_local_mode_off_probe_the_same_steps():
    """The env path (DecisionLoop + ExportedPolicyAdapter) and a StreamDecider fed the same
    released records decide the same steps, off probes included, over another server's
    profile (off never measured unless probed)."""
    truth, handed = load_profile("h200_llama31_8b"), load_profile("h100_llama31_8b")
    sim = Simulator(truth, SGLangSimulatedAcceptance(2.0), ClosedLoop(48, 256, 256),
                    SchedulerConfig(max_running_requests=48), seed=3)
    loop = DecisionLoop(sim, None, feedback_lag=3, horizon_s=4.0, cost_prior=handed)
    choices = lockstep(loop, depth1_policy(OFF_PROBE), handed)
    assert len(choices) > 200 and choices.count(0) >= OFF_PROBE.off_steps
    loop = DecisionLoop(sim, None, feedback_lag=3, horizon_s=4.0, cost_prior=handed)
    assert 0 not in lockstep(loop, depth1_policy(DEFAULT_PROBE), handed)


def test_the_daemon_off_probes_as_local_mode(tmp_path):
    path = tmp_path / "policy.npz"
    depth1_policy(OFF_PROBE).save(path)
    profile = load_profile("h200_llama31_8b")
    server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint="inproc://offprobe"),
                              cost_prior=profile)
    local = StreamDecider(ExportedPolicy.load(path), None, profile)
    off = 0
    try:
        for r in speculating(600):
            frame = encode_step(r)
            pending: dict = {}
            server.handle_frame((b"peer", ""), frame, pending)
            (_, remote), = server.decide(pending)
            assert local.decide(decode(frame)) == remote, f"step {r.step_index}"
            off += not any(remote.steps)
        counted = server.metrics.registry.get_sample_value("specctl_probing_decisions_total")
    finally:
        server.close()
    assert off >= OFF_PROBE.off_steps and counted == off

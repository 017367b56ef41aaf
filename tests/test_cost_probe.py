"""The cost probe (``ProbeSpec.cost_depth``): while a stream runs off, a depth whose cost
was not measured near the batch size is run for a few steps once a share of the off time
covers them, in either feature backend."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controller.decider import StreamDecider
from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from controller.server import ControllerServer, ServeOptions
from controller.wire import Hello, decode, encode_hello, pack_telemetry
from env.features import FeatureBuilder
from env.probe import NOT_PROBING, PROBE_COST, ProbeSpec, apply_probe
from env.rollout import DecisionLoop
from env.sim.cost_model import load_profile
from tests.lockstep import (
    copied_probe_states,
    decode_record,
    lockstep,
    off_policy,
    probe_states,
    sim,
)

BACKENDS = ("numpy", "compiled")
#: Acceptance measured (no acceptance probe for 10^6 steps), the cost probe at depth 3.
SPEC = ProbeSpec(cost_depth=3, cost_share=0.05, stale_after=10**6)


def _measured(n: int = 20, batch: int = 2) -> list:
    """Depth 1 at ``batch``: acceptance measured, depth 3's cost not."""
    return [decode_record(i, steps=1, batch=batch, latency_s=0.008) for i in range(n)]


def _off(n: int, start: int, batch: int = 2) -> list:
    return [decode_record(start + i, batch=batch, latency_s=0.005) for i in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unmeasured_depth_is_probed_once_the_off_time_covers_it(backend):
    builder = FeatureBuilder(None, None, backend, probe=SPEC)
    probe_states(builder, _measured())
    flags = probe_states(builder, _off(4000, 20))
    fired = [i for i, f in enumerate(flags) if f == PROBE_COST]
    assert fired and set(flags) <= {NOT_PROBING, PROBE_COST}
    assert fired[1] == fired[0] + 1  # SPEC.steps records per probe
    # not at once: cost_share of the off time first covers the probe's predicted extra cost
    assert fired[0] >= 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_depth_measured_near_the_batch_is_not_probed(backend):
    builder = FeatureBuilder(None, None, backend, probe=SPEC)
    deep = [decode_record(i, steps=3, batch=2, latency_s=0.01) for i in range(20)]
    probe_states(builder, deep)
    # measured at batch 2: a short off period there probes nothing (within ~140 steps the
    # coverage is forgotten below cost_samples at the latency forgetting of 0.995) ...
    assert not any(probe_states(builder, _off(100, 20)))
    # ... while the same off period at batch 64 (another bucket, never measured) probes
    builder = FeatureBuilder(None, None, backend, probe=SPEC)
    probe_states(builder, deep)
    assert PROBE_COST in probe_states(builder, _off(3000, 20, batch=64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stream_with_a_profile_is_not_probed_for_cost(backend):
    builder = FeatureBuilder(None, load_profile("h200_llama31_8b"), backend, probe=SPEC)
    probe_states(builder, _measured())
    assert PROBE_COST not in probe_states(builder, _off(4000, 20))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_profile_far_from_the_measurements_is_probed_for_cost_if_asked(backend):
    """``cost_untrusted``: with a profile the measurements sit 3x above (log ratio ~1.1),
    the cost probe runs; not with the setting at 0, nor where they sit near the profile."""
    profile = load_profile("h200_llama31_8b")
    untrusted = dataclasses.replace(SPEC, cost_untrusted=0.5)

    def far(records):  # the same steps, three times slower than measured
        return [dataclasses.replace(r, step_latency_s=3 * r.step_latency_s) for r in records]

    runs = {}
    for name, spec, scale in (("far", untrusted, far), ("off", SPEC, far),
                              ("near", untrusted, lambda records: records)):
        builder = FeatureBuilder(None, profile, backend, probe=spec)
        probe_states(builder, scale(_measured()))
        runs[name] = (probe_states(builder, scale(_off(4000, 20))),
                      builder.profile_log_error)
    assert runs["far"][1] > 0.5 and abs(runs["near"][1]) < 0.5
    assert PROBE_COST in runs["far"][0]
    assert PROBE_COST not in runs["off"][0] and PROBE_COST not in runs["near"][0]
    with pytest.raises(ValueError, match=r"probe\.cost_untrusted"):
        ProbeSpec(cost_untrusted=-1.0)
    assert "cost_untrusted" not in SPEC.to_dict()  # older files keep their bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_cost_depth_nothing_is_probed_for_cost(backend):
    builder = FeatureBuilder(None, None, backend, probe=ProbeSpec(stale_after=10**6))
    probe_states(builder, _measured())
    assert PROBE_COST not in probe_states(builder, _off(4000, 20))


def test_both_backends_probe_for_cost_on_the_same_records():
    stream = _measured() + _off(3000, 20) + _measured(5) + _off(3000, 3025, batch=40)
    traces = [probe_states(FeatureBuilder(None, None, b, probe=SPEC), stream)
              for b in BACKENDS]
    assert traces[0] == traces[1] and traces[0].count(PROBE_COST) >= 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_cost_probe_copies_with_the_features(backend):
    stream = _measured() + _off(2000, 20)
    first = probe_states(FeatureBuilder(None, None, backend, probe=SPEC), stream)
    second = copied_probe_states(FeatureBuilder(None, None, backend, probe=SPEC), stream,
                                 decode_record(10_000, batch=2))
    assert first == second and PROBE_COST in first


def test_cost_probe_rows_run_the_cost_depth():
    actions = np.array([0, 1, 3, 5])
    index = np.array([[0, 0, 1, 3]])  # rows left off, depth 1, depth 5
    apply_probe(SPEC, index, actions, [PROBE_COST], [None])
    assert index.tolist() == [[2, 2, 1, 3]]  # only the rows left off, at depth 3
    index = np.array([[0, 2]])
    apply_probe(SPEC, index, actions, [PROBE_COST], [np.array([True, True, False, True])])
    assert index.tolist() == [[3, 2]]  # depth 3 not allowed: the next one above


@pytest.mark.parametrize("field, value", [("cost_depth", -1), ("cost_share", 0.0),
                                          ("cost_samples", 0.0), ("cost_doubt", 0.5)])
def test_cost_probe_settings_are_checked(field, value):
    with pytest.raises(ValueError, match=f"probe.{field}"):
        ProbeSpec(**{field: value})


def _serve(builder: FeatureBuilder, n: int, start: int, latency: dict[int, float],
           batch: int = 2) -> list[int]:
    """``n`` decode steps where the stream runs off unless a probe is due (then the probe's
    depth, at ``latency[depth]``), as a server following the probe would; the states."""
    flags = []
    for i in range(n):
        depth = SPEC.cost_depth if builder.probing == PROBE_COST else 0
        builder.update(decode_record(start + i, steps=depth, batch=batch,
                                     latency_s=latency[depth]))
        flags.append(builder.probing)
    return flags


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_probe_that_confirms_the_prediction_is_the_last_there(backend):
    builder = FeatureBuilder(None, None, backend, probe=SPEC)
    probe_states(builder, _measured())
    # depth 3 costs what the features predict there: the first probe confirms it
    predicted = builder.latency_predictions_s(2)
    right = {0: 0.005, SPEC.cost_depth: float(predicted[SPEC.cost_depth])}
    flags = _serve(builder, 6000, 20, right)
    first = flags.count(PROBE_COST)
    assert 0 < first <= 2 * SPEC.steps
    # one that measures a cost far from the prediction probes again once forgotten
    builder = FeatureBuilder(None, None, backend, probe=SPEC)
    probe_states(builder, _measured())
    wrong = {0: 0.005, SPEC.cost_depth: 3.0 * right[SPEC.cost_depth]}
    assert _serve(builder, 6000, 20, wrong).count(PROBE_COST) > first


def test_the_simulator_local_mode_and_the_daemon_cost_probe_the_same_steps(tmp_path):
    """Without a profile, the env path (DecisionLoop + ExportedPolicyAdapter), a
    StreamDecider fed the same released records and the daemon decide the same steps, the
    cost probe's included (a policy that is off unless a probe runs)."""
    policy = off_policy(dataclasses.replace(SPEC, cost_share=0.2))
    loop = DecisionLoop(sim(), None, feedback_lag=3, horizon_s=4.0, cost_prior=None)
    choices = lockstep(loop, policy, None)
    assert len(choices) > 300 and choices.count(SPEC.cost_depth) >= SPEC.steps
    path = tmp_path / "policy.npz"
    policy.save(path)
    server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint="inproc://cost"))
    local = StreamDecider(ExportedPolicy.load(path), (0, 1, 3), None)
    probed = 0
    try:
        peer = (b"peer", "")
        server.handle_frame(peer, encode_hello(Hello("srv", 0, (0, 1, 3))), {})
        for i in range(1500):
            frame = pack_telemetry("srv", 0, i, i * 0.006, 8, 0, 8, 50_000, 500_000, 0,
                                   0, b"", 0, 0.006)
            pending: dict = {}
            server.handle_frame(peer, frame, pending)
            (_, remote), = server.decide(pending)
            assert local.decide(decode(frame)) == remote, f"step {i}"
            probed += SPEC.cost_depth in remote.steps
    finally:
        server.close()
    assert probed >= SPEC.steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_cost_probe_where_the_depth_could_not_pay_at_a_fraction_of_its_price(backend):
    """``cost_doubt``: with nothing accepted, depth 3 commits one token a step and would need
    to cost under ``cost_doubt`` x off's latency even at that fraction of its price: no
    probe, where the same stream accepting every draft is probed."""
    doubtful = dataclasses.replace(SPEC, cost_doubt=2.0)

    def probed(accepted: int, spec: ProbeSpec) -> bool:
        builder = FeatureBuilder(None, None, backend, probe=spec)
        probe_states(builder, [decode_record(i, steps=1, batch=2, latency_s=0.012,
                                             accepted=accepted) for i in range(100)])
        # depth 1 measured at 2.4x off: depth 3 priced dearer still, while remembered
        return PROBE_COST in probe_states(builder, _off(300, 100))

    assert probed(0, SPEC) and not probed(0, doubtful)
    assert probed(1, doubtful)

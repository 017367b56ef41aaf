"""The simulator's decisions against local mode's, step by step on one stream.

Shared by the tests of the decision-layer rules (the acceptance and off probes, the
goodput guard): both must decide the same steps in the simulator (``DecisionLoop`` +
``ExportedPolicyAdapter``) and in the plugin's local mode (``StreamDecider`` fed the
records the loop releases to its features). Also their synthetic decode records, the
probe state a builder reaches record by record, a policy file with its meta changed, a
policy that is off unless a probe runs, and the dense H200 server they run on.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Iterable

import numpy as np

from agents.policies import ExportedPolicyAdapter
from controller.decider import StreamDecider, steps_at
from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder
from env.probe import DEFAULT_PROBE, ProbeSpec
from env.rollout import DecisionLoop
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.schema import StepRecord
from env.traces.workloads import ClosedLoop


def decode_record(step: int, steps: int = 0, batch: int = 48, latency_s: float = 0.006,
                  accepted: int = 1) -> StepRecord:
    """A decode record of ``batch`` requests at ``steps`` (each accepting ``accepted``)."""
    drafts = np.full(batch if steps else 0, min(accepted, steps), dtype=np.int8)
    return StepRecord("srv", 0, step, step * latency_s, batch, 0, batch, 50_000, 500_000, 0,
                      steps, drafts, latency_s)


def with_meta(path, **changes) -> bytes:
    """The bytes of the policy file at ``path`` with ``changes`` set in its JSON meta
    (for ``ExportedPolicy.loads``: a rule's settings as a file could hold them)."""
    with np.load(path) as archive:
        arrays = {key: archive[key] for key in archive.files}
    meta = json.loads(arrays["meta"].tobytes().decode())
    meta.update(changes)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def probe_states(builder: FeatureBuilder, records: Iterable[StepRecord]) -> list[int]:
    """The builder's probe state (``FeatureBuilder.probing``) after each record."""
    out = []
    for r in records:
        builder.update(r)
        out.append(builder.probing)
    return out


def off_policy(probe: ProbeSpec = DEFAULT_PROBE) -> ExportedPolicy:
    """A policy that never speculates on its own (only a probe makes it)."""
    policy = ExportedPolicy.random(seed=2, hidden=(8,), name="off")
    policy.biases[-1][0] = 1e3
    return dataclasses.replace(policy, probe=probe)


def sim(concurrency: int = 48, seed: int = 3) -> Simulator:
    """The dense H200 server at acceptance 3.5, ``concurrency`` clients of 256/256 tokens."""
    profile = load_profile("h200_llama31_8b")
    return Simulator(profile, SGLangSimulatedAcceptance(3.5), ClosedLoop(concurrency, 256, 256),
                     SchedulerConfig(max_running_requests=48), seed=seed)


def copied_probe_states(builder: FeatureBuilder, records: Iterable[StepRecord],
                        poke: StepRecord) -> list[int]:
    """The probe state of a copy of the builder after each record, each copy then fed
    ``poke`` (as the daemon evaluates copies: they must not share the builder's budgets)."""
    out = []
    for r in records:
        builder.update(r)
        copy = builder.copy()
        out.append(copy.probing)
        copy.update(poke)
    return out


def lockstep(loop: DecisionLoop, policy: ExportedPolicy, profile, seed: int = 3,
             run: Callable[[int, int], int] = lambda compared, choice: choice) -> list[int]:
    """Run ``loop`` to its end with ``policy``, asserting at every step whose records
    reached local mode that both chose the same steps; the simulator's choices, in order.

    ``run(compared, choice)``: the steps the loop then runs (default: the choice), given
    how many steps were compared so far.
    """
    released = []
    feed = loop.features.update
    loop.features.update = lambda r: (released.append(r), feed(r))[1]
    adapter = ExportedPolicyAdapter(policy)
    loop.features.set_probe(adapter.probe)
    local = StreamDecider(policy, None, profile)
    obs = loop.reset(seed=seed)
    sent, compared, choices = 0, 0, []
    while obs is not None:
        choice = adapter.act(obs)
        if len(released) > sent:
            for record in released[sent:]:
                decision = local.decide(record)
            sent = len(released)
            assert steps_at(decision.batch_grid, decision.steps, obs.batch_size) == choice
            compared += 1
            choices.append(choice)
        obs, _ = loop.step(run(compared, choice))
    return choices

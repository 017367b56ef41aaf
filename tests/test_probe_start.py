"""``ProbeSpec.start_records``: where no cost profile is handed, a stream's first decisions
speculate (the acceptance probe, with no budget) instead of guessing off, both feature
backends; with a profile, or with the field at 0, the probe is as before.

Why (``docs/results/nopro24/README.md``): without a profile the shipped weights go off on
a stream's first steps, every request that decodes off keeps stale draft KV, and on a
server with a lasting re-entry loss the acceptance measured afterwards keeps the policy
off where speculation pays (``h100_llama31_8b``/fixed C=64, ``specctl-eval seed=2``).
"""

from __future__ import annotations

import dataclasses

import pytest

from agents.policies import ExportedPolicyAdapter
from env.features import FeatureBuilder
from env.probe import DEFAULT_PROBE, NOT_PROBING, PROBE_ACCEPTANCE, ProbeSpec
from env.rollout import DecisionLoop
from env.sim.cost_model import load_profile
from tests.lockstep import decode_record
from tests.test_probe import off_policy, sim

BACKENDS = ("numpy", "compiled")
START = dataclasses.replace(DEFAULT_PROBE, start_records=4)
PROFILE = load_profile("h200_llama31_8b")


def _builder(backend: str, profile, probe: ProbeSpec) -> FeatureBuilder:
    if backend == "compiled":
        pytest.importorskip("numba")
    return FeatureBuilder(None, profile, backend, probe=probe)


def _states(builder: FeatureBuilder, n: int) -> list[int]:
    """The probe state before any record, then after each of ``n`` off records."""
    out = [builder.probing]
    for i in range(n):
        builder.update(decode_record(i))
        out.append(builder.probing)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_a_profile_the_first_decisions_probe(backend):
    """Due before any record and until the fourth is folded, then not (the budget of four
    off records covers no probe); again after a reset (a new stream)."""
    builder = _builder(backend, None, START)
    expected = [PROBE_ACCEPTANCE] * 4 + [NOT_PROBING] * 5
    assert _states(builder, 8) == expected
    builder.reset()
    assert _states(builder, 8) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_a_profile_or_without_the_field_nothing_changes(backend):
    assert _states(_builder(backend, PROFILE, START), 8) == [NOT_PROBING] * 9
    assert _states(_builder(backend, None, DEFAULT_PROBE), 8) == [NOT_PROBING] * 9


def test_the_field_is_checked_and_defaults_to_none():
    assert DEFAULT_PROBE.start_records == 0
    with pytest.raises(ValueError, match=r"probe\.start_records"):
        ProbeSpec(start_records=-1)
    assert ProbeSpec.from_dict(START.to_dict()) == START


@pytest.mark.parametrize("profiled", [False, True])
def test_a_policy_that_never_speculates_runs_its_first_steps_at_the_probe_depth(profiled):
    """Closed loop (feedback lag 3): without a profile the decisions made before the fourth
    record arrives speculate at depth 1; with one, the policy's off stands."""
    profile = PROFILE if profiled else None
    policy = ExportedPolicyAdapter(off_policy(START))
    loop = DecisionLoop(sim(), policy.feature_spec(None), feedback_lag=3, horizon_s=2.0,
                        cost_prior=profile)
    loop.features.set_probe(policy.probe)
    obs = loop.reset(3)
    choices = []
    while obs is not None and len(choices) < 12:
        choices.append(policy.act(obs))
        obs, _ = loop.step(choices[-1])
    assert len(choices) == 12
    if profiled:
        assert choices == [0] * 12
    else:
        first = choices.index(0)
        assert first >= START.start_records and set(choices[:first]) == {1}
        assert set(choices[first:]) == {0}

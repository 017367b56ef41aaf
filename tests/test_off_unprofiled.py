"""``ProbeSpec.off_unprofiled``: the off probe's share in a stream without a cost profile,
as a fraction of ``off_share``. 1 (the default, and every policy file without the field)
probes as before; less probes later (0: never) without a profile, and nothing changes
with one; both feature backends probe on the same records."""

from __future__ import annotations

import dataclasses

import pytest

from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder
from env.probe import DEFAULT_PROBE, PROBE_OFF, ProbeSpec
from env.sim.cost_model import load_profile
from tests.lockstep import decode_record, probe_states

BACKENDS = ("numpy", "compiled")
OFF_PROBE = ProbeSpec(off_share=0.2)


def speculating(n: int, batch: int = 64) -> list:
    """Depth 3 at ``batch``, every draft of one accepted: off never measured there."""
    return [decode_record(i, 3, batch, 0.04) for i in range(n)]


def first_off_probe(spec: ProbeSpec, backend: str, profile=None, n: int = 3000) -> int | None:
    """The record after which the off probe is first due (None: never in ``n``)."""
    flags = probe_states(FeatureBuilder(None, profile, backend, probe=spec), speculating(n))
    return flags.index(PROBE_OFF) if PROBE_OFF in flags else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_a_profile_the_off_probe_waits_for_its_scaled_share(backend):
    full = first_off_probe(OFF_PROBE, backend)
    half = first_off_probe(dataclasses.replace(OFF_PROBE, off_unprofiled=0.5), backend)
    assert full is not None and half is not None
    assert half > 1.5 * full  # half the share: about twice the speculative time first
    assert first_off_probe(dataclasses.replace(OFF_PROBE, off_unprofiled=0.0), backend) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_a_profile_off_unprofiled_changes_nothing(backend):
    profile = load_profile("h200_llama31_8b")
    stream = speculating(3000)
    traces = [probe_states(FeatureBuilder(None, profile, backend, probe=spec), stream)
              for spec in (OFF_PROBE, dataclasses.replace(OFF_PROBE, off_unprofiled=0.0))]
    assert traces[0] == traces[1] and PROBE_OFF in traces[0]


def test_both_backends_probe_the_same_records_without_a_profile():
    spec = dataclasses.replace(OFF_PROBE, off_unprofiled=0.5)
    stream = speculating(2000) + speculating(2000, batch=8)
    traces = [probe_states(FeatureBuilder(None, None, b, probe=spec), stream)
              for b in BACKENDS]
    assert traces[0] == traces[1] and traces[0].count(PROBE_OFF) >= 2


def test_the_default_is_the_old_behaviour_and_the_field_travels_only_when_set():
    assert DEFAULT_PROBE.off_unprofiled == 1.0
    assert "off_unprofiled" not in DEFAULT_PROBE.to_dict()  # old files' bytes unchanged
    before = ExportedPolicy.load("docs/results/costprobe25/policy_c66f698d.npz")
    assert before.probe.off_unprofiled == 1.0  # a file from before the field reads 1
    spec = dataclasses.replace(OFF_PROBE, off_unprofiled=0.5)
    assert ProbeSpec.from_dict(spec.to_dict()) == spec
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match=r"probe\.off_unprofiled"):
            ProbeSpec(off_unprofiled=bad)

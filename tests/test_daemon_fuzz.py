"""Property: no frame crashes the daemon or changes another connection's decisions.

Hypothesis generates hostile frames (random bytes, nested values, every field of a
valid message replaced, telemetry with extreme but in-range values, HELLOs, names
of the victim's stream) and feeds them to the server's frame handling in-process,
interleaved with a victim connection's telemetry. The victim's every decision must
equal the policy on a clean :class:`FeatureBuilder` of its own records.

CI runs ``SPECCTL_FUZZ_EXAMPLES`` (default 100) examples of :data:`FRAMES` frames:
10,000 frames; ``benchmarks/fuzz_daemon.py`` runs it with more.
"""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from controller.server import ControllerServer, ServeOptions
from controller.wire import (
    MAX_BATCH,
    MAX_KV_TOKENS,
    MAX_STEP_LATENCY_S,
    MIN_STEP_LATENCY_S,
    WIRE_VERSION,
    encode_step,
)
from env.features import FeatureBuilder
from env.traces.schema import StepRecord

EXAMPLES = int(os.environ.get("SPECCTL_FUZZ_EXAMPLES", "100"))
FRAMES = 100  # hostile frames per example
VICTIM_EVERY = 10  # a victim step after every this many hostile frames

names = st.sampled_from(["victim", "h0", "h1"]) | st.text(max_size=8)
any_int = st.integers(-(2**63), 2**64 - 1)
extreme_floats = st.floats() | st.sampled_from([1e308, 5e-324, -0.0, MAX_STEP_LATENCY_S])
msgpack_values = st.recursive(
    st.none() | st.booleans() | any_int | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4), max_leaves=6,
)


@st.composite
def in_range_telemetry(draw) -> list:
    """Telemetry that passes decode, with values drawn to the edges of the physical ranges."""
    batch = draw(st.integers(0, MAX_BATCH) | st.sampled_from([0, 1, MAX_BATCH]))
    steps = draw(st.integers(0, 127) | st.sampled_from([0, 7]))
    count = min(batch, draw(st.integers(0, 16)))
    accepted = bytes(draw(st.lists(st.integers(0, steps), min_size=count, max_size=count))
                     if steps else [])
    capacity = draw(st.integers(0, MAX_KV_TOKENS) | st.just(MAX_KV_TOKENS))
    used = draw(st.integers(0, capacity or MAX_KV_TOKENS))
    latency = draw(st.just(0.0) | st.floats(MIN_STEP_LATENCY_S, MAX_STEP_LATENCY_S)
                   | st.sampled_from([MIN_STEP_LATENCY_S, MAX_STEP_LATENCY_S]))
    return [WIRE_VERSION, 2, draw(names), draw(st.integers(0, 3)), draw(st.integers(0, 2**62)),
            draw(st.floats(0, 1e10)), batch, draw(st.integers(0, 2**32)),
            draw(st.integers(0, 2**32)), used, capacity,
            draw(st.just(0) | st.integers(0, 2**32)), steps, accepted, sum(accepted),
            len(accepted), latency]


@st.composite
def hello(draw) -> list:
    return [WIRE_VERSION, 1, draw(names), draw(st.integers(0, 3)), 1,
            draw(st.lists(st.integers(0, 127), max_size=8)), "fuzz", 1]


@st.composite
def one_field_replaced(draw) -> list:
    message = draw(in_range_telemetry() | hello())
    message[draw(st.integers(0, len(message) - 1))] = draw(msgpack_values | extreme_floats)
    return message


frames = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 2000).map(lambda depth: b"\x91" * depth + b"\xc0"),
    in_range_telemetry().map(lambda m: msgpack.packb(m, use_bin_type=True)),
    hello().map(lambda m: msgpack.packb(m, use_bin_type=True)),
    one_field_replaced().map(lambda m: msgpack.packb(m, use_bin_type=True)),
)
peers = st.sampled_from([(b"\x00hostile", ""), (b"\x00other", ""), (b"\x00victim", "x")])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "policy.npz"
    ExportedPolicy.random(seed=7, name="fuzz").save(path)
    server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint="inproc://fuzz",
                                                                 new_streams_per_s=1e9))
    yield server
    server.close()


_victims = iter(range(10**9))


def _victim_record(step: int) -> StepRecord:
    rng = np.random.default_rng(step)
    batch = int(rng.integers(1, 64))
    steps = int(rng.integers(0, 8))
    accepted = rng.integers(0, steps + 1, size=batch) if steps else []
    return StepRecord("victim", 0, step, step * 0.01, batch, int(rng.integers(0, 9)), batch,
                      int(rng.integers(0, 50_000)), 100_000, 0, steps,
                      np.asarray(accepted, np.int8), float(rng.uniform(0.005, 0.05)))


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(peers, frames), min_size=FRAMES, max_size=FRAMES))
def test_no_frame_crashes_the_daemon_or_reaches_another_connection(server, hostile):
    policy = server.holder.policy
    grid = policy.feature_spec.batch_grid
    victim = (b"\x00victim-%d" % next(_victims), "")
    reference = FeatureBuilder(policy.feature_spec)
    for step, i in enumerate(range(0, FRAMES, VICTIM_EVERY), start=1):
        pending: dict = {}
        for peer, frame in hostile[i:i + VICTIM_EVERY]:
            server.handle_frame(peer, frame, pending)
        record = _victim_record(step)
        reference.update(record)
        server.handle_frame(victim, encode_step(record), pending)
        answers = {stream.key[0]: decision for stream, decision in server.decide(pending)}
        decision = answers[victim]
        lookup = dict(zip(decision.batch_grid, decision.steps, strict=True))
        sent = [lookup[max(k for k in lookup if k <= g)] for g in grid]
        assert sent == policy.act(reference.observation_grid()).tolist()
    registry = server.metrics.registry
    assert (registry.get_sample_value("specctl_internal_errors_total") or 0) == 0
    for reason in ("error", "nonfinite"):  # in-range values never break the estimators
        assert registry.get_sample_value("specctl_stream_resets_total", {"reason": reason}) \
            is None

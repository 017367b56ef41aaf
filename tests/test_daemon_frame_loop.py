"""Property: the daemon's per-connection frame loop (``_handle_frames``, the common
telemetry inlined) treats every frame as the full path does (``_handle_frame``: decode,
then the stream), frame for frame: the same streams, queues, counters and decisions.

Hypothesis draws polls of frames from a few connections: telemetry of a few streams whose
step indices advance, repeat or go back (a restarted server), HELLOs, frames of another
kind, refused and garbled frames, more streams than a connection may hold, and more frames
of one connection than a poll keeps. One server reads each poll through its socket
(``_drain``, as ``poll_once``); the other takes the same frames, connection by connection
in the order the first read them, through ``_handle_frame`` one at a time, shed as the
drain sheds. After every poll both must have the same streams with the same state and
answer with the same decisions.
"""

from __future__ import annotations

import dataclasses
import itertools

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from controller.server import ControllerServer, ServeOptions
from controller.wire import WIRE_VERSION, Hello, encode_hello, pack_telemetry
from env.traces.schema import StepRecord

CONNECTIONS = 3
_names = itertools.count()


def telemetry(server: str, step: int, batch: int, steps: int, prefill: int = 0,
              warmup: bool | None = None) -> bytes:
    """A TELEMETRY frame; ``warmup`` True makes it a depth-0 decode step (a warm-up)."""
    if warmup:
        steps = prefill = 0
    accepted = bytes([min(steps, i % 4) for i in range(batch)]) if steps and not prefill else b""
    return pack_telemetry(server, 0, step, step * 0.01, batch, 3, batch, 4000, 100_000,
                          prefill, 0 if prefill else steps, accepted, sum(accepted), 0.012,
                          warmup)


@st.composite
def frames(draw) -> list[tuple[int, bytes]]:
    """(connection, frame) pairs: one frame, or a run of one stream's next steps."""
    connection = draw(st.integers(0, CONNECTIONS - 1))
    server = draw(st.sampled_from(["a", "b", "c", "d", "e", "f"]))  # > max_streams_per_peer
    kind = draw(st.sampled_from(["telemetry"] * 8 + ["run", "hello", "other", "refused",
                                                     "garbage"]))
    if kind == "telemetry":
        return [(connection, telemetry(server, draw(st.integers(1, 12)),
                                       draw(st.integers(1, 64)), draw(st.integers(0, 4)),
                                       draw(st.sampled_from([0, 0, 0, 512])),
                                       draw(st.sampled_from([None, False, True]))))]
    if kind == "run":  # more records of one stream than its backlog holds
        first = draw(st.integers(1, 40))
        return [(connection, telemetry(server, step, 8, 2))
                for step in range(first, first + draw(st.integers(2, 7)))]
    if kind == "hello":
        return [(connection, encode_hello(Hello(server, 0, draw(st.sampled_from(
            [(0, 1, 2, 3), (0, 2, 4, 6, 8)])))))]
    if kind == "other":  # a DECISION: a controller -> server kind
        return [(connection, msgpack.packb([WIRE_VERSION, 3, 1, 2, "p", 0, [], []]))]
    if kind == "refused":  # telemetry the fast decoder passes to decode: batch out of range
        return [(connection, telemetry(server, 5, 10**6, 2))]
    return [(connection, draw(st.binary(max_size=24)))]


#: A poll's frames, in the order sent.
poll = st.lists(frames(), max_size=12).map(lambda runs: [f for run in runs for f in run])


def fields(record: StepRecord) -> tuple:
    return (*(getattr(record, f.name) for f in dataclasses.fields(record)
              if f.name != "accepted_drafts"), record.accepted_drafts.tobytes())


def state(server: ControllerServer) -> list:
    return [(s.key, s.last_step, s.batch_size, s.candidates, s.seq, len(s.backlog),
             None if s.allowed is None else s.allowed.tolist()) for s in server.streams]


def metrics(server: ControllerServer) -> dict:
    return {sample.name + str(sorted(sample.labels.items())): sample.value
            for family in server.metrics.registry.collect() for sample in family.samples
            if "latency" not in sample.name and "created" not in sample.name}


def server(path, **options) -> ControllerServer:
    return ControllerServer(PolicyHolder(path), ServeOptions(
        endpoint=f"inproc://loop{next(_names)}", max_streams_per_peer=2,
        new_streams_per_s=1e9, max_records_per_poll=4, max_drain_s=10.0, **options))


def assert_same(a: ControllerServer, b: ControllerServer, pending_a: dict,
                pending_b: dict, clocks: bool = True) -> None:
    assert list(pending_a) == list(pending_b)
    assert state(a) == state(b)
    if clocks:  # when each frame's latency clock started
        assert [s.received for s in a.streams] == [s.received for s in b.streams]
    for s, t in zip(a.streams, b.streams, strict=True):
        assert [fields(r) for r in s.backlog] == [fields(r) for r in t.backlog]
    mine, theirs = a.decide(pending_a), b.decide(pending_b)
    assert [(s.key, d) for s, d in mine] == [(s.key, d) for s, d in theirs]
    assert metrics(a) == metrics(b)
    assert a.counters == b.counters


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(polls=st.lists(poll, min_size=1, max_size=6))
def test_the_frame_loop_handles_each_frame_as_the_full_path(tmp_path_factory, polls):
    path = tmp_path_factory.mktemp("loop") / "policy.npz"
    ExportedPolicy.random(seed=2, hidden=(16,)).save(path)
    looped, single = server(path), server(path)
    try:
        for received, poll in enumerate(polls, 1):
            by_peer: dict = {}
            for connection, data in poll:
                by_peer.setdefault((f"peer{connection}".encode(), ""), []).append(data)
            pending_looped: dict = {}
            pending_single: dict = {}
            for peer, frames in by_peer.items():
                looped._handle_frames(peer, frames, pending_looped, float(received))
                for data in frames:
                    single._handle_frame(peer, data, pending_single, float(received))
            assert_same(looped, single, pending_looped, pending_single)
    finally:
        looped.close()
        single.close()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(polls=st.lists(poll, min_size=1, max_size=5))
def test_a_drained_poll_is_its_hellos_then_its_latest_frames_each_in_full(
        tmp_path_factory, polls):
    """Through the socket (one connection: its frames arrive in order): the HELLOs, then
    the latest ``max_records_per_poll`` other frames, the older ones counted as shed."""
    path = tmp_path_factory.mktemp("drain") / "policy.npz"
    ExportedPolicy.random(seed=2, hidden=(16,)).save(path)
    drained, single = server(path), server(path)
    dealer = drained._context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"peer")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(drained.endpoint)
    keep = drained.options.max_records_per_poll
    try:
        for poll in polls:
            frames = [data for _, data in poll]
            for data in frames:
                dealer.send(data)
            pending_drained = drained._drain() if frames else {}
            pending_single: dict = {}
            peer = (b"peer", "")
            hellos = [f for f in frames if f[:3] in HELLO_HEADERS]
            others = [f for f in frames if f[:3] not in HELLO_HEADERS]
            for data in hellos + others[-keep:]:
                single._handle_frame(peer, data, pending_single, 0.0)
            if len(others) > keep:
                single.metrics.frames_shed.inc(len(others) - keep)
            assert_same(drained, single, pending_drained, pending_single, clocks=False)
    finally:
        dealer.close()
        drained.close()
        single.close()


HELLO_HEADERS = (bytes([0x98, WIRE_VERSION, 1]), bytes([0x99, WIRE_VERSION, 1]))


def test_the_frame_loop_sees_a_restart_and_a_new_stream_as_the_full_path(tmp_path):
    """The two cases the loop hands on (an unknown stream, a step index that goes back)
    and the one it keeps (the next step), against the full path, by hand."""
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=2, hidden=(16,)).save(path)
    looped, single = server(path), server(path)
    try:
        peer = (b"p", "")
        steps = [3, 4, 5, 2, 3, 9]  # the fourth restarts the stream
        for step in steps:
            pending_looped: dict = {}
            pending_single: dict = {}
            data = telemetry("s", step, 16, 2)
            looped._handle_frames(peer, [data], pending_looped, 0.0)
            single._handle_frame(peer, data, pending_single, 0.0)
            assert list(pending_looped) == [(peer, "s", 0)]
            assert_same(looped, single, pending_looped, pending_single)
        assert looped.counters["stream_restarts"] == 1
    finally:
        looped.close()
        single.close()


def test_telemetry_with_the_warmup_flag_takes_the_loops_fast_path(tmp_path, monkeypatch):
    """An 18-item TELEMETRY (the flag known) of a known stream is folded in the loop, as
    a 17-item one is: not handed to the full path."""
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=2, hidden=(16,)).save(path)
    looped = server(path)
    try:
        peer = (b"p", "")
        looped._handle_frames(peer, [telemetry("s", 1, 16, 2)], {}, 0.0)
        monkeypatch.setattr(looped, "_handle_frame", None)  # a call would raise
        pending: dict = {}
        frames = [telemetry("s", 2, 16, 0, warmup=False), telemetry("s", 3, 16, 0, warmup=True),
                  telemetry("s", 4, 16, 2)]
        looped._handle_frames(peer, frames, pending, 0.0)
        stream = pending[(peer, "s", 0)]
        assert [r.warmup for r in stream.backlog][-3:] == [False, True, None]
    finally:
        looped.close()

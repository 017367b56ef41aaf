"""Issue 10 (daemon and wire): each reproduction, against the server's frame handling
in-process (``handle_frame`` + ``decide``) and, where the transport matters, over sockets."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
import zmq.auth
from omegaconf import OmegaConf

from controller.cli import serve
from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from controller.security import (
    CurveConfig,
    UnsafeEndpointError,
    load_curve_keys,
    peer_uid,
)
from controller.server import ControllerServer, ServeOptions
from controller.wire import (
    DECISION_LAG,
    Hello,
    decode,
    encode_hello,
    encode_step,
    pack_telemetry,
)
from env.features import FeatureBuilder
from env.traces.schema import StepRecord
from sglang_hooks.testing import socket_dir

REPO = Path(__file__).resolve().parents[1]
_SOCKETS = socket_dir()  # removed when the test process exits
_names = iter(range(10**6))
VICTIM = (b"\x00victim", "")
HOSTILE = (b"\x00hostile", "")


def ipc() -> str:
    return f"ipc://{_SOCKETS}/{next(_names)}.sock"


def record(step: int, server: str = "s", rank: int = 0, batch: int = 8, steps: int = 3,
           latency: float = 0.012) -> StepRecord:
    rng = np.random.default_rng(step)
    accepted = rng.integers(0, steps + 1, size=batch) if steps else []
    return StepRecord(server, rank, step, step * 0.01, batch, 2, batch, 5000, 100_000, 0, steps,
                      np.asarray(accepted, np.int8), latency)


@pytest.fixture
def policy_path(tmp_path) -> Path:
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1, name="p").save(path)
    return path


@pytest.fixture
def server(policy_path):
    server = ControllerServer(PolicyHolder(policy_path),
                              ServeOptions(endpoint=f"inproc://h{next(_names)}"))
    yield server
    server.close()


def feed(server: ControllerServer, peer, frames: list[bytes]) -> dict:
    """Hand frames to the server as if drained from ``peer``; returns the decisions by server."""
    pending: dict = {}
    for frame in frames:
        server.handle_frame(peer, frame, pending)
    return {stream.key: decision for stream, decision in server.decide(pending)}


def table(decision) -> list[int]:
    """The steps of a (compressed) decision expanded over the policy's grid."""
    return list(decision.steps)


def expected(policy: ExportedPolicy, records: list[StepRecord]):
    builder = FeatureBuilder(policy.feature_spec)
    builder.update_many(records)
    return policy.act(builder.observation_grid()).tolist()


def expand(decision, grid) -> list[int]:
    lookup = dict(zip(decision.batch_grid, decision.steps, strict=True))
    return [lookup[max(k for k in lookup if k <= g)] for g in grid]


def errors(server, kind: str) -> float:
    return server.metrics.registry.get_sample_value("specctl_wire_errors_total",
                                                    {"kind": kind}) or 0.0


# -- 1-3: frames that killed or poisoned ----------------------------------------------------


def test_a_deeply_nested_frame_is_counted_and_serving_goes_on(server):
    decisions = feed(server, VICTIM, [b"\x91" * 1010 + b"\xc0", encode_step(record(1))])
    assert errors(server, "garbage") == 1 and len(decisions) == 1


def test_an_absurd_batch_is_rejected_and_the_other_streams_answered(server):
    frame = pack_telemetry("s", 0, 1, 0.5, 10**10, 0, 1, 10, 100, 0, 0, b"", 0, 0.01)
    decisions = feed(server, HOSTILE, [frame])
    assert decisions == {} and errors(server, "range") == 1
    assert server.metrics.registry.get_sample_value(
        "specctl_wire_range_errors_total", {"field": "batch_size"}) == 1
    assert len(feed(server, VICTIM, [encode_step(record(1))])) == 1


@pytest.mark.parametrize("latency", [1e308, 5e-324])
def test_one_absurd_latency_does_not_poison_the_stream(server, latency):
    good = [record(step) for step in range(1, 40)]
    feed(server, VICTIM, [encode_step(r) for r in good[:10]])
    feed(server, VICTIM, [encode_step(record(10, latency=latency))])
    for i, rec in enumerate(good[10:], start=10):
        (decision,) = feed(server, VICTIM, [encode_step(rec)]).values()
        grid = server.holder.policy.feature_spec.batch_grid
        assert expand(decision, grid) == expected(server.holder.policy, good[:i + 1])


def _make_singular(builder: FeatureBuilder) -> None:
    """Turn the builder's regression singular: its next solve raises LinAlgError (the
    numpy builder solves when the grid is computed, the compiled one here)."""
    singular = -builder.spec.latency_ridge * np.eye(7)
    if builder.backend == "numpy":
        builder._pending.clear()  # the record's regressors, folded when next read
        builder._moments[:7, :7] = singular
    else:
        start = builder._offsets[3]
        builder._state[start:start + 64].reshape(8, 8)[:7, :7] = singular
        builder._theta = None  # solve again


def _poison(builder: FeatureBuilder) -> None:
    """An estimate turns NaN."""
    if builder.backend == "numpy":
        builder._prior_log_error = float("nan")
    else:
        from env.features_compiled import _PRIOR_LOG_ERROR

        builder._state[_PRIOR_LOG_ERROR] = float("nan")


@pytest.mark.parametrize("backend", ["numpy", "compiled"])
def test_a_stream_whose_features_fail_is_reset_alone(policy_path, monkeypatch, backend):
    """Defence in depth behind the range checks: an estimator error or a non-finite
    feature resets that stream (fallback reply), and every other stream is answered."""
    if backend == "compiled":
        pytest.importorskip("numba")
    monkeypatch.setenv("SPECCTL_FEATURES", backend)
    server = ControllerServer(PolicyHolder(policy_path),
                              ServeOptions(endpoint=f"inproc://h{next(_names)}"))
    try:
        _features_fail(server, monkeypatch)
    finally:
        server.close()


def _features_fail(server: ControllerServer, monkeypatch) -> None:
    feed(server, VICTIM, [encode_step(record(1))])
    feed(server, HOSTILE, [encode_step(record(1, server="x"))])
    streams = {s.key[0]: s for s in server.streams}
    hostile = streams[HOSTILE].builder
    fold = hostile.update

    def singular(record):  # the regression's system turns singular: solving raises
        fold(record)
        _make_singular(hostile)

    monkeypatch.setattr(hostile, "update", singular)
    pending: dict = {}
    server.handle_frame(VICTIM, encode_step(record(2)), pending)
    server.handle_frame(HOSTILE, encode_step(record(2, server="x")), pending)
    answers = {s.key[0]: d for s, d in server.decide(pending)}
    assert answers[HOSTILE].is_fallback and not answers[VICTIM].is_fallback
    assert server.metrics.registry.get_sample_value(
        "specctl_stream_resets_total", {"reason": "error"}) == 1

    def poisoned(record):  # an estimate turns NaN: the observation is not finite
        fold(record)
        _poison(hostile)

    monkeypatch.setattr(hostile, "update", poisoned)
    pending = {}
    server.handle_frame(VICTIM, encode_step(record(3)), pending)
    server.handle_frame(HOSTILE, encode_step(record(3, server="x")), pending)
    answers = {s.key[0]: d for s, d in server.decide(pending)}
    assert answers[HOSTILE].is_fallback and not answers[VICTIM].is_fallback
    assert server.metrics.registry.get_sample_value(
        "specctl_stream_resets_total", {"reason": "nonfinite"}) == 1


def test_a_failure_while_folding_records_resets_that_stream_only(server, monkeypatch):
    def broken(record):
        raise RuntimeError("bug")

    feed(server, HOSTILE, [encode_step(record(1))])
    (stream,) = server.streams
    monkeypatch.setattr(stream.builder, "update", broken)
    pending: dict = {}
    server.handle_frame(HOSTILE, encode_step(record(2)), pending)
    server.handle_frame(VICTIM, encode_step(record(1)), pending)
    answers = {s.key[0]: d for s, d in server.decide(pending)}
    assert answers[HOSTILE].is_fallback and not answers[VICTIM].is_fallback
    assert server.metrics.registry.get_sample_value(
        "specctl_stream_resets_total", {"reason": "error"}) == 1


def test_a_failure_while_handling_a_frame_is_counted_not_raised(server, monkeypatch):
    def broken(candidates):
        raise RuntimeError("bug")

    monkeypatch.setattr(server, "_allowed", broken)
    assert feed(server, HOSTILE, [encode_hello(Hello("s", 0, (1, 2)))]) == {}
    assert server.metrics.registry.get_sample_value("specctl_internal_errors_total") == 1
    monkeypatch.undo()
    assert len(feed(server, VICTIM, [encode_step(record(1))])) == 1


# -- 4: streams belong to their connection --------------------------------------------------


def test_another_connection_cannot_touch_a_stream_by_naming_it(server):
    policy = server.holder.policy
    grid = policy.feature_spec.batch_grid
    good = [record(step, server="victim") for step in range(1, 30)]
    feed(server, VICTIM, [encode_hello(Hello("victim", 0, tuple(range(8))))])
    for i, rec in enumerate(good):
        # Same (server, rank) from another connection: an empty HELLO, a restart
        # (step 1 again) and telemetry that would shift the estimates.
        feed(server, HOSTILE, [encode_hello(Hello("victim", 0, ())),
                               encode_step(record(1, server="victim", batch=300, steps=7)),
                               encode_step(record(10**6 + i, server="victim", latency=30.0))])
        (decision,) = feed(server, VICTIM, [encode_step(rec)]).values()
        assert not decision.is_fallback
        assert expand(decision, grid) == expected(policy, good[:i + 1])
    assert len(server.streams) == 2  # the victim's, and the hostile's own "victim"


def test_spoofing_over_real_sockets(policy_path):
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=ipc()))
    context = zmq.Context()
    victim, hostile = (context.socket(zmq.DEALER) for _ in range(2))
    try:
        for sock in (victim, hostile):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.endpoint)
        victim.send(encode_hello(Hello("v", 0, tuple(range(8)))))
        answered = 0
        for step in range(1, 21):
            hostile.send(encode_hello(Hello("v", 0, ())))
            victim.send(encode_step(record(step, server="v")))
            sent = 0
            while sent < 1 or not victim.poll(0):
                sent += server.poll_once(20)
                if victim.poll(200):
                    break
            decision = decode(victim.recv())
            answered += not decision.is_fallback
        assert answered == 20
    finally:
        victim.close()
        hostile.close()
        context.term()
        server.close()


# -- 5: churn -------------------------------------------------------------------------------


def test_inventing_names_churns_only_the_inventors_own_streams(policy_path):
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://c{next(_names)}", max_streams=64, max_streams_per_peer=8,
        new_streams_per_s=1e9))
    try:
        for step in range(1, 201):
            frames = [encode_step(record(step, server=f"junk{step}-{k}")) for k in range(20)]
            feed(server, HOSTILE, frames)
            assert len(feed(server, VICTIM, [encode_step(record(step))])) == 1
            assert server.streams.get((VICTIM, "s", 0)).last_step == step  # never evicted
        assert len(server.streams) == 1 + 8
        assert server.metrics.registry.get_sample_value("specctl_stream_evictions_total") > 3000
    finally:
        server.close()


def test_many_connections_fill_the_table_but_active_streams_stay(policy_path):
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://c{next(_names)}", max_streams=64))
    try:
        for step in range(1, 101):
            for k in range(30):  # 3,000 connections, one name each
                feed(server, (b"\x00p%d-%d" % (step, k), ""), [encode_step(record(1))])
            assert len(feed(server, VICTIM, [encode_step(record(step))])) == 1
            assert len(server.streams) <= 64
        assert server.streams.get((VICTIM, "s", 0)).last_step == 100
    finally:
        server.close()


def test_a_connection_opening_streams_too_fast_is_refused(policy_path):
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://c{next(_names)}", max_streams_per_peer=4, new_streams_per_s=1e-9))
    try:
        feed(server, HOSTILE, [encode_step(record(1, server=f"n{k}")) for k in range(50)])
        assert server.metrics.registry.get_sample_value("specctl_streams_refused_total") == 46
        assert len(feed(server, VICTIM, [encode_step(record(1))])) == 1
    finally:
        server.close()


# -- 6: who may connect to an ipc endpoint --------------------------------------------------


def test_peer_uid_is_read_from_the_zap_address():
    assert peer_uid("localhost:1000:100:4242") == 1000
    assert peer_uid("/tmp/x.sock:0:0:1") == 0
    assert peer_uid("127.0.0.1") is None and peer_uid("") is None


def _connect_as(uid: int, endpoint: str) -> bool:
    """In a forked child running as ``uid``: send telemetry, True if a decision came back.

    Forked rather than a new interpreter: that user may not be able to read this one's files.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a fresh context (the parent's must not be touched after fork)
        answered = b"0"
        try:
            os.setgid(uid)
            os.setuid(uid)
            context = zmq.Context()
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            for step in range(1, 30):
                if sock.poll(0, zmq.POLLOUT):
                    sock.send(encode_step(record(step)), zmq.NOBLOCK)
                if sock.poll(50):
                    answered = b"1"
                    break
        finally:
            os.write(write, answered)
            os._exit(0)
    os.close(write)
    return pid, read


def _served(server, endpoint: str, uid: int) -> bool:
    pid, read = _connect_as(uid, endpoint)
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        server.poll_once(10)
    with os.fdopen(read, "rb") as pipe:
        return pipe.read() == b"1"


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another uid needs root")
@pytest.mark.parametrize("abstract", [True, False])
def test_an_ipc_endpoint_serves_only_our_own_user(policy_path, abstract):
    """Issue 10 #6: uid 65534 was served on ipc://@name (no file permissions there)."""
    if abstract:
        endpoint = f"ipc://@specctl-test-{os.getpid()}-{next(_names)}"
    else:  # a path with its permissions out of the way: the uid check alone refuses
        # In /tmp itself: _SOCKETS (mode 0700) would refuse the other user by its
        # permissions, not the uid check under test. Removed below.
        directory = tempfile.mkdtemp(prefix="sh-")
        os.chmod(directory, 0o777)
        endpoint = f"ipc://{directory}/open.sock"
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=endpoint))
    try:
        if not abstract:
            os.chmod(endpoint[len("ipc://"):], 0o777)
        assert not _served(server, endpoint, 65534)
        assert server._auth.refused >= 1
        assert _served(server, endpoint, os.getuid())
    finally:
        server.close()
        if not abstract:
            shutil.rmtree(directory, ignore_errors=True)


# -- 8: start-up errors are clear, not tracebacks -------------------------------------------


def test_a_second_daemon_on_the_same_ipc_path_is_refused(server, policy_path):
    endpoint = ipc()
    first = ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=endpoint))
    try:
        with pytest.raises(UnsafeEndpointError, match="another process"):
            ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=endpoint))
    finally:
        first.close()
    path = Path(endpoint[len("ipc://"):])
    path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX) as stale:  # a file left by a crashed daemon: fine
        stale.bind(str(path))
    assert path.exists()
    ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=endpoint)).close()


def test_a_second_daemon_on_the_same_abstract_name_is_refused(policy_path):
    endpoint = f"ipc://@specctl-dup-{os.getpid()}"
    first = ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=endpoint))
    try:
        with pytest.raises(UnsafeEndpointError, match="already in use"):
            ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=endpoint))
    finally:
        first.close()


def test_ipv6_loopback_is_served(policy_path):
    server = ControllerServer(PolicyHolder(policy_path),
                              ServeOptions(endpoint="tcp://[::1]:0"))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.connect(server.endpoint)
        sock.send(encode_step(record(1)))
        for _ in range(100):
            if server.poll_once(20):
                break
        assert sock.poll(2000) and not decode(sock.recv()).is_fallback
    finally:
        sock.close()
        server.close()


def _cfg(policy_path, **changes):
    cfg = OmegaConf.load(REPO / "configs" / "serve.yaml")
    cfg.policy, cfg.endpoint, cfg.profile = str(policy_path), ipc(), None
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def test_a_metrics_port_in_use_is_a_clear_error_and_binds_nothing(policy_path, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = _cfg(policy_path, metrics_port=taken.getsockname()[1])
        with caplog.at_level(logging.ERROR):
            assert serve(cfg) == 2
    assert "cannot serve metrics" in caplog.text
    assert not Path(cfg.endpoint[len("ipc://"):]).exists()


def test_key_files_are_checked_with_clear_errors(tmp_path, caplog):
    _, secret = zmq.auth.create_certificates(tmp_path, "server")
    with pytest.raises(UnsafeEndpointError, match="no such file"):
        load_curve_keys(CurveConfig(str(tmp_path / "missing.key_secret")))
    with pytest.raises(UnsafeEndpointError, match="no such directory"):
        load_curve_keys(CurveConfig(secret, str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsafeEndpointError, match="serve nobody"):
        load_curve_keys(CurveConfig(secret, str(tmp_path / "empty")))
    os.chmod(secret, 0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_curve_keys(CurveConfig(secret))
    assert "mode" not in caplog.text
    os.chmod(secret, 0o666)
    with caplog.at_level(logging.WARNING):
        load_curve_keys(CurveConfig(secret))
    assert "mode 0666" in caplog.text


def test_serve_reports_a_missing_key_file_without_a_traceback(policy_path, tmp_path, caplog):
    cfg = _cfg(policy_path, endpoint="tcp://127.0.0.1:0")
    cfg.curve.secret_key_file = str(tmp_path / "missing")
    with caplog.at_level(logging.ERROR):
        assert serve(cfg) == 2
    assert "no such file" in caplog.text and "Traceback" not in caplog.text


def test_the_transport_cap_is_set_on_the_daemon_socket(server):
    assert server._sock.getsockopt(zmq.MAXMSGSIZE) == 1 << 20


def test_wire_kinds_are_counted_by_field(server):
    frame = msgpack.packb([1, 2, "s", 0, 1, -0.5, 1, 0, 1, 0, 0, 0, 0, b"", 0, 0, 0.01],
                          use_bin_type=True)
    feed(server, HOSTILE, [frame])
    assert server.metrics.registry.get_sample_value(
        "specctl_wire_range_errors_total", {"field": "time_s"}) == 1


def test_a_flooding_connection_is_shed_unread_and_answered_from_its_latest(policy_path):
    server = ControllerServer(PolicyHolder(policy_path),
                              ServeOptions(endpoint=ipc(), max_drain_s=10.0))
    context = zmq.Context()
    flood, victim = (context.socket(zmq.DEALER) for _ in range(2))
    try:
        for sock in (flood, victim):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.endpoint)
        for step in range(1, 201):
            flood.send(encode_step(record(step, server="f")))
        victim.send(encode_step(record(1)))
        deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
        while not victim.poll(0) and time.monotonic() < deadline:
            server.poll_once(20)
        assert victim.poll(2000) and not decode(victim.recv()).is_fallback
        for _ in range(10):  # whatever of the flood is still on its way
            server.poll_once(20)
        latest = 0
        while flood.poll(200):
            latest = decode(flood.recv()).apply_from_step - DECISION_LAG
        assert latest == 200
        assert server.metrics.registry.get_sample_value("specctl_frames_shed_total") > 0
        # each poll handled at most max_records_per_poll of the flood's frames
        assert server.metrics.registry.get_sample_value("specctl_telemetry_records_total") \
            < 200
    finally:
        flood.close()
        victim.close()
        context.term()
        server.close()


def test_sweeping_many_streams_gives_memory_back(policy_path, monkeypatch):
    import controller.server as server_module

    trims = []
    monkeypatch.setattr(server_module, "trim_heap", lambda: trims.append(1) or True)
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://t{next(_names)}", stream_idle_s=0.0))
    try:
        for k in range(300):
            feed(server, (b"\x00c%d" % k, ""), [encode_step(record(1))])
        server._sweep(time.monotonic() + 1.0)
        assert len(server.streams) == 0 and trims == [1]
        server._sweep(time.monotonic() + 1.0)
        assert trims == [1]  # nothing new freed: no second trim
    finally:
        server.close()


def test_with_curve_streams_are_bound_to_the_client_key(tmp_path, policy_path):
    """With CURVE (even without an allow-list) every message carries the client's key."""
    _, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    public, _ = zmq.auth.load_certificate(server_secret)
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint="tcp://127.0.0.1:0", curve=CurveConfig(server_secret)))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    client_public, client_secret = zmq.curve_keypair()
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey, sock.curve_publickey = public, client_public
        sock.curve_secretkey = client_secret
        sock.connect(server.endpoint)
        sock.send(encode_step(record(1)))
        for _ in range(100):
            if server.poll_once(20):
                break
        assert sock.poll(2000) and not decode(sock.recv()).is_fallback
        (stream,) = server.streams
        assert stream.key[0][1] == client_public.decode()
    finally:
        sock.close()
        server.close()


def test_after_a_slow_round_fewer_records_are_folded(policy_path):
    # inproc:// in the server's own context: each burst is queued whole before the poll
    # (over ipc:// it could trickle in over several polls on a loaded machine).
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://slow{next(_names)}", max_drain_s=10.0, overload_busy_s=0.0,
        overload_records_per_poll=1))
    sock = server._context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        for burst in range(2):
            for step in range(1, 51):
                sock.send(encode_step(record(burst * 100 + step)))
            assert server.poll_once(20) >= 1
            assert sock.poll(0)
            sock.recv()
        records = server.metrics.registry.get_sample_value("specctl_telemetry_records_total")
        # The first round is not known slow: the burst's latest 16 (max_records_per_poll)
        # are kept; the round after a slow one keeps 1. Without the overload rule: 32.
        assert records == 16 + 1
    finally:
        sock.close()
        server.close()


class _CountingSocket:
    """The daemon's socket, counting the reads that found it empty (zmq.Again)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.empty_reads = 0

    def recv(self, *args, **kwargs):
        try:
            return self.sock.recv(*args, **kwargs)
        except zmq.Again:
            self.empty_reads += 1
            raise

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_a_poll_reads_its_frames_without_asking_an_empty_socket(policy_path):
    """After a small poll's last frame the drain asks the socket whether another is queued
    instead of reading until a read fails: the failing read's zmq.Again costs a poll
    after an idle millisecond 13-30 us more than the question (docs/ONLINE.md, thirteenth
    pass). Every frame is still read and answered."""
    # inproc:// in the server's own context: the frames are queued before the poll.
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://drain{next(_names)}", max_drain_s=10.0))
    sock = server._context.socket(zmq.DEALER)
    counting, drain = _CountingSocket(server._sock), server._drain

    def counted_drain():  # the counting socket reads; the daemon's own sends
        server._sock = counting
        try:
            return drain()
        finally:
            server._sock = counting.sock

    server._drain = counted_drain
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        for name in ("a", "b"):
            sock.send(encode_step(record(1, server=name)))
        assert server.poll_once(1000) == 2
        assert counting.empty_reads == 0
        answered = {decode(sock.recv()).apply_from_step for _ in range(2)}
        assert answered == {1 + DECISION_LAG}
        sock.send(encode_step(record(2, server="a")))  # the next poll reads it too
        assert server.poll_once(1000) == 1 and counting.empty_reads == 0
        # A larger poll reads every frame queued (on until the socket is empty).
        folded = server.metrics.registry.get_sample_value("specctl_telemetry_records_total")
        for step in range(3, 13):
            sock.send(encode_step(record(step, server="b")))
        assert server.poll_once(1000) == server.options.answers_per_poll
        assert server.metrics.registry.get_sample_value(
            "specctl_telemetry_records_total") == folded + 10
    finally:
        sock.close()
        server.close()


def test_the_daemon_keeps_freed_memory_for_reuse():
    """specctl-serve's allocator settings are all accepted where glibc is (mallopt refuses
    an out-of-range value: then this is False)."""
    from controller import streams

    if streams._mallopt is None:
        pytest.skip("not glibc")
    assert streams.keep_freed_memory() is True


def test_the_daemon_process_settles_its_garbage_collector():
    """specctl-serve, once set up: start-up objects frozen out of collections, the young
    generation collected less often (restored here for the other tests)."""
    import gc

    from controller import cli

    before = gc.get_threshold()
    try:
        cli._settle()
        assert gc.get_freeze_count() > 1000  # this process's modules, at least
        assert gc.get_threshold() == (cli._GC_YOUNG_THRESHOLD, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)

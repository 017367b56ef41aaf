"""specctl-serve: the real daemon process over real sockets, and its server class in-process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import zmq

from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from controller.security import CurveConfig, UnsafeEndpointError, check_endpoint, is_local
from controller.server import ControllerServer, ServeOptions
from controller.wire import (
    DECISION_LAG,
    MAX_FRAME_BYTES,
    Decision,
    Hello,
    decode,
    encode_hello,
    encode_step,
)
from env.features import FeatureBuilder, FeatureSpec
from env.traces.schema import StepRecord
from sglang_hooks.testing import socket_dir, wait_until

REPO = Path(__file__).resolve().parents[1]
_SOCKETS = socket_dir()  # ipc paths must stay under 107 characters; removed at exit
_names = iter(range(10**6))


def ipc() -> str:
    return f"ipc://{_SOCKETS}/{next(_names)}.sock"


def record(step: int, batch: int = 8, steps: int = 3, server: str = "s", rank: int = 0,
           prefill: int = 0) -> StepRecord:
    rng = np.random.default_rng(step)
    accepted = rng.integers(0, steps + 1, size=batch).astype(np.int8) if steps else []
    return StepRecord(server, rank, step, step * 0.01, batch, 2, batch, 5000, 100_000, prefill,
                      steps, np.asarray(accepted, np.int8), 0.01 + 0.001 * steps)


@pytest.fixture
def policy_path(tmp_path) -> Path:
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1, name="first").save(path)
    return path


class Client:
    """A raw DEALER socket speaking the wire protocol (what the plugin's client sends)."""

    def __init__(self, endpoint: str, context: zmq.Context | None = None) -> None:
        self.context = context or zmq.Context.instance()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def recv(self, timeout_s: float = 5.0) -> Decision | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the daemon process --------------------------------------------------------------------


def start_serve(*overrides: str) -> tuple[subprocess.Popen, float]:
    """Start ``specctl-serve`` (``python -m controller.cli``); returns it and its start-up time."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "controller.cli", *overrides], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if "serving policy" in line:
            return process, time.perf_counter() - started
    raise AssertionError(f"specctl-serve exited with {process.wait()} before serving")


def test_serve_process_answers_reloads_and_stops_cleanly(policy_path):
    endpoint, port = ipc(), free_port()
    # start_serve also measures the start-up time; speed is a benchmark's business
    # (a loaded 2-core machine took 6 s), so it is not asserted here.
    process, _ = start_serve(f"policy={policy_path}", f"endpoint={endpoint}",
                             f"metrics_port={port}", "reload_poll_s=0.1")
    client = Client(endpoint)
    try:
        client.send(encode_hello(Hello("s", 0, tuple(range(8)))))
        client.send(encode_step(record(1)))
        decision = client.recv()
        assert decision.policy == "first" and decision.apply_from_step == 1 + DECISION_LAG
        assert not decision.is_fallback and decision.batch_grid[0] == 1

        ExportedPolicy.random(seed=2, name="second").save(policy_path)
        deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
        while decision.policy != "second" and time.monotonic() < deadline:
            time.sleep(0.05)
            client.send(encode_step(record(decision.apply_from_step)))
            decision = client.recv()
        assert decision.policy == "second"

        policy_path.write_bytes(b"not a policy")  # corrupt: the old one keeps serving
        os.kill(process.pid, signal.SIGHUP)  # and SIGHUP forces the attempt

        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=5).read().decode()

        # Waited for, not slept on (a loaded machine may take longer than any fixed wait).
        wait_until(lambda: 'specctl_policy_reloads_total{result="error"}' in scrape()
                   and 'reloads_total{result="error"} 0.0' not in scrape(),
                   "the failed reload counted")
        client.send(encode_step(record(decision.apply_from_step)))
        assert client.recv().policy == "second"

        text = scrape()
        assert re.search(r"specctl_decisions_total [3-9]", text)
        assert 'specctl_policy_reloads_total{result="ok"} 1.0' in text
        assert 'specctl_policy_reloads_total{result="error"} 1.0' in text
        assert "specctl_decision_latency_seconds_bucket" in text
    finally:
        client.close()
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=10)[0]
    assert process.returncode == 0, output
    assert "stopped" in output and "policy reload failed" in output


def test_serve_refuses_a_public_endpoint_and_a_missing_policy(policy_path):
    for overrides, message in [
        ([f"policy={policy_path}", "endpoint=tcp://0.0.0.0:5599"], "reachable from other hosts"),
        (["policy=/nonexistent/policy.npz", f"endpoint={ipc()}"], "not a readable .npz"),
        ([f"policy={policy_path}", f"endpoint={ipc()}", "probe.share=0"], "probe.share"),
        ([f"policy={policy_path}", f"endpoint={ipc()}", "guard.margin=1"], "guard.margin"),
    ]:
        result = subprocess.run([sys.executable, "-m", "controller.cli", *overrides], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stdout + result.stderr


def test_serving_never_imports_torch(policy_path):
    # The daemon answers a HELLO and a step (the whole serving path) before it is stopped.
    endpoint = ipc()
    script = f"""
import sys, threading
import zmq
from omegaconf import OmegaConf
from controller.cli import serve
from controller.wire import Hello, decode, encode_hello, encode_step
from env.traces.schema import StepRecord
import numpy as np
cfg = OmegaConf.load("configs/serve.yaml")
cfg.policy, cfg.endpoint = "{policy_path}", "{endpoint}"
stop = threading.Event()
thread = threading.Thread(target=serve, args=(cfg, stop))
thread.start()
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect("{endpoint}")  # zmq queues until the daemon binds
sock.send(encode_hello(Hello("s", 0, tuple(range(8)))))
sock.send(encode_step(StepRecord("s", 0, 1, 0.01, 2, 0, 2, 50, 1000, 0, 3,
                                 np.array([1, 2], np.int8), 0.013)))
assert sock.poll(60_000), "no decision within the hang guard"
print(type(decode(sock.recv())).__name__, end=" ")
sock.close()
stop.set()
thread.join()
print("torch" in sys.modules, "gymnasium" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["Decision", "False"]


# -- the server class, in-process -------------------------------------------------------------


@pytest.fixture
def server(policy_path):
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=ipc()))
    yield server
    server.close()


def pump(server: ControllerServer, until: int, timeout_s: float = 5.0) -> int:
    """Poll until ``until`` decisions were sent (in however many polls it takes)."""
    sent, deadline = 0, time.monotonic() + timeout_s
    while sent < until and time.monotonic() < deadline:
        sent += server.poll_once(20)
    return sent


def test_one_decision_per_stream_answering_its_latest_record(policy_path):
    # inproc:// in the server's own context: a send lands in the server's queue before it
    # returns, so all four frames are waiting for one poll however loaded the machine is
    # (over ipc:// only a sleep, a timing window, could say they have arrived).
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://one-per-stream-{os.getpid()}", answers_per_poll=1))
    a, b = (Client(server.endpoint, server._context) for _ in range(2))
    try:
        for step in (1, 2, 3):
            a.send(encode_step(record(step, server="a")))
        b.send(encode_step(record(7, server="b", rank=1)))
        assert server.poll_once(100) == 2
        assert a.recv().apply_from_step == 3 + DECISION_LAG
        assert b.recv().apply_from_step == 7 + DECISION_LAG
        assert a.recv(0.2) is None
        records = server.metrics.registry.get_sample_value("specctl_telemetry_records_total")
        assert records == 4
    finally:
        for client in (a, b):  # before the server ends their shared context
            client.sock.close(0)
        server.close()




def test_with_answers_per_poll_every_record_of_a_poll_is_answered_in_order(policy_path):
    # inproc:// in the server's context: all four frames wait for the one poll (no sleep).
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://per-poll-{os.getpid()}", answers_per_poll=4))
    a, b = (Client(server.endpoint, server._context) for _ in range(2))
    try:
        for step in (1, 2, 3):
            a.send(encode_step(record(step, server="a")))
        b.send(encode_step(record(7, server="b", rank=1)))
        assert server.poll_once(100) == 4
        assert [a.recv().apply_from_step for _ in range(3)] == [
            s + DECISION_LAG for s in (1, 2, 3)]
        assert b.recv().apply_from_step == 7 + DECISION_LAG
        assert a.recv(0.2) is None
    finally:
        for client in (a, b):  # before the server ends their shared context
            client.sock.close(0)
        server.close()


def test_after_a_slow_round_only_each_streams_latest_record_is_answered(policy_path):
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        endpoint=f"inproc://slow-round-{os.getpid()}", overload_busy_s=0.0,
        overload_records_per_poll=16, answers_per_poll=4))
    a = Client(server.endpoint, server._context)  # inproc: the three frames wait, no sleep
    try:
        a.send(encode_step(record(1, server="a")))
        assert pump(server, 1) == 1  # a round that took longer than 0 s: "slow"
        assert a.recv().apply_from_step == 1 + DECISION_LAG
        for step in (2, 3, 4):
            a.send(encode_step(record(step, server="a")))
        assert server.poll_once(100) == 1
        assert a.recv().apply_from_step == 4 + DECISION_LAG
        assert a.recv(0.2) is None
        assert server.metrics.registry.get_sample_value("specctl_telemetry_records_total") == 4
    finally:
        a.sock.close(0)  # before the server ends its context
        server.close()


def test_decisions_are_the_policy_on_the_feature_modules_observations(server, policy_path):
    """The controller's table equals the policy evaluated on FeatureBuilder's grid."""
    policy = ExportedPolicy.load(policy_path)
    builder = FeatureBuilder(policy.feature_spec)
    client = Client(server.endpoint)
    for step in range(1, 30):
        rec = record(step, batch=1 + step % 9, steps=step % 8)
        builder.update(rec)
        client.send(encode_step(rec))
        assert pump(server, 1) == 1
        decision = client.recv()
        expected = policy.act(builder.observation_grid())
        grid = policy.feature_spec.batch_grid
        table = dict(zip(decision.batch_grid, decision.steps, strict=True))
        for i, g in enumerate(grid):  # the sent table is compressed: look up the floor
            floor = max(k for k in table if k <= g)
            assert table[floor] == expected[i]


def test_candidate_steps_restrict_the_choice(policy_path):
    spec = FeatureSpec()
    only_high = ExportedPolicy.random(seed=5, actions=[5, 6, 7], name="high")
    only_high.save(policy_path)
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(endpoint=ipc()))
    try:
        ok, none = Client(server.endpoint), Client(server.endpoint)
        ok.send(encode_hello(Hello("ok", 0, (0, 6))))
        none.send(encode_hello(Hello("none", 0, (0, 1, 2))))
        ok.send(encode_step(record(1, server="ok")))
        none.send(encode_step(record(1, server="none")))
        assert pump(server, 2) == 2
        assert set(ok.recv().steps) == {6}
        assert none.recv().is_fallback
        fallbacks = server.metrics.registry.get_sample_value(
            "specctl_fallback_replies_total", {"reason": "no_allowed_action"})
        assert fallbacks == 1 and spec.max_depth == 7
    finally:
        server.close()


def test_shadow_mode_decides_but_replies_fallback(policy_path, caplog):
    server = ControllerServer(PolicyHolder(policy_path),
                              ServeOptions(endpoint=ipc(), shadow=True, log_every_s=0.0))
    try:
        client = Client(server.endpoint)
        for step in range(1, 6):
            client.send(encode_step(record(step)))
            assert pump(server, 1) == 1
            assert client.recv().is_fallback
        with caplog.at_level("INFO"):
            server.poll_once(1)
        assert "shadow mode: the policy would have chosen steps" in caplog.text
        assert server.metrics.registry.get_sample_value(
            "specctl_fallback_replies_total", {"reason": "shadow"}) == 5
    finally:
        server.close()


def test_bad_frames_are_counted_and_serving_goes_on(server):
    client = Client(server.endpoint)
    client.send(b"\xc1\xc1")
    client.send(b"\x00" * (MAX_FRAME_BYTES + 1))
    client.sock.send_multipart([b"two", b"frames"])
    client.send(b"\x92\x07\x02")  # version 7
    client.send(encode_step(record(1)))
    assert pump(server, 1) == 1
    assert client.recv() is not None
    errors = {kind: server.metrics.registry.get_sample_value(
        "specctl_wire_errors_total", {"kind": kind}) for kind in
        ("garbage", "oversized", "malformed", "version")}
    assert errors == {"garbage": 1, "oversized": 1, "malformed": 1, "version": 1}


def test_transport_cap_disconnects_a_flooding_peer(server):
    """Frames beyond ZMQ_MAXMSGSIZE never reach Python; the peer is dropped, others served."""
    bad, good = Client(server.endpoint), Client(server.endpoint)
    bad.send(b"\x00" * (2 << 20))
    good.send(encode_step(record(1)))
    assert pump(server, 1) == 1 and good.recv() is not None


def test_a_restarted_server_starts_a_fresh_stream(server):
    client = Client(server.endpoint)
    for step in (50, 51, 1):
        client.send(encode_step(record(step)))
        assert pump(server, 1) == 1
        assert client.recv().apply_from_step == step + DECISION_LAG
    assert server.counters["stream_restarts"] == 1


def test_corrupt_policy_file_on_reload_keeps_the_old_policy(server, policy_path):
    holder = server.holder
    policy_path.write_bytes(b"PK\x03\x04 truncated zip")
    holder.request_reload()
    assert holder.poll() is False and holder.policy.name == "first"
    spec = FeatureSpec(max_depth=3)  # a different feature spec: streams start afresh
    ExportedPolicy.random(spec=spec, seed=9, name="third").save(policy_path)
    holder.request_reload()
    assert holder.poll() is True and holder.policy.name == "third"
    client = Client(server.endpoint)
    client.send(encode_step(record(1)))
    assert pump(server, 1) == 1
    decision = client.recv()
    assert decision.policy == "third" and max(decision.steps) <= 3


def test_only_local_endpoints_without_curve():
    assert is_local("ipc:///tmp/x") and is_local("tcp://127.0.0.1:1") and is_local("tcp://[::1]:2")
    assert is_local("tcp://localhost:3")
    for endpoint in ("tcp://*:5", "tcp://0.0.0.0:5", "tcp://10.0.0.1:5", "tcp://eth0:5"):
        with pytest.raises(UnsafeEndpointError, match="reachable from other hosts"):
            check_endpoint(endpoint, None)
    check_endpoint("tcp://0.0.0.0:5", CurveConfig("keys/server.key_secret"))


def test_curve_encrypts_and_admits_only_listed_clients(tmp_path, policy_path):
    import zmq.auth

    from sglang_hooks.client import ControllerClient

    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    client_public, client_secret = zmq.auth.create_certificates(tmp_path, "client")
    os.replace(client_public, allowed / Path(client_public).name)
    public_key = zmq.auth.load_certificate(server_public)[0].decode()
    port = free_port()
    server = ControllerServer(PolicyHolder(policy_path), ServeOptions(
        # Loopback: CURVE is what this test checks, not who can reach the port.
        endpoint=f"tcp://127.0.0.1:{port}", curve=CurveConfig(server_secret, str(allowed))))
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop, 10))
    thread.start()
    hello = Hello("s", 0, tuple(range(8)))
    listed = ControllerClient(f"tcp://127.0.0.1:{port}", hello, 2.0, public_key, client_secret)
    stranger = ControllerClient(f"tcp://127.0.0.1:{port}", hello, 2.0, public_key)
    try:
        # The deadline only turns a hang into a failure (a loaded machine may take seconds
        # over the handshakes); nothing asserted depends on how soon a decision comes.
        deadline, step = time.monotonic() + 60, 0
        while time.monotonic() < deadline and listed.counters["decisions"] == 0:
            step += 1  # keep sending: nothing is queued until the handshake completes
            for c in (listed, stranger):
                c.send_telemetry(encode_step(record(step)), step, time.monotonic())
            time.sleep(0.02)
        assert isinstance(listed.current, Decision)
        assert stranger.counters["decisions"] == 0 and stranger.counters["telemetry_sent"] == 0
    finally:
        stop.set()
        thread.join(5)
        listed.close()
        stranger.close()
        server.close()


def test_the_batch_histogram_counts_like_prometheus_histograms():
    """The daemon's latency histogram takes a poll's latencies at once; its exposition
    must be what prometheus_client's own Histogram gives for the same observations."""
    from prometheus_client import CollectorRegistry, Histogram

    from controller.metrics import BatchHistogram

    buckets = (25e-6, 1e-4, 5e-4, 1e-3)
    values = [5e-5, 1e-4, 2e-4, 5e-4, 7e-4, 1e-3, 0.5, 0.0, 25e-6]  # bounds, between, beyond
    values += values * 4  # a large poll too (counted with numpy, small ones in Python)
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = BatchHistogram("lat_seconds", "doc", buckets, ours_registry)
    theirs = Histogram("lat_seconds", "doc", buckets=buckets, registry=theirs_registry)
    ours.observe_many(values[:3])
    ours.observe_many(np.array(values[3:9]))
    ours.observe_many(values[9:])
    for value in values:
        theirs.observe(value)
    for bound in ("2.5e-05", "0.0001", "0.0005", "0.001", "+Inf"):
        labels = {"le": bound}
        assert (ours_registry.get_sample_value("lat_seconds_bucket", labels)
                == theirs_registry.get_sample_value("lat_seconds_bucket", labels)), bound
    for suffix in ("_count", "_sum"):
        assert ours_registry.get_sample_value("lat_seconds" + suffix) == pytest.approx(
            theirs_registry.get_sample_value("lat_seconds" + suffix))


def test_the_poll_counter_counts_like_prometheus_counters():
    """The daemon's per-poll counters (plain integer additions): the samples a scrape
    reads must be prometheus_client's own Counter's for the same counts, with a label
    (its values exposed as strings) and without."""
    from prometheus_client import CollectorRegistry, Counter

    from controller.metrics import PollCounter

    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours_plain = PollCounter("sent", "doc", ours_registry)
    theirs_plain = Counter("sent", "doc", registry=theirs_registry)
    ours_steps = PollCounter("chosen", "doc", ours_registry, label="steps")
    theirs_steps = Counter("chosen", "doc", ["steps"], registry=theirs_registry)
    for steps, count in ((3, 2), (0, 1), (3, 5), (7, 1)):
        ours_plain.inc(count)
        theirs_plain.inc(count)
        ours_steps.add(steps, count)
        theirs_steps.labels(str(steps)).inc(count)

    def samples(registry):
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                      for family in registry.collect() for s in family.samples
                      if not s.name.endswith("_created"))

    assert samples(ours_registry) == samples(theirs_registry)
    assert ours_registry.get_sample_value("chosen_total", {"steps": "3"}) == 7

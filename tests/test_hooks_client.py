"""The plugin's controller client: never blocks, ages decisions, falls back on silence;
its I/O thread builds the markers the scheduler thread attaches."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from controller.policy_file import PolicyFileError
from controller.wire import (
    DECISION_LAG,
    MAX_FRAME_BYTES,
    Decision,
    Hello,
    PolicyPush,
    WireError,
    decode,
    encode_decision,
    encode_hello,
    encode_policy,
    encode_step,
)
from env.traces.schema import StepRecord
from sglang_hooks import client as client_module
from sglang_hooks.client import (
    TIMED_OUT,
    ControllerClient,
    DecisionAge,
    client_name,
    marker_for,
    telemetry_frame,
)
from sglang_hooks.marker import CONTROLLER, FALLBACK
from sglang_hooks.raw_step import telemetry_of
from sglang_hooks.testing import HANG_GUARD_S, ManualClock, io_round, socket_dir, wait_until

_SOCKETS = socket_dir()
_names = iter(range(10**6))
HELLO = Hello("s", 0, tuple(range(8)))


def ipc() -> str:
    return f"ipc://{_SOCKETS}/{next(_names)}.sock"


def frame(step: int) -> bytes:
    return encode_step(StepRecord("s", 0, step, 0.0, 1, 0, 1, 0, 1, 0, 1,
                                  np.zeros(1, np.int8), 0.01))


class Router:
    """The controller's side of the socket, answered by hand."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def receive(self) -> tuple[bytes, object]:
        """The next frame (waiting at most HANG_GUARD_S: a hang guard, not a window)."""
        assert self.sock.poll(int(HANG_GUARD_S * 1000)), "nothing received"
        identity, payload = self.sock.recv_multipart()
        return identity, decode(payload)

    def telemetry(self) -> tuple[bytes, StepRecord]:
        while True:
            identity, message = self.receive()
            if isinstance(message, StepRecord):
                return identity, message

    def answer(self, identity: bytes, step: int, steps: int = 4) -> None:
        decision = Decision(step, step + DECISION_LAG, "p", (1,), (steps,))
        self.sock.send_multipart([identity, encode_decision(decision)])

    def close(self) -> None:
        self.sock.close(0)


def handled(client: ControllerClient, decisions: int) -> None:
    """Wait until the I/O thread has taken ``decisions`` decisions in all (accepted,
    stale or out of order) and published what they mean: counted, never timed."""
    counters = client.counters
    wait_until(lambda: (counters["decisions"] + counters["decisions_stale"]
                        + counters["decisions_out_of_order"]) >= decisions,
               f"{decisions} decisions")
    io_round(client)


@contextlib.contextmanager
def connected(timeout_s: float, **kwargs) -> Iterator[tuple[Router, ControllerClient]]:
    """A controller stand-in and a client connected to it (HELLO not yet read); both
    closed afterwards, whatever the test did."""
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=timeout_s, **kwargs)
    try:
        yield router, client
    finally:
        client.close()
        router.close()


# Over a real socket, on a manual clock: the clock moves only where a test says, so a
# loaded machine cannot push a step past the timeout; after each move the test waits for
# a round of the I/O thread (io_round), which ages the decisions at the clock's reading.


def test_decisions_are_followed_until_the_controller_goes_quiet():
    clock = ManualClock()
    with connected(0.1, monotonic=clock) as (router, client):
        _, hello = router.receive()
        assert hello == HELLO
        io_round(client)
        assert client.current is None and client.marker is None  # local rule
        client.send_telemetry(frame(1), 1, clock())
        identity, record = router.telemetry()
        clock.advance(0.01)
        router.answer(identity, record.step_index)
        handled(client, 1)
        decision = client.current
        assert isinstance(decision, Decision) and decision.steps == (4,)
        first = client.marker
        assert first.mode == CONTROLLER and first.steps == (4,) and first.seq == 1
        assert client.answered_step == 1

        client.send_telemetry(frame(2), 2, clock())  # never answered
        clock.advance(0.09)
        io_round(client)
        assert client.current == decision and client.marker is first  # within the timeout
        clock.advance(0.02)
        io_round(client)
        assert client.current is TIMED_OUT
        assert client.marker.mode == FALLBACK and client.marker.policy == ""
        assert client.marker.seq == 2

        client.send_telemetry(frame(3), 3, clock())
        router.telemetry()
        identity, record = router.telemetry()
        router.answer(identity, record.step_index, steps=6)
        handled(client, 2)
        assert client.current.steps == (6,)  # resumed
        assert client.marker.steps == (6,) and client.marker.seq == 3


def test_late_and_out_of_order_decisions_are_dropped():
    clock = ManualClock()
    with connected(0.05, monotonic=clock) as (router, client):
        router.receive()
        for step in (1, 2):
            client.send_telemetry(frame(step), step, clock())
        identity, _ = router.telemetry()
        router.telemetry()
        clock.advance(0.08)
        router.answer(identity, 1)  # answers step 1, 80 ms after it was sent: stale
        handled(client, 1)
        assert client.counters["decisions_stale"] == 1
        assert client.current is TIMED_OUT and client.marker.mode == FALLBACK
        client.send_telemetry(frame(3), 3, clock())
        router.telemetry()
        router.answer(identity, 3)
        router.answer(identity, 2)  # older than what was just accepted
        handled(client, 3)
        assert client.counters["decisions"] == 1
        assert client.counters["decisions_out_of_order"] == 1
        assert client.current.apply_from_step == 3 + DECISION_LAG
        assert client.answered_step == 3


def test_a_missing_controller_means_dropped_telemetry_and_fallback():
    """Never a blocked send (a blocked one would hang here); what it costs per step is
    measured in benchmarks/bench_online.py, not asserted here."""
    clock = ManualClock()
    client = ControllerClient(ipc(), HELLO, timeout_s=0.01, monotonic=clock)  # nobody there
    try:
        for step in range(10_000):
            client.send_telemetry(frame(step), step, clock())
        counters = client.counters
        wait_until(lambda: counters["telemetry_dropped"]
                   + counters["telemetry_backlog_dropped"] == 10_000, "every send dropped")
        assert counters["telemetry_sent"] == 0
        io_round(client)
        assert client.current is None, "not overdue within the timeout"
        clock.advance(0.011)
        io_round(client)
        assert client.current is TIMED_OUT and client.marker.mode == FALLBACK
    finally:
        client.close()


# -- the timeout paths of DecisionAge, with given clock values (fast) ---------------------


def decision_for(step: int, steps: int = 4) -> Decision:
    return Decision(step, step + DECISION_LAG, "p", (1,), (steps,))


def test_timeout_falls_back_and_only_a_fresh_decision_resumes():
    age = DecisionAge(0.1, Counter())
    assert age.want(100.0) is None  # nothing sent, nothing decided: local rule
    assert age.deadline() is None
    age.sent(1, 100.00)
    assert age.deadline() == 100.1
    assert age.want(100.09) is None  # waiting, within the timeout
    age.accept(decision_for(1), 100.02)
    assert age.want(100.05).steps == (4,)
    age.sent(2, 100.03)  # never answered
    assert age.want(100.12).steps == (4,)  # 90 ms: still in charge
    assert age.want(100.14) is TIMED_OUT  # 110 ms: the controller is gone
    assert age.deadline() is None  # overdue already: nothing to wake up for
    assert age.want(100.145) is TIMED_OUT  # and stays gone...
    age.sent(3, 100.15)
    assert age.want(100.16) is TIMED_OUT, "...step 2 is still unanswered"
    age.accept(decision_for(3, steps=6), 100.16)
    assert age.want(100.17).steps == (6,)  # ...until a fresh decision
    assert age.counters["decisions"] == 2


def test_an_answer_later_than_the_timeout_is_stale_and_ignored():
    age = DecisionAge(0.1, Counter())
    age.sent(4, 9.99)
    age.accept(decision_for(4), 10.0)
    assert age.want(10.0).steps == (4,)
    age.sent(5, 10.0)  # the server's last step before it goes idle
    age.accept(decision_for(5), 10.2)  # 200 ms after its telemetry
    assert age.counters["decisions_stale"] == 1
    assert age.want(10.2) is TIMED_OUT, "the older decision must not stay in charge"


def test_out_of_order_and_unknown_step_answers_are_ignored():
    age = DecisionAge(0.1, Counter())
    for step in (6, 7):
        age.sent(step, 1.0)
    age.accept(decision_for(7), 1.01)
    age.accept(decision_for(6), 1.01)  # older than what was accepted
    age.accept(decision_for(99), 1.01)  # answers nothing sent
    assert age.counters["decisions"] == 1
    assert age.counters["decisions_out_of_order"] == 1
    assert age.counters["decisions_stale"] == 1
    assert age.want(1.02).apply_from_step == 7 + DECISION_LAG
    assert age.answered_step == 7


def test_markers_say_what_the_decision_says():
    marker = marker_for(Decision(1, 9, "p", (1, 64), (5, 2)))
    assert marker == (0, CONTROLLER, 9, (1, 64), (5, 2), "p", False)
    unheld = marker_for(Decision(1, 9, "p", (1, 64), (0, 0), unheld=True))
    assert unheld == (0, CONTROLLER, 9, (1, 64), (0, 0), "p", True)
    assert unheld.key != marker_for(Decision(1, 9, "p", (1, 64), (0, 0))).key
    assert marker.steps_for(100) == 2
    assert marker_for(Decision.fallback(1, 9, "p")) == (0, FALLBACK, 0, (), (), "p", False)
    assert marker_for(TIMED_OUT).policy == ""


def test_the_same_decision_again_publishes_no_new_marker():
    clock = ManualClock()
    with connected(0.5, monotonic=clock) as (router, client):
        router.receive()
        for step in (1, 2, 3):
            client.send_telemetry(frame(step), step, clock())
            identity, record = router.telemetry()
            router.answer(identity, record.step_index, steps=4 if step < 3 else 5)
            handled(client, step)
            if step == 1:
                first = client.marker
            if step == 2:
                assert client.marker is first  # same steps: nothing new for the ranks
        assert client.counters["decisions"] == 3
        assert client.marker.steps == (5,) and client.marker.seq == first.seq + 1


def test_each_new_marker_goes_to_the_marker_chores_before_it_is_published(caplog):
    """The policy tables a marker's steps on the I/O thread: it must see the marker (its
    sequence number included) before the scheduler thread can; a failing chore is counted,
    logged once, and the marker is published all the same."""
    clock = ManualClock()
    seen: list[tuple] = []

    def failing(marker) -> None:
        raise RuntimeError("a bug")

    with connected(0.5, monotonic=clock) as (router, client):
        client.add_marker_chore(failing)
        client.add_marker_chore(lambda marker: seen.append((marker, client.marker)))
        router.receive()
        for step in (1, 2, 3):
            client.send_telemetry(frame(step), step, clock())
            identity, record = router.telemetry()
            router.answer(identity, record.step_index, steps=4 if step < 3 else 5)
            handled(client, step)
    assert [marker.steps for marker, _ in seen] == [(4,), (5,)]  # once per new marker
    assert seen[0][1] is None and seen[1][1] is seen[0][0]  # not yet published
    assert client.marker is seen[1][0]
    assert client.counters["marker_chore_failed"] == 2
    assert [r.getMessage() for r in caplog.records if "marker chore" in r.getMessage()] == [
        "specctl: a marker chore of the controller client's thread failed (counted; the "
        "marker is published)"]


def test_a_failed_io_thread_leaves_every_rank_on_the_fallback():
    clock = ManualClock()
    with connected(5.0, monotonic=clock) as (router, client):
        router.receive()
        client.send_telemetry(frame(1), 1, clock())
        identity, _ = router.telemetry()
        router.answer(identity, 1)
        handled(client, 1)
        assert client.marker.mode == CONTROLLER
        client.send_telemetry(("not", "telemetry"), 2, clock())  # a bug's stand-in
        wait_until(lambda: not client._thread.is_alive(), "the I/O thread to stop")
        assert client.counters["client_thread_failed"] == 1
        assert client.marker.mode == FALLBACK and client.current is TIMED_OUT


def test_the_io_thread_sleeps_until_telemetry_or_a_decision_wakes_it():
    clock = ManualClock()
    with connected(0.1, monotonic=clock) as (router, client):
        router.receive()  # HELLO sent: the next one is a second away
        wait_until(lambda: client._sleeping, "the I/O thread asleep")
        asleep = client.counters["io_wakeups"]
        time.sleep(0.1)  # the old client woke every 1-10 ms here
        assert client.counters["io_wakeups"] == asleep
        client.send_telemetry(frame(1), 1, clock())
        identity, record = router.telemetry()  # sent at once, no polling interval
        assert record.step_index == 1
        router.answer(identity, 1)
        wait_until(lambda: client.counters["io_wakeups"] >= asleep + 2, "woken by the decision")
        handled(client, 1)
        assert client.current.steps == (4,)


# -- what the mutation run (scripts/mutation.py sglang_hooks/client.py) found unchecked -----


def test_bad_frames_are_counted_one_by_one_and_the_decision_after_them_taken():
    clock = ManualClock()
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=0.1, monotonic=clock)
    try:
        assert client.endpoint == endpoint
        identity, _ = router.receive()
        client.send_telemetry(frame(1), 1, clock())
        router.telemetry()
        for bad in (b"\xc1garbage", b"\xc1more", encode_hello(HELLO)):  # HELLO: wrong kind
            router.sock.send_multipart([identity, bad])
        router.answer(identity, 1)
        handled(client, 1)
        assert client.counters["wire_error_garbage"] == 2
        assert client.counters["wire_error_kind"] == 1
        assert client.current.steps == (4,)
    finally:
        client.close()
        router.close()


def test_an_answer_exactly_at_the_timeout_is_still_fresh():
    age = DecisionAge(0.125, Counter())  # binary fractions: exact differences
    age.sent(1, 1.0)
    assert age.deadline() == 1.125
    assert age.want(1.125) is None, "overdue only after the timeout"
    age.accept(decision_for(1), 1.125)
    assert age.counters["decisions"] == 1 and age.want(1.125).steps == (4,)


def test_repeated_and_late_answers_are_each_counted():
    age = DecisionAge(0.1, Counter())
    for step in (1, 2, 3):
        age.sent(step, 1.0)
    for decision in (decision_for(2), decision_for(2), decision_for(1)):  # 2 twice
        age.accept(decision, 1.01)
    assert age.counters["decisions"] == 1
    assert age.counters["decisions_out_of_order"] == 2, "a repeat is out of order"
    age.sent(4, 2.0)
    age.sent(5, 2.0)
    for decision in (decision_for(3), decision_for(4)):  # both stale
        age.accept(decision, 2.5)
    assert age.counters["decisions_stale"] == 2


# -- local decision mode and pushed policies, with a stand-in for LocalDecisions ----------


class LocalStandIn:
    """What the client uses of :class:`sglang_hooks.local.LocalDecisions`."""

    def __init__(self, digest: str = "a" * 64, install: object = True) -> None:
        self.digest = digest
        self.frames: list[bytes] = []
        self.pushes: list[PolicyPush] = []
        self._install = install

    def decide(self, frame: bytes) -> Decision:
        self.frames.append(frame)
        step = decode(frame).step_index
        if step == 13:
            raise WireError("range", "a telemetry the daemon would refuse")
        return decision_for(step, steps=step % 8)

    def install(self, push: PolicyPush) -> bool:
        self.pushes.append(push)
        if isinstance(self._install, Exception):
            raise self._install
        return self._install


def test_local_mode_answers_each_telemetry_on_the_io_thread():
    clock = ManualClock()
    local = LocalStandIn()
    client = ControllerClient(None, HELLO, timeout_s=0.1, local=local, monotonic=clock)
    try:
        client.send_telemetry(frame(5), 5, clock())
        wait_until(lambda: client.counters["local_decisions"] == 1, "a local decision")
        io_round(client)
        assert local.frames == [frame(5)]
        assert client.current.steps == (5,) and client.marker.steps == (5,)
        assert client.answered_step == 5
        for _ in range(2):  # refused: no answer, and each refusal counted
            client.send_telemetry(frame(13), 13, clock())
        # A telemetry given as the hooks' values is packed before it is decided on.
        client.send_telemetry(("s", 0, 14, 0.0, 1, 0, 1, 0, 1, 0, 1, [0], 0.01), 14, clock())
        wait_until(lambda: client.counters["local_decisions"] == 2, "a second decision")
        assert client.counters["local_wire_error_range"] == 2  # taken in order, before 14
        assert decode(local.frames[-1]).step_index == 14 and len(local.frames) == 4
        assert client.counters["telemetry_sent"] == 0  # no socket: nothing sent
    finally:
        client.close()


def test_local_mode_says_its_policy_in_hello_and_ignores_the_hubs_decisions():
    endpoint = ipc()
    router = Router(endpoint)
    local = LocalStandIn(digest="b" * 64)
    client = ControllerClient(endpoint, HELLO, timeout_s=5.0, local=local)
    try:
        identity, hello = router.receive()
        assert hello == Hello("s", 0, HELLO.candidate_steps, policy_digest="b" * 64)
        client.send_telemetry(frame(1), 1, time.monotonic())
        router.telemetry()
        wait_until(lambda: client.counters["local_decisions"] == 1, "a local decision")
        router.answer(identity, 1, steps=7)  # the hub's answer: not needed here
        wait_until(lambda: client.counters["remote_decisions_ignored"] == 1, "ignored")
        assert client.current.steps == (1,)
        local.digest = "c" * 64  # a pushed policy took over: the next HELLO says so
        _, again = router.receive()
        while not isinstance(again, Hello):
            _, again = router.receive()
        assert again.policy_digest == "c" * 64
    finally:
        client.close()
        router.close()


@pytest.mark.parametrize(("install", "counter", "level", "says"), [
    (True, "policy_pushes_installed", logging.INFO,
     "specctl: deciding with policy 'pushed' pushed by specctl-serve"),
    (False, "policy_pushes_unchanged", None, None),
    (PolicyFileError("bad weights"), "policy_pushes_refused", logging.ERROR,
     "specctl: the policy specctl-serve pushed is not valid, deciding with the previous "
     "one: bad weights"),
    (None, "policy_pushes_ignored", None, None),  # remote mode: no use for a policy
])
def test_a_pushed_policy_is_installed_kept_refused_or_ignored(install, counter, level, says,
                                                              caplog):
    endpoint = ipc()
    router = Router(endpoint)
    local = None if install is None else LocalStandIn(install=install)
    client = ControllerClient(endpoint, HELLO, timeout_s=5.0, local=local)
    # Larger than any other frame may be (MAX_FRAME_BYTES): taken only as a POLICY.
    push = PolicyPush("pushed", "d" * 64, bytes(MAX_FRAME_BYTES + 1))
    try:
        identity, _ = router.receive()
        with caplog.at_level(logging.INFO, logger="sglang_hooks.client"):
            for _ in range(2):
                router.sock.send_multipart([identity, encode_policy(push)])
            router.answer(identity, 1)  # taken after both pushes: frames keep their order
            counters = client.counters
            wait_until(lambda: counters["decisions_stale"] + counters["remote_decisions_ignored"]
                       == 1, "the decision after the pushes")
            # The counter moves before the log line is written: wait for the lines too.
            wait_until(lambda: says is None or sum(
                r.getMessage() == says for r in caplog.records) == 2, "the log lines")
        pushes = {k: v for k, v in counters.items() if k.startswith("policy_pushes")}
        assert pushes == {counter: 2}
        assert local is None or local.pushes == [push, push]
        messages = [(r.levelno, r.getMessage()) for r in caplog.records
                    if r.name == "sglang_hooks.client"]
        assert messages == ([] if says is None else [(level, says)] * 2)
    finally:
        client.close()
        router.close()


def test_the_sent_window_keeps_the_newest_1024_steps():
    age = DecisionAge(0.5, Counter())
    age.sent(0, 1.0)  # pushed out by the 1024 after it
    for step in range(1, 1025):
        age.sent(step, 2.0)
    assert age.deadline() == 2.5
    age.accept(decision_for(0), 2.0)  # no longer waited for: stale
    assert age.counters["decisions_stale"] == 1 and age.counters["decisions"] == 0


def test_the_constructor_hands_the_curve_keys_to_the_socket(monkeypatch):
    pair, used = zmq.curve_keypair(), []
    server_key = zmq.curve_keypair()[0].decode()
    monkeypatch.setattr(zmq.auth, "load_certificate", lambda path: used.append(path) or pair)
    client = ControllerClient(ipc(), HELLO, 5.0, server_key, "client.key_secret")
    client.close()
    assert used == ["client.key_secret"]


def test_the_plugin_introduces_itself_with_version_and_pid():
    assert client_name("0.5.23") == f"specctl-plugin sglang=0.5.23 pid={os.getpid()}"


@pytest.mark.parametrize("with_cert", [False, True])
def test_the_socket_drops_rather_than_queues_and_speaks_curve_when_given_a_key(with_cert,
                                                                                monkeypatch):
    from controller.wire import TRANSPORT_MAX_MSG_BYTES

    # libzmq does not read CURVE keys back: which keys the client took is seen here.
    pair, used = zmq.curve_keypair(), []
    server_key = zmq.curve_keypair()[0].decode()
    monkeypatch.setattr(zmq.auth, "load_certificate", lambda path: used.append(path) or pair)
    monkeypatch.setattr(zmq, "curve_keypair", lambda: used.append("fresh") or pair)
    client = ControllerClient(None, HELLO, timeout_s=0.1)
    # A second socket built the same way on the client's context, inspected here (the
    # client's own belongs to its I/O thread).
    sock = client._socket(ipc(), server_key, "client.key_secret" if with_cert else None)
    plain = client._socket(ipc(), None, "client.key_secret")
    try:
        assert sock.type == zmq.DEALER
        options = {name: sock.getsockopt(getattr(zmq, name)) for name in (
            "IMMEDIATE", "SNDHWM", "RCVHWM", "RECONNECT_IVL", "RECONNECT_IVL_MAX",
            "HEARTBEAT_IVL", "HEARTBEAT_TIMEOUT", "MAXMSGSIZE", "LINGER")}
        assert options == {"IMMEDIATE": 1, "SNDHWM": 64, "RCVHWM": 256, "RECONNECT_IVL": 100,
                           "RECONNECT_IVL_MAX": 500, "HEARTBEAT_IVL": 1000,
                           "HEARTBEAT_TIMEOUT": 3000, "MAXMSGSIZE": TRANSPORT_MAX_MSG_BYTES,
                           "LINGER": 0}
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert plain.getsockopt(zmq.MECHANISM) == zmq.NULL  # no server key: no CURVE
        assert used == ["client.key_secret" if with_cert else "fresh"]
    finally:
        sock.close(0)
        plain.close(0)
        client.close()


# -- the I/O thread's timers, made deterministic: no HELLO and no polling period unless a
# -- test asks (module constants patched), so every wake-up has a cause the test controls.


def quiet(monkeypatch, active_s: float = 0.0, retry_s: float | None = None) -> None:
    """No HELLO timer once a HELLO went out (an hour), ``active_s`` of polling after
    telemetry, and ``retry_s`` between HELLOs that found no peer (None: as shipped; a
    test then waits for the first HELLO, after which no timer is left)."""
    monkeypatch.setattr(client_module, "HELLO_INTERVAL_S", 3600.0)
    if retry_s is not None:
        monkeypatch.setattr(client_module, "HELLO_RETRY_S", retry_s)
    monkeypatch.setattr(client_module, "_ACTIVE_S", active_s)


def one_round_per_wake(client: ControllerClient) -> None:
    """Asleep, one wake-up gives exactly one round of the I/O thread, then sleep again."""
    counters = client.counters
    wait_until(lambda: client._sleeping, "the I/O thread asleep")
    before = counters["io_wakeups"]
    client._wake()
    wait_until(lambda: counters["io_wakeups"] > before and client._sleeping, "one round")
    assert counters["io_wakeups"] == before + 1


def test_asleep_the_thread_wakes_once_per_cause(monkeypatch):
    quiet(monkeypatch)
    with connected(3600.0, monotonic=ManualClock()) as (router, client):
        identity, _ = router.receive()
        one_round_per_wake(client)  # the wake-up pipe is drained, not left ringing
        wait_until(lambda: client._sleeping, "asleep")
        client.send_telemetry(frame(1), 1, 1000.0)  # wakes it: no timer would
        router.telemetry()
        one_round_per_wake(client)
        router.answer(identity, 1)  # a decision wakes it too
        wait_until(lambda: client.counters["decisions"] == 1, "the decision taken")
        one_round_per_wake(client)
        assert client.counters["telemetry_sent"] == 1


def test_a_failed_hello_is_retried_after_the_retry_interval_not_at_once(monkeypatch):
    quiet(monkeypatch, retry_s=3600.0)
    client = ControllerClient(ipc(), HELLO, timeout_s=5.0)  # nobody there: HELLO fails
    try:
        # Round 1 looks (asleep for no time) before its HELLO; round 2 follows the failure.
        wait_until(lambda: client.counters["io_wakeups"] >= 2, "the round after the HELLO")
        one_round_per_wake(client)
    finally:
        client.close()


def test_while_serving_the_thread_polls_and_takes_decisions_unwoken(monkeypatch):
    quiet(monkeypatch, active_s=3600.0)  # serving from the first telemetry on
    with connected(3600.0, monotonic=ManualClock()) as (router, client):
        identity, _ = router.receive()
        client.send_telemetry(frame(1), 1, 1000.0)
        client.send_telemetry(frame(2), 2, 1000.0)
        router.telemetry()
        router.telemetry()
        assert not client._sleeping
        before = client.counters["io_wakeups"]
        wait_until(lambda: client.counters["io_wakeups"] >= before + 3, "polling rounds")
        router.answer(identity, 2)
        router.answer(identity, 2)  # a repeat: counted out of order
        wait_until(lambda: client.counters["decisions_out_of_order"] == 1, "both taken")
        assert client.counters["decisions"] == 1 and not client._sleeping
        assert client.counters["telemetry_sent"] == 2


def test_asleep_the_thread_wakes_for_the_timeout_deadline(monkeypatch):
    quiet(monkeypatch)
    clock = ManualClock()
    endpoint = ipc()
    router = Router(endpoint)
    # 50 ms on the decisions' clock: the thread sleeps until then (real time), looks at
    # the (manual) clock, and sleeps again while it has not moved.
    client = ControllerClient(endpoint, HELLO, timeout_s=0.05, monotonic=clock)
    try:
        router.receive()
        client.send_telemetry(frame(1), 1, clock())
        router.telemetry()
        clock.advance(0.0625)  # past the deadline; nothing wakes the thread but it
        wait_until(lambda: client.current is TIMED_OUT, "the deadline's wake-up")
        assert client.marker.mode == FALLBACK
    finally:
        client.close()
        router.close()


class _PollRecorder:
    """A poller that records the timeout it is given and reports no event."""

    def __init__(self) -> None:
        self.timeouts: list[int | None] = []

    def poll(self, timeout_ms: int | None) -> list:
        self.timeouts.append(timeout_ms)
        return []


def test_asleep_the_thread_polls_just_past_the_deadline_or_not_at_all(monkeypatch):
    """The I/O thread's sleep on its own (the thread not run, so no interleaving to
    force): it lasts until the first whole millisecond after the decisions' deadline, and
    not at all once the deadline has passed, or when telemetry or a close came in after
    the thread's last look (otherwise they would wait for the next timer)."""
    monkeypatch.setattr(ControllerClient, "_run", lambda self, hello: None)
    clock = ManualClock()
    client = ControllerClient(None, HELLO, timeout_s=0.9995, monotonic=clock)
    poller = _PollRecorder()
    try:
        client._age.sent(1, clock())  # deadline 999.5 ms away
        client._block(poller, None, client._wake_r, float("inf"))
        client._outbox.append((frame(2), 2, clock()))
        client._block(poller, None, client._wake_r, float("inf"))
        client._outbox.clear()
        client._stop = True
        client._block(poller, None, client._wake_r, float("inf"))
        client._stop = False
        clock.advance(1.5)  # 500.5 ms past the deadline
        client._block(poller, None, client._wake_r, float("inf"))
        assert poller.timeouts == [1000, 0, 0, 0]
    finally:
        client.close()
        client._context.term()  # _run, which would, did not run


def test_remote_decisions_and_wrong_kinds_are_each_counted(monkeypatch):
    with connected(5.0, local=LocalStandIn()) as (router, client):
        identity, _ = router.receive()
        for _ in range(2):
            router.answer(identity, 1)
            router.sock.send_multipart([identity, encode_hello(HELLO)])
        wait_until(lambda: client.counters["remote_decisions_ignored"] == 2
                   and client.counters["wire_error_kind"] == 2, "four frames")


def test_a_dead_io_thread_leaves_the_scheduler_thread_unblocked(caplog):
    clock = ManualClock()
    client = ControllerClient(None, HELLO, timeout_s=5.0, monotonic=clock)
    assert client.timeout_s == 5.0 and client.answered_step == -1
    assert client._thread.name == "specctl-client" and client._thread.daemon
    assert client._context.get(zmq.IO_THREADS) == 1
    assert not os.get_blocking(client._wake_r) and not os.get_blocking(client._wake_w)
    try:
        with caplog.at_level(logging.ERROR, logger="sglang_hooks.client"):
            client.send_telemetry(("not", "telemetry"), 1, clock())  # a bug's stand-in
            wait_until(lambda: not client._thread.is_alive(), "the I/O thread to stop")
        assert [r.getMessage() for r in caplog.records] == [
            "specctl: controller client thread stopped (fallback from now on)"]
        assert client.counters["client_thread_failed"] == 1
        # Nothing drains the outbox or the wake-up pipe now: both fill, neither blocks.
        for step in range(2, 302):
            client._sleeping = True  # as if asleep: every send writes a wake-up
            client.send_telemetry(frame(step), step, clock())
        assert len(client._outbox) == 256
        assert client.counters["telemetry_backlog_dropped"] == 300 - 256
        client.send_step(((1, 0.0, True, 1, 0, 1, 1, 1, 0, None, None, None, None), 1, [0],
                          0.0, None))
        assert len(client._outbox) == 256  # a step's values are bounded alike
        assert client.counters["telemetry_backlog_dropped"] == 300 - 256 + 1
        for _ in range(70_000):  # more than a pipe holds (64 KiB)
            client._wake()
    finally:
        client.close()
    assert not client._thread.is_alive()


def test_close_stops_the_thread_and_closes_the_pipe():
    client = ControllerClient(None, HELLO, timeout_s=5.0)
    fds = (client._wake_r, client._wake_w)
    client.close()
    assert not client._thread.is_alive()
    for fd in fds:
        with pytest.raises(OSError) as closed:
            os.fstat(fd)
        assert closed.value.errno == errno.EBADF
    client.close()  # a second close does nothing


def test_the_hooks_values_become_one_telemetry_frame():
    local = LocalStandIn()
    client = ControllerClient(None, HELLO, timeout_s=5.0, local=local,
                              monotonic=ManualClock())
    try:
        client.send_telemetry(("srv", 3, 14, 0.5, 2, 4, 5, 60, 100, 7, 2, [1, 2], 0.25), 14,
                              1000.0)
        wait_until(lambda: client.counters["local_decisions"] == 1, "a local decision")
        record = decode(local.frames[0])
        assert record.accepted_drafts.tolist() == [1, 2]
        assert (record.server, record.rank, record.step_index, record.time_s,
                record.batch_size, record.waiting_requests, record.running_requests,
                record.kv_used_tokens, record.kv_capacity_tokens, record.prefill_tokens,
                record.steps_used, record.step_latency_s) == (
                    "srv", 3, 14, 0.5, 2, 4, 5, 60, 100, 7, 2, 0.25)
    finally:
        client.close()


def test_a_step_as_read_becomes_its_telemetrys_frame_under_the_hellos_name():
    # send_step(step): the frame send_telemetry gives for telemetry_of(HELLO's server and
    # rank, step), aged from the step's result time.
    local = LocalStandIn()
    clock = ManualClock()
    client = ControllerClient(None, Hello("srv", 3, tuple(range(8))), timeout_s=5.0,
                              local=local, monotonic=clock)
    # The server's first step (no previous result: its latency runs from its launch).
    step = ((14, 999.5, True, 2, 4, 5, 100, 30, 10, None, None, None, None), 2, [1, 2],
            999.75, None)  # the clock reads 1000.0
    try:
        client.send_step(step)
        wait_until(lambda: client.counters["local_decisions"] == 1, "a local decision")
        # Aged as step 14's telemetry, queued at its result's time.
        assert client.answered_step == 14 and client.counters["decisions"] == 1
        client.send_telemetry(telemetry_of("srv", 3, step), 14, 999.75)
        wait_until(lambda: client.counters["local_decisions"] == 2, "two local decisions")
        assert local.frames[0] == local.frames[1]
        record = decode(local.frames[0])
        assert (record.server, record.rank, record.step_index, record.time_s,
                record.batch_size, record.waiting_requests, record.running_requests,
                record.kv_used_tokens, record.kv_capacity_tokens, record.prefill_tokens,
                record.steps_used, record.accepted_drafts.tolist(),
                record.step_latency_s) == ("srv", 3, 14, 999.5, 2, 4, 5, 60, 100, 0, 2,
                                           [1, 2], 0.25)
    finally:
        client.close()


def test_a_steps_warmup_flag_is_its_frames_18th_item_and_unknown_leaves_it_out():
    """telemetry_frame of a step as read: the flag (True, False) decodes as given, None
    sends the 17-item frame of a plugin before the flag (the daemon reads unknown)."""
    launch = (14, 999.5, True, 2, 4, 5, 100, 30, 10, None, None, None, None)
    for flag in (None, False, True):
        frame = telemetry_frame(*telemetry_of("srv", 3, (launch, 0, None, 999.75, None, flag)))
        assert frame[2] == (17 if flag is None else 18)
        assert decode(frame).warmup is flag


def test_the_io_thread_does_its_chores_after_telemetry_and_a_failing_one_is_counted(caplog):
    threads, calls = [], []

    def chore() -> None:
        threads.append(threading.current_thread().name)

    def failing() -> None:  # fails on its first call only
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug's stand-in")

    client = ControllerClient(None, HELLO, timeout_s=5.0, local=LocalStandIn(),
                              monotonic=ManualClock())
    try:
        with caplog.at_level(logging.ERROR, logger="sglang_hooks.client"):
            client.add_chore(failing)
            client.add_chore(chore)
            client.send_telemetry(("s", 0, 1, 0.0, 1, 0, 1, 0, 1, 0, 1, [0], 0.01), 1, 0.0)
            wait_until(lambda: len(calls) >= 2 and threads, "the chores, twice")
            assert client._thread.is_alive()  # a failing chore is not the thread's end
    finally:
        client.close()
    assert set(threads) == {"specctl-client"}
    assert client.counters["chore_failed"] == 1  # its one failure, counted once
    assert [r.getMessage() for r in caplog.records] == [  # and logged when it happened
        "specctl: a chore of the controller client's thread failed (counted)"]


def test_the_io_thread_asks_for_punctual_sleeps():
    """Linux ends the I/O thread's sleeps within 1 us of when asked (the slack is per
    thread: set on that thread, not on the scheduler's)."""
    import ctypes
    import threading

    try:
        prctl = ctypes.CDLL(None).prctl
    except AttributeError:
        pytest.skip("no prctl (not Linux)")
    get_slack = 30  # PR_GET_TIMERSLACK
    before = prctl(get_slack, 0, 0, 0, 0)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(
        (client_module._punctual_sleeps(), prctl(get_slack, 0, 0, 0, 0))))
    thread.start()
    thread.join()
    assert seen == [(True, client_module._TIMER_SLACK_NS)]
    assert prctl(get_slack, 0, 0, 0, 0) == before  # this thread's own is untouched


def test_the_io_threads_sleeps_get_a_microsecond_of_timer_slack(monkeypatch):
    """Linux's default 50 us of slack made a 0.1 ms look last ~190 us; the slack is per
    thread, so it is set and read on a thread of its own."""
    import ctypes
    import sys
    import threading

    if not sys.platform.startswith("linux"):
        pytest.skip("timer slack is a Linux prctl")
    seen = {}

    def on_a_thread():
        seen["set"] = client_module._punctual_sleeps()
        seen["slack_ns"] = ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK

    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join()
    assert seen == {"set": True, "slack_ns": client_module._TIMER_SLACK_NS}
    assert client_module._TIMER_SLACK_NS == 1000

    def no_libc(name):
        raise OSError("no such library")

    monkeypatch.setattr(client_module.ctypes, "CDLL", no_libc)
    monkeypatch.setattr(client_module.ctypes, "PyDLL", no_libc)
    assert client_module._punctual_sleeps() is False



# -- the serving look (while telemetry flows) ------------------------------------------------


def test_the_wake_up_pipe_ends_a_serving_look(monkeypatch):
    """The look interval is an hour: only the wake-up pipe can end the wait (a wake-up's,
    then close's)."""
    quiet(monkeypatch, active_s=3600.0)
    clock = ManualClock()
    with connected(3600.0, monotonic=clock, poll_s=3600.0) as (router, client):
        router.receive()  # HELLO
        client.send_telemetry(frame(1), 1, clock())  # from now on the thread is serving
        router.telemetry()
        looks = client.counters["io_wakeups"]
        client._wake()  # ends the look that follows the send, or the one it is in
        wait_until(lambda: client.counters["io_wakeups"] > looks, "the look ended")
        client.close()
        assert not client._thread.is_alive()


@pytest.mark.parametrize("plain", [False, True])
def test_a_serving_look_with_nothing_to_do_asks_zeromq_nothing(monkeypatch, plain):
    """EVENTS (a system call, with the GIL held) only after a send or once the socket's
    descriptor turned readable: not once per look (plain looks, for A/B runs: every
    look, as before)."""
    quiet(monkeypatch, active_s=3600.0)
    asked = Counter()
    get = zmq.Socket.get

    def counting_get(sock, option):
        if option == zmq.EVENTS:
            asked[threading.current_thread().name == "specctl-client"] += 1
        return get(sock, option)

    monkeypatch.setattr(zmq.Socket, "get", counting_get)
    clock = ManualClock()
    with connected(3600.0, monotonic=clock, poll_s=0.001, plain_looks=plain) as (router,
                                                                               client):
        router.receive()
        client.send_telemetry(frame(1), 1, clock())
        identity, _ = router.telemetry()
        router.answer(identity, 1)
        wait_until(lambda: client.counters["decisions"] == 1, "the decision taken")
        looks, before = client.counters["io_wakeups"], asked[True]
        wait_until(lambda: client.counters["io_wakeups"] >= looks + 40, "40 more looks")
        if plain:
            assert asked[True] - before >= 40
        else:
            assert asked[True] - before <= 2  # the old look asked once per look: 40


def test_fd_wait_wakes_on_a_readable_descriptor_and_says_which():
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    try:
        wait = client_module.FdWait([r1, r2])
        assert not wait.wait(0.0)
        os.write(w2, b"x")
        assert wait.wait(3600.0)  # at once: readable
        assert not wait.ready(0) and wait.ready(1)
        check = client_module.FdWait([r1], hold_gil=True)
        assert not check.wait(0.0)
        os.write(w1, b"x")
        assert check.wait(0.0) and check.ready(0)
        assert not client_module.FdWait([]).wait(0.0)  # nothing to watch: a sleep
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)


def test_fd_wait_without_ppoll_sleeps_and_calls_everything_maybe_readable(monkeypatch):
    def no_libc(*args, **kwargs):
        raise OSError("no libc")

    monkeypatch.setattr(client_module.ctypes, "CDLL", no_libc)
    monkeypatch.setattr(client_module.ctypes, "PyDLL", no_libc)
    slept = []
    monkeypatch.setattr(client_module.time, "sleep", slept.append)
    wait = client_module.FdWait([5, 6])
    assert wait.wait(0.25) and slept == [0.25]
    assert wait.ready(0) and wait.ready(1)
    assert client_module.FdWait([5], hold_gil=True).wait(0.0) and slept == [0.25]
    assert not client_module.FdWait([]).wait(0.5)


@pytest.mark.parametrize("held", [True, False])
def test_held_calls_send_and_receive_as_pyzmq_does(monkeypatch, held):
    """libzmq's own calls (the GIL kept), or pyzmq's where they cannot be found: frames
    both ways, and 'would block' as pyzmq says it."""
    if not held:
        def not_found(sock):
            raise LookupError("no extension")

        monkeypatch.setattr(client_module, "_pyzmq_extension", not_found)
    endpoint = ipc()
    router = Router(endpoint)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    lonely = zmq.Context.instance().socket(zmq.DEALER)
    lonely.setsockopt(zmq.LINGER, 0)
    lonely.setsockopt(zmq.IMMEDIATE, 1)
    lonely.connect(ipc())  # nobody there: a send would block
    try:
        calls = client_module.HeldCalls(sock)
        assert (calls._c is not None) == held
        sock.connect(endpoint)
        wait_until(lambda: calls.send(encode_hello(HELLO)), "connected")
        identity, hello = router.receive()
        assert hello == HELLO
        big = b"\x01" * 300_000
        router.sock.send_multipart([identity, big])
        wait_until(lambda: sock.get(zmq.EVENTS) & zmq.POLLIN, "the frame arrived")
        assert calls.recv() == big
        with pytest.raises(zmq.Again):
            calls.recv()
        assert client_module.HeldCalls(lonely).send(b"x") is False
    finally:
        sock.close(0)
        lonely.close(0)
        router.close()


@pytest.mark.parametrize(("options", "through_pyzmq"), [
    ({}, {"send"}), ({"held_send": True}, set()), ({"plain_looks": True}, {"send", "recv"}),
    ({"plain_looks": True, "held_send": True}, {"send", "recv"})])
def test_the_io_thread_receives_without_pyzmq_letting_go_of_the_gil(monkeypatch, options,
                                                                     through_pyzmq):
    """pyzmq's send and recv let go of the GIL (one more hand-over to the scheduler
    thread per frame): the I/O thread receives through libzmq itself, and sends too if
    asked (plain looks: pyzmq for both)."""
    used = Counter()
    for name in ("send", "recv"):
        original = getattr(zmq.Socket, name)

        def counting(sock, *args, _original=original, _name=name, **kwargs):
            used[_name, threading.current_thread().name] += 1
            return _original(sock, *args, **kwargs)

        monkeypatch.setattr(zmq.Socket, name, counting)
    clock = ManualClock()
    with connected(3600.0, monotonic=clock, **options) as (router, client):
        identity, _ = router.receive()  # HELLO
        client.send_telemetry(frame(1), 1, clock())
        assert router.telemetry()[1].step_index == 1
        router.answer(identity, 1)
        handled(client, 1)
        assert client.current.steps == (4,)
    assert {name for name, thread in used if thread == "specctl-client"} == through_pyzmq

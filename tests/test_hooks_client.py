"""The plugin's controller client: never blocks, ages decisions, falls back on silence;
its I/O thread builds the markers the scheduler thread attaches."""

from __future__ import annotations

import tempfile
import time
from collections import Counter

import numpy as np
import zmq

from controller.wire import DECISION_LAG, Decision, Hello, decode, encode_decision, encode_step
from env.schema import StepRecord
from sglang_hooks.client import TIMED_OUT, ControllerClient, DecisionAge, marker_for
from sglang_hooks.marker import CONTROLLER, FALLBACK

_SOCKETS = tempfile.mkdtemp(prefix="sc-")
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

    def receive(self, timeout_s: float = 5.0) -> tuple[bytes, object]:
        assert self.sock.poll(int(timeout_s * 1000)), "nothing received"
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


def settle(client: ControllerClient, seconds: float = 0.2) -> None:
    """Give the I/O thread time (it ages and publishes on its own)."""
    time.sleep(seconds)


def test_decisions_are_followed_until_the_controller_goes_quiet():
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=0.1)
    try:
        settle(client)
        _, hello = router.receive()
        assert hello == HELLO
        assert client.current is None  # nothing decided yet: local rule
        client.send_telemetry(frame(1), 1, time.monotonic())
        identity, record = router.telemetry()
        router.answer(identity, record.step_index)
        settle(client)
        decision = client.current
        assert isinstance(decision, Decision) and decision.steps == (4,)
        first = client.marker
        assert first.mode == CONTROLLER and first.steps == (4,) and first.seq == 1

        client.send_telemetry(frame(2), 2, time.monotonic())  # never answered
        settle(client, 0.05)
        assert client.current == decision  # within the timeout
        settle(client, 0.1)
        assert client.current is TIMED_OUT
        assert client.marker.mode == FALLBACK and client.marker.policy == ""
        assert client.marker.seq == 2

        client.send_telemetry(frame(3), 3, time.monotonic())
        router.telemetry()
        identity, record = router.telemetry()
        router.answer(identity, record.step_index, steps=6)
        settle(client)
        assert client.current.steps == (6,)  # resumed
        assert client.marker.steps == (6,) and client.marker.seq == 3
    finally:
        client.close()
        router.close()


def test_late_and_out_of_order_decisions_are_dropped():
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=0.05)
    try:
        settle(client)
        router.receive()
        for step in (1, 2):
            client.send_telemetry(frame(step), step, time.monotonic())
        identity, _ = router.telemetry()
        router.telemetry()
        time.sleep(0.08)
        router.answer(identity, 1)  # answers step 1, 80 ms after it was sent: stale
        settle(client, 0.05)
        assert client.counters["decisions_stale"] == 1
        assert client.current is TIMED_OUT
        client.send_telemetry(frame(3), 3, time.monotonic())
        router.telemetry()
        router.answer(identity, 3)
        router.answer(identity, 2)  # older than what was just accepted
        settle(client, 0.05)
        assert client.counters["decisions"] == 1
        assert client.counters["decisions_out_of_order"] == 1
        assert client.current.apply_from_step == 3 + DECISION_LAG
    finally:
        client.close()
        router.close()


def test_a_missing_controller_costs_nothing_and_means_fallback():
    client = ControllerClient(ipc(), HELLO, timeout_s=0.01)  # nobody listens there
    try:
        started = time.perf_counter()
        for step in range(10_000):
            client.send_telemetry(frame(step), step, time.monotonic())
        elapsed = time.perf_counter() - started
        assert elapsed < 1.0  # a few microseconds per step, never a blocked send
        time.sleep(0.05)  # let the I/O thread try what is queued
        counters = client.counters
        assert counters["telemetry_sent"] == 0
        assert counters["telemetry_dropped"] + counters["telemetry_backlog_dropped"] == 10_000
        assert client.current is TIMED_OUT
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


def test_markers_say_what_the_decision_says():
    marker = marker_for(Decision(1, 9, "p", (1, 64), (5, 2)))
    assert marker == (0, CONTROLLER, 9, (1, 64), (5, 2), "p")
    assert marker.steps_for(100) == 2
    assert marker_for(Decision.fallback(1, 9, "p")) == (0, FALLBACK, 0, (), (), "p")
    assert marker_for(TIMED_OUT).policy == ""


def test_the_same_decision_again_publishes_no_new_marker():
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=0.5)
    try:
        router.receive()
        for step in (1, 2, 3):
            client.send_telemetry(frame(step), step, time.monotonic())
            identity, record = router.telemetry()
            router.answer(identity, record.step_index, steps=4 if step < 3 else 5)
            settle(client, 0.05)
            if step == 1:
                first = client.marker
            if step == 2:
                assert client.marker is first  # same steps: nothing new for the ranks
        assert client.counters["decisions"] == 3
        assert client.marker.steps == (5,) and client.marker.seq == first.seq + 1
    finally:
        client.close()
        router.close()


def test_a_failed_io_thread_leaves_every_rank_on_the_fallback():
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=5.0)
    try:
        router.receive()
        client.send_telemetry(frame(1), 1, time.monotonic())
        identity, _ = router.telemetry()
        router.answer(identity, 1)
        settle(client, 0.05)
        assert client.marker.mode == CONTROLLER
        client.send_telemetry(("not", "telemetry"), 2, time.monotonic())  # a bug's stand-in
        settle(client, 0.05)
        assert client.counters["client_thread_failed"] == 1
        assert client.marker.mode == FALLBACK and client.current is TIMED_OUT
    finally:
        client.close()
        router.close()


def test_the_io_thread_sleeps_until_telemetry_or_a_decision_wakes_it():
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=0.1)
    try:
        router.receive()  # HELLO sent: the next one is a second away
        while not client._sleeping:
            time.sleep(0.001)
        asleep = client.counters["io_wakeups"]
        time.sleep(0.1)  # the old client woke every 1-10 ms here
        assert client.counters["io_wakeups"] == asleep
        client.send_telemetry(frame(1), 1, time.monotonic())
        identity, record = router.telemetry()  # sent at once, no polling interval
        assert record.step_index == 1
        router.answer(identity, 1)
        while client.counters["io_wakeups"] < asleep + 2:  # woken by the decision
            time.sleep(0.001)
        settle(client, 0.02)
        assert client.current.steps == (4,)
    finally:
        client.close()
        router.close()

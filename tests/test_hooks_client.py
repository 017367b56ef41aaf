"""The plugin's controller client: never blocks, ages decisions, falls back on silence."""

from __future__ import annotations

import time

import numpy as np
import zmq

from controller.wire import (
    DECISION_LAG,
    Decision,
    Hello,
    decode,
    encode_decision,
    encode_hello,
    encode_step,
)
from env.schema import StepRecord
from sglang_hooks.client import TIMED_OUT, ControllerClient
from sglang_hooks.testing import ManualClock, socket_dir, wait_until

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


def handled(client: ControllerClient, clock: ManualClock, decisions: int) -> None:
    """Wait until the scheduler thread's side has taken ``decisions`` decisions in all
    (accepted, stale or out of order): counted, never timed."""
    counters = client.counters

    def done() -> bool:
        client.poll(clock())
        return (counters["decisions"] + counters["decisions_stale"]
                + counters["decisions_out_of_order"]) >= decisions

    wait_until(done, f"{decisions} decisions")


# Over a real socket, on a manual clock: the clock moves only where a test says, so a
# loaded machine cannot push a step past the timeout.


def test_decisions_are_followed_until_the_controller_goes_quiet():
    clock = ManualClock()
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=0.1, monotonic=clock)
    try:
        _, hello = router.receive()
        assert hello == HELLO
        assert client.want(clock()) is None  # nothing decided yet: local rule
        client.send_telemetry(frame(1), 1, clock())
        identity, record = router.telemetry()
        clock.advance(0.01)
        router.answer(identity, record.step_index)
        handled(client, clock, 1)
        decision = client.want(clock())
        assert isinstance(decision, Decision) and decision.steps == (4,)

        client.send_telemetry(frame(2), 2, clock())  # never answered
        clock.advance(0.09)
        assert client.want(clock()) == decision  # within the timeout
        clock.advance(0.02)
        assert client.want(clock()) is TIMED_OUT

        client.send_telemetry(frame(3), 3, clock())
        router.telemetry()
        identity, record = router.telemetry()
        router.answer(identity, record.step_index, steps=6)
        handled(client, clock, 2)
        assert client.want(clock()).steps == (6,)  # resumed
    finally:
        client.close()
        router.close()


def test_late_and_out_of_order_decisions_are_dropped():
    clock = ManualClock()
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=0.05, monotonic=clock)
    try:
        router.receive()
        for step in (1, 2):
            client.send_telemetry(frame(step), step, clock())
        identity, _ = router.telemetry()
        router.telemetry()
        clock.advance(0.08)
        router.answer(identity, 1)  # answers step 1, 80 ms after it was sent: stale
        handled(client, clock, 1)
        assert client.counters["decisions_stale"] == 1
        assert client.want(clock()) is TIMED_OUT
        client.send_telemetry(frame(3), 3, clock())
        router.telemetry()
        router.answer(identity, 3)
        router.answer(identity, 2)  # older than what was just accepted
        handled(client, clock, 3)
        assert client.counters["decisions"] == 1
        assert client.counters["decisions_out_of_order"] == 1
        assert client.want(clock()).apply_from_step == 3 + DECISION_LAG
    finally:
        client.close()
        router.close()


def test_a_missing_controller_means_dropped_telemetry_and_fallback():
    """Never a blocked send (a blocked one would hang here); what it costs per step is
    measured in benchmarks/bench_online.py, not asserted here."""
    clock = ManualClock()
    client = ControllerClient(ipc(), HELLO, timeout_s=0.01, monotonic=clock)  # nobody there
    try:
        for step in range(10_000):
            client.send_telemetry(frame(step), step, clock())
            client.poll(clock())
        counters = client.counters
        wait_until(lambda: counters["telemetry_dropped"]
                   + counters["telemetry_backlog_dropped"] == 10_000, "every send dropped")
        assert counters["telemetry_sent"] == 0
        assert client.want(clock()) is None, "not overdue within the timeout"
        clock.advance(0.011)
        assert client.want(clock()) is TIMED_OUT
    finally:
        client.close()


# -- the timeout paths on the scheduler thread's side, with given clock values (fast) -----


def decision_for(step: int, steps: int = 4) -> Decision:
    return Decision(step, step + DECISION_LAG, "p", (1,), (steps,))


def offline_client(timeout_s: float = 0.1) -> ControllerClient:
    """A client with no controller behind it; decisions are handed in as the I/O thread
    would (``_inbox``), so every time below is a given number, not a measured one."""
    return ControllerClient(ipc(), HELLO, timeout_s=timeout_s)


def test_timeout_falls_back_and_only_a_fresh_decision_resumes():
    client = offline_client()
    try:
        assert client.want(100.0) is None  # nothing sent, nothing decided: local rule
        client.send_telemetry(b"", 1, 100.00)
        assert client.want(100.09) is None  # waiting, within the timeout
        client._inbox.append((decision_for(1), 100.02))
        client.poll(100.02)
        assert client.want(100.05).steps == (4,)
        client.send_telemetry(b"", 2, 100.03)  # never answered
        assert client.want(100.12).steps == (4,)  # 90 ms: still in charge
        assert client.want(100.14) is TIMED_OUT  # 110 ms: the controller is gone
        assert client.want(100.145) is TIMED_OUT  # and stays gone...
        client.send_telemetry(b"", 3, 100.15)
        assert client.want(100.16) is TIMED_OUT, "...step 2 is still unanswered"
        client._inbox.append((decision_for(3, steps=6), 100.16))
        client.poll(100.16)
        assert client.want(100.17).steps == (6,)  # ...until a fresh decision
        assert client.counters["decisions"] == 2
    finally:
        client.close()


def test_an_answer_later_than_the_timeout_is_stale_and_ignored():
    client = offline_client()
    try:
        client.send_telemetry(b"", 4, 9.99)
        client._inbox.append((decision_for(4), 10.0))
        client.poll(10.0)
        assert client.want(10.0).steps == (4,)
        client.send_telemetry(b"", 5, 10.0)  # the server's last step before it goes idle
        client._inbox.append((decision_for(5), 10.2))  # 200 ms after its telemetry
        client.poll(10.2)  # the source polls before it asks want(): nothing is overdue now
        assert client.counters["decisions_stale"] == 1
        assert client.want(10.2) is TIMED_OUT, "the older decision must not stay in charge"
    finally:
        client.close()


def test_out_of_order_and_unknown_step_answers_are_ignored():
    client = offline_client()
    try:
        for step in (6, 7):
            client.send_telemetry(b"", step, 1.0)
        client._inbox.append((decision_for(7), 1.01))
        client._inbox.append((decision_for(6), 1.01))  # older than what was accepted
        client._inbox.append((decision_for(99), 1.01))  # answers nothing sent
        client.poll(1.01)
        assert client.counters["decisions"] == 1
        assert client.counters["decisions_out_of_order"] == 1
        assert client.counters["decisions_stale"] == 1
        assert client.want(1.02).apply_from_step == 7 + DECISION_LAG
    finally:
        client.close()


def test_the_io_thread_sleeps_until_telemetry_or_a_decision_wakes_it():
    clock = ManualClock()
    endpoint = ipc()
    router = Router(endpoint)
    client = ControllerClient(endpoint, HELLO, timeout_s=0.1, monotonic=clock)
    try:
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
        handled(client, clock, 1)
        assert client.want(clock()).steps == (4,)
    finally:
        client.close()
        router.close()


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
        handled(client, clock, 1)
        assert client.counters["wire_error_garbage"] == 2
        assert client.counters["wire_error_kind"] == 1
        assert client.want(clock()).steps == (4,)
    finally:
        client.close()
        router.close()


def test_an_answer_exactly_at_the_timeout_is_still_fresh():
    client = offline_client(timeout_s=0.125)  # binary fractions: exact differences
    try:
        client.send_telemetry(b"", 1, 1.0)
        assert client.want(1.125) is None, "overdue only after the timeout"
        client._inbox.append((decision_for(1), 1.125))
        client.poll(1.125)
        assert client.counters["decisions"] == 1 and client.want(1.125).steps == (4,)
    finally:
        client.close()


def test_repeated_and_late_answers_are_each_counted():
    client = offline_client()
    try:
        for step in (1, 2, 3):
            client.send_telemetry(b"", step, 1.0)
        client._inbox.extend([(decision_for(2), 1.01), (decision_for(2), 1.01),  # twice
                              (decision_for(1), 1.01)])
        client.poll(1.01)
        assert client.counters["decisions"] == 1
        assert client.counters["decisions_out_of_order"] == 2, "a repeat is out of order"
        client.send_telemetry(b"", 4, 2.0)
        client.send_telemetry(b"", 5, 2.0)
        client._inbox.extend([(decision_for(3), 2.5), (decision_for(4), 2.5)])  # both stale
        client.poll(2.5)
        assert client.counters["decisions_stale"] == 2
    finally:
        client.close()

"""The source rank's connection to the controller: never blocks, never raises.

ZeroMQ calls cost microseconds to hundreds of microseconds (each may wake
ZeroMQ's own I/O thread), too much for the scheduler thread's per-step budget.
So the socket lives on a daemon thread of its own, and the scheduler thread
only appends telemetry to one deque and takes decisions from another; it never
waits. The I/O thread blocks in ``zmq.Poller`` (GIL released) on the socket and
on a wake-up pipe, with no timer but the next HELLO (at most
:data:`HELLO_INTERVAL_S`): it wakes when a decision arrives or when telemetry is
queued. Queuing writes one byte to the pipe only if the I/O thread is asleep
(one ``write`` per wake-up, never per message while it is busy sending).

The socket is a DEALER with ``ZMQ_IMMEDIATE`` (nothing is queued for a peer that
is not connected) and a small send high-water mark: a send that would block is
dropped and counted. ZeroMQ reconnects in the background. A telemetry message
left unanswered for longer than the timeout means the controller is gone or too
slow: :meth:`want` then says :data:`TIMED_OUT` until a fresh decision arrives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import zmq
import zmq.auth

from controller.wire import (
    DECISION_LAG,
    Decision,
    Hello,
    WireError,
    apply_socket_limits,
    decode,
    encode_hello,
    pack_telemetry,
)

log = logging.getLogger(__name__)

#: Returned by :meth:`ControllerClient.want` when the controller is overdue.
TIMED_OUT = "timed-out"
HELLO_INTERVAL_S = 1.0
HELLO_RETRY_S = 0.05
_SENT_WINDOW = 1024  # telemetry send times kept to age decisions
_OUTBOX_LIMIT = 256  # telemetry waiting for the I/O thread (then: dropped)


class ControllerClient:
    """Sends telemetry, receives decisions; every method is cheap and non-blocking.

    Args:
        endpoint: Controller address (``ipc://...`` or ``tcp://...``).
        hello: What to introduce this server as (resent every second, so a
            restarted controller learns it again).
        timeout_s: Longest a telemetry message may wait for its decision.
        curve_server_key: The controller's CURVE public key (Z85), or None.
        curve_client_cert: This client's CURVE certificate file (None: fresh keys).
        monotonic: The clock that stamps a decision's arrival; the same one as the
            ``now`` of the other methods (the socket's own timers use real time).
    """

    def __init__(self, endpoint: str, hello: Hello, timeout_s: float,
                 curve_server_key: str | None = None,
                 curve_client_cert: str | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._monotonic = monotonic
        self.counters: Counter[str] = Counter()
        self._sent: deque[tuple[int, float]] = deque(maxlen=_SENT_WINDOW)
        self._latest: Decision | None = None
        self._latest_answers = -1
        #: The controller missed the timeout; only a fresh decision clears this.
        self._overdue = False
        # Between the threads: deques (append/popleft are atomic), a flag and a pipe.
        self._outbox: deque[bytes | tuple] = deque()
        self._inbox: deque[tuple[Decision, float]] = deque(maxlen=_SENT_WINDOW)
        self._stop = False
        #: Set by the I/O thread before it blocks (then checks the outbox once more).
        self._sleeping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._context = zmq.Context(io_threads=1)
        self._sock = self._socket(endpoint, curve_server_key, curve_client_cert)
        self._thread = threading.Thread(target=self._run, args=(encode_hello(hello),),
                                        name="specctl-client", daemon=True)
        self._thread.start()

    # -- scheduler thread --------------------------------------------------------------

    def send_telemetry(self, payload: bytes | tuple, step_index: int, now: float) -> None:
        """Queue one telemetry message: a frame, or :func:`pack_telemetry`'s arguments."""
        self._sent.append((step_index, now))
        if len(self._outbox) >= _OUTBOX_LIMIT:  # the I/O thread is not keeping up
            self.counters["telemetry_backlog_dropped"] += 1
            return
        self._outbox.append(payload)
        if self._sleeping:
            self._wake()

    def poll(self, now: float) -> None:
        """Take the decisions the I/O thread received (latest wins)."""
        inbox = self._inbox
        while inbox:
            decision, received = inbox.popleft()
            self._accept(decision, received)

    def want(self, now: float) -> Decision | str | None:
        """What the ranks should run now: a decision, :data:`TIMED_OUT`, or None (no
        decision seen yet: keep the local rule)."""
        sent = self._sent
        if sent and now - sent[0][1] > self.timeout_s:
            self._latest = None  # only a fresh decision puts the controller back in charge
            self._overdue = True
        return TIMED_OUT if self._overdue else self._latest

    @property
    def answered_step(self) -> int:
        """The telemetry step the newest accepted decision answers (-1: none yet)."""
        return self._latest_answers

    def close(self) -> None:
        """Stop the I/O thread, close the socket (drops anything unsent)."""
        if self._stop:
            return
        self._stop = True
        self._wake()
        self._thread.join(5)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _wake(self) -> None:
        """Wake the I/O thread (a full pipe already holds a wake-up)."""
        self._sleeping = False
        with contextlib.suppress(OSError):  # BlockingIOError: a wake-up is pending already
            os.write(self._wake_w, b"\0")

    def _accept(self, decision: Decision, received: float) -> None:
        answers = decision.apply_from_step - DECISION_LAG
        if answers <= self._latest_answers:
            self.counters["decisions_out_of_order"] += 1
            return
        sent = self._sent
        sent_at = None
        while sent and sent[0][0] <= answers:
            step, t = sent.popleft()
            if step == answers:
                sent_at = t
        if sent_at is None or received - sent_at > self.timeout_s:
            # Answers a step we no longer wait for: too old to act on. If it answered
            # the last telemetry sent (the server went idle after that step), nothing
            # left in `sent` can show want() that the controller missed the timeout:
            # it must not leave an older decision in charge. (With newer telemetry
            # outstanding, want() ages that as usual.)
            self.counters["decisions_stale"] += 1
            if sent_at is not None and not sent:
                self._latest = None
                self._overdue = True
            return
        self._latest = decision
        self._overdue = False
        self._latest_answers = answers
        self.counters["decisions"] += 1

    # -- I/O thread ----------------------------------------------------------------------

    def _socket(self, endpoint: str, server_key: str | None, client_cert: str | None):
        sock = self._context.socket(zmq.DEALER)
        apply_socket_limits(sock)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.RCVHWM, 256)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if server_key:
            if client_cert:
                public, secret = zmq.auth.load_certificate(client_cert)
            else:
                public, secret = zmq.curve_keypair()
            sock.curve_serverkey = server_key.encode()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(endpoint)
        return sock

    def _run(self, hello: bytes) -> None:
        sock, counters, outbox, wake = self._sock, self.counters, self._outbox, self._wake_r
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        next_hello = 0.0
        try:
            while not self._stop:
                timeout_ms = max(0, int((next_hello - time.monotonic()) * 1e3) + 1)
                self._sleeping = True
                if outbox or self._stop:  # queued after the last send: do not block
                    timeout_ms = 0
                events = dict(poller.poll(timeout_ms))  # GIL released while blocked
                self._sleeping = False
                counters["io_wakeups"] += 1
                if wake in events:
                    self._drain_wake()
                if sock in events:
                    self._receive(sock)
                if not outbox and time.monotonic() < next_hello:
                    continue
                now = time.monotonic()
                if now >= next_hello:
                    try:
                        sock.send(hello, zmq.NOBLOCK)
                        next_hello = now + HELLO_INTERVAL_S
                    except zmq.Again:  # not connected (yet): try again soon
                        next_hello = now + HELLO_RETRY_S
                while outbox:
                    payload = outbox.popleft()
                    frame = payload if type(payload) is bytes else pack_telemetry(*payload)
                    try:
                        sock.send(frame, zmq.NOBLOCK)
                        counters["telemetry_sent"] += 1
                    except zmq.Again:
                        counters["telemetry_dropped"] += 1
        except Exception:  # never let a bug here go unnoticed, nor reach SGLang
            counters["client_thread_failed"] += 1
            log.exception("specctl: controller client thread stopped (fallback from now on)")
        finally:
            sock.close(linger=0)
            self._context.term()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _receive(self, sock) -> None:
        """Queue the decisions waiting on the socket (with their arrival time)."""
        counters = self.counters
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            frame = sock.recv(zmq.NOBLOCK)
            try:
                message = decode(frame)
            except WireError as exc:
                counters[f"wire_error_{exc.kind}"] += 1
                continue
            if type(message) is not Decision:
                counters["wire_error_kind"] += 1
                continue
            self._inbox.append((message, self._monotonic()))


def client_name(version: str) -> str:
    """How the plugin introduces itself in HELLO."""
    return f"specctl-plugin sglang={version} pid={os.getpid()}"

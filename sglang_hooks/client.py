"""The source rank's connection to the controller: never blocks, never raises.

ZeroMQ calls cost microseconds to hundreds of microseconds (each may wake
ZeroMQ's own I/O thread), too much for the scheduler thread's per-step budget.
So the socket lives on a daemon thread of its own, and so does everything else
that need not happen on the scheduler thread: making a step's telemetry from the
values the hooks read (:meth:`ControllerClient.send_step`,
:func:`sglang_hooks.raw_step.telemetry_of`) and packing it (the accepted drafts'
byte conversion included), ageing decisions (:class:`DecisionAge`), turning the
one in charge into the :class:`~sglang_hooks.marker.DecisionMarker` every rank
should apply, and other work handed to it (:meth:`ControllerClient.add_chore`:
the policy feeding SGLang's rule; :meth:`ControllerClient.add_marker_chore`: the
policy tabling each new marker's steps per batch size). The scheduler thread only
appends to one deque and reads one attribute (:attr:`ControllerClient.marker`); it never waits.

While telemetry flows (any in the last :data:`_ACTIVE_S`), the I/O thread looks
at the outbox and the socket every :data:`_POLL_S` (5 ms; 0.1 ms in local
decision mode, :data:`_LOCAL_POLL_S`; waiting with the GIL released in between),
so queuing telemetry costs the scheduler thread no system call. Each look holds
the GIL, so one with nothing to do is kept short: it asks ZeroMQ nothing unless
the socket's descriptor turned readable or the look sent something. Otherwise it
blocks in ``zmq.Poller`` on the socket and on a wake-up pipe, with no timer but
the next HELLO (at most :data:`HELLO_INTERVAL_S`) and, while telemetry awaits its answer, that
telemetry's deadline; the first telemetry after such a pause writes one byte to
the pipe (only if the I/O thread is asleep).

The socket is a DEALER with ``ZMQ_IMMEDIATE`` (nothing is queued for a peer that
is not connected) and a small send high-water mark: a send that would block is
dropped and counted. ZeroMQ reconnects in the background. A telemetry message
left unanswered for longer than the timeout means the controller is gone or too
slow: the marker then says "fall back" until a fresh decision arrives. If the
I/O thread itself fails, its last act is to publish that fallback marker.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import zmq
import zmq.auth

from controller.policy_file import PolicyFileError
from controller.wire import (
    DECISION_LAG,
    Decision,
    DecisionDecoder,
    Hello,
    PolicyPush,
    WireError,
    apply_socket_limits,
    decode,
    encode_hello,
    pack_telemetry,
    telemetry_bytes,
)
from sglang_hooks.marker import CONTROLLER, FALLBACK, DecisionMarker
from sglang_hooks.raw_step import telemetry_of

log = logging.getLogger(__name__)

#: What :meth:`DecisionAge.want` says when the controller is overdue.
TIMED_OUT = "timed-out"
HELLO_INTERVAL_S = 1.0
HELLO_RETRY_S = 0.05
_SENT_WINDOW = 1024  # telemetry send times kept to age decisions
_OUTBOX_LIMIT = 256  # telemetry waiting for the I/O thread (then: dropped)
#: While telemetry flows (some in the last _ACTIVE_S), the I/O thread looks at the outbox
#: and the socket every _POLL_S instead of being woken: a wake-up (a pipe write, waking a
#: thread) cost the scheduler thread about 8 us per step. A look costs the hooks nothing,
#: but it takes the GIL, and SGLang's own work on the scheduler thread waits for it: on
#: the H200 (runs 10-11, one lease, the same code, dense model at acceptance 3.5, static
#: depth 3) looks every 0.25 ms gave 431-447 tok/s at one client (TPOT 2.00-2.06 ms),
#: every 5 ms 475 (1.89 ms; run 9's code at 0.25 ms 473), and 2-5% more at 16 and 64
#: clients. A decision then waits up to a look longer (the controller's timeout is 100
#: ms; depth switches are at least 4 steps apart). SPECCTL_IO_POLL_US overrides it.
_POLL_S = 0.005
#: The same in local decision mode, where the look is the decision's whole wait (no
#: network round trip follows): 0.1 ms measured 507-536 us telemetry to decision (p50)
#: against 804-999 us at 0.25 ms, alternating runs on the shared 2-core machine (a
#: requested sleep there lasts 3-8x longer, so the look is rarer than asked either way).
_LOCAL_POLL_S = 0.0001
_ACTIVE_S = 0.5
#: The I/O thread's timer slack (ns): how late Linux may end its sleeps to batch wake-ups.
#: The default 50 us made a 0.1 ms look last 189 us (p50; 138 us at 1 us of slack).
_TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK = 29  # linux/prctl.h


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class FdWait:
    """Wait up to a given time for one of some descriptors to turn readable (Linux
    ``ppoll``: microsecond timeouts, no descriptor-number limit; ``select`` stops at
    1,024 and ``poll``/``epoll`` round up to milliseconds).

    ``hold_gil``: call it without letting go of the GIL (for a zero timeout: a check that
    takes about a microsecond, where letting go would let the scheduler thread take the
    GIL and make this thread wait for it back). Otherwise the GIL is released while
    waiting. Where ``ppoll`` is missing: ``time.sleep``, after which every descriptor
    counts as maybe readable.
    """

    def __init__(self, fds: list[int], hold_gil: bool = False) -> None:
        self._fds = (_PollFd * len(fds))(*(_PollFd(fd, 1, 0) for fd in fds))  # POLLIN
        self._timeout = _Timespec(0, 0)
        self._failed = False
        try:
            ppoll = (ctypes.PyDLL if hold_gil else ctypes.CDLL)(None).ppoll
        except (OSError, AttributeError):  # not Linux
            self._ppoll = None
            return
        ppoll.argtypes = (ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p)
        ppoll.restype = ctypes.c_int
        self._ppoll = ppoll
        self._args = (ctypes.addressof(self._fds), len(fds), ctypes.addressof(self._timeout),
                      None)

    def wait(self, seconds: float) -> bool:
        """Wait; True if a descriptor may be readable (or an error cut the wait short)."""
        ppoll = self._ppoll
        if ppoll is None:
            if seconds > 0:
                time.sleep(seconds)
            self._failed = True
            return len(self._fds) > 0
        self._timeout.tv_sec, self._timeout.tv_nsec = divmod(int(seconds * 1e9), 1_000_000_000)
        rc = ppoll(*self._args)
        self._failed = rc < 0  # EINTR: a signal; look at everything
        return rc != 0

    def ready(self, index: int) -> bool:
        """Whether the last wait found descriptor ``index`` (maybe) readable."""
        return self._failed or self._fds[index].revents != 0


class HeldCalls:
    """A socket's send and receive through libzmq's C calls without letting go of the GIL.

    pyzmq lets go of the GIL for every send and receive. On the I/O thread that hands
    the GIL to the scheduler thread, which then runs until its next release point while
    this thread waits to take it back: one more hand-over per frame, each of which the
    scheduler thread pays for when it wants the GIL back. A non-blocking receive is a few
    microseconds, cheaper held. (A send wakes ZeroMQ's own I/O thread, which on a busy
    host can take the core of a thread holding the GIL: ``pyzmq_send`` keeps pyzmq's.)
    The C functions are the ones pyzmq's own extension uses (looked up from it, so never
    another copy of libzmq); where that fails, pyzmq's calls.
    """

    def __init__(self, sock: zmq.Socket, pyzmq: bool = False, pyzmq_send: bool = False
                 ) -> None:
        self._sock = sock
        self._c = None
        #: Sends through pyzmq all the same (the default on the I/O thread, see client).
        self._pyzmq_send = pyzmq_send
        if pyzmq:  # asked for pyzmq's calls (A/B runs)
            return
        with contextlib.suppress(Exception):
            lib = ctypes.PyDLL(_pyzmq_extension(sock), use_errno=True)
            send, recv = lib.zmq_send, lib.zmq_msg_recv
            init, close, data, size = (lib.zmq_msg_init, lib.zmq_msg_close, lib.zmq_msg_data,
                                       lib.zmq_msg_size)
            send.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
            recv.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
            for f in (init, close, data, size):
                f.argtypes = (ctypes.c_void_p,)
            send.restype = recv.restype = init.restype = close.restype = ctypes.c_int
            data.restype, size.restype = ctypes.c_void_p, ctypes.c_size_t
            self._msg = (ctypes.c_uint64 * 8)()  # zmq_msg_t: 64 bytes, pointer-aligned
            self._c = (send, recv, init, close, data, size, sock.underlying,
                       ctypes.addressof(self._msg))

    def send(self, frame: bytes) -> bool:
        """Queue ``frame`` without blocking; False where pyzmq would raise ``zmq.Again``."""
        c = self._c
        if c is None or self._pyzmq_send:
            try:
                self._sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True
        while c[0](c[6], frame, len(frame), zmq.NOBLOCK) < 0:
            err = ctypes.get_errno()
            if err == errno.EAGAIN:
                return False
            if err != errno.EINTR:
                raise zmq.ZMQError(err)
        return True

    def recv(self) -> bytes:
        """The next frame (the caller has seen EVENTS say one is waiting)."""
        c = self._c
        if c is None:
            return self._sock.recv(zmq.NOBLOCK)
        _, recv, init, close, data, size, handle, msg = c
        init(msg)
        try:
            while recv(msg, handle, zmq.NOBLOCK) < 0:
                err = ctypes.get_errno()
                if err != errno.EINTR:
                    raise zmq.Again() if err == errno.EAGAIN else zmq.ZMQError(err)
            return ctypes.string_at(data(msg), size(msg))
        finally:
            close(msg)


def _pyzmq_extension(sock: zmq.Socket) -> str:
    """The file of pyzmq's compiled extension that defines ``sock``'s base class."""
    for cls in type(sock).__mro__:
        path = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
        if path.endswith(".so"):
            return path
    raise LookupError("pyzmq's extension module not found")


def _punctual_sleeps() -> bool:
    """Give the calling thread :data:`_TIMER_SLACK_NS` of timer slack (Linux ``prctl``);
    False where that is not available."""
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # not Linux
        return False
    return prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0) == 0


class DecisionAge:
    """Which telemetry awaits its answer, and which decision is in charge.

    Pure bookkeeping on given clock values (the client's I/O thread is its only user).

    Args:
        timeout_s: Longest a telemetry message may wait for its decision.
        counters: Where to count accepted, stale and out-of-order decisions.
    """

    def __init__(self, timeout_s: float, counters: Counter[str]) -> None:
        self.timeout_s = timeout_s
        self.counters = counters
        self._sent: deque[tuple[int, float]] = deque(maxlen=_SENT_WINDOW)
        self._latest: Decision | None = None
        self._latest_answers = -1
        #: The controller missed the timeout; only a fresh decision clears this.
        self._overdue = False

    @property
    def answered_step(self) -> int:
        """The telemetry step the newest accepted decision answers (-1: none yet)."""
        return self._latest_answers

    def sent(self, step_index: int, at: float) -> None:
        """Telemetry of ``step_index`` left (or was queued) at ``at``."""
        self._sent.append((step_index, at))

    def want(self, now: float) -> Decision | str | None:
        """What the ranks should run now: a decision, :data:`TIMED_OUT`, or None (no
        decision seen yet: keep the local rule)."""
        sent = self._sent
        if sent and now - sent[0][1] > self.timeout_s:
            self._latest = None  # only a fresh decision puts the controller back in charge
            self._overdue = True
        return TIMED_OUT if self._overdue else self._latest

    def deadline(self) -> float | None:
        """When :meth:`want` turns :data:`TIMED_OUT` unless an answer comes (None: never)."""
        if self._overdue or not self._sent:
            return None
        return self._sent[0][1] + self.timeout_s

    def accept(self, decision: Decision, received: float) -> None:
        """A decision that arrived at ``received``: in charge if fresh, else counted."""
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


def marker_for(want: Decision | str) -> DecisionMarker:
    """The marker (``seq`` 0) that makes every rank do what ``want`` says."""
    if want is TIMED_OUT or want.is_fallback:
        return DecisionMarker(0, FALLBACK, 0, policy="" if want is TIMED_OUT else want.policy)
    return DecisionMarker(0, CONTROLLER, want.apply_from_step, want.batch_grid, want.steps,
                          want.policy, want.unheld)


class ControllerClient:
    """Sends telemetry, receives decisions; every method is cheap and non-blocking.

    Args:
        endpoint: Controller address (``ipc://...`` or ``tcp://...``); None: no
            controller (local decisions only).
        hello: What to introduce this server as (resent every second, so a
            restarted controller learns it again).
        timeout_s: Longest a telemetry message may wait for its decision.
        curve_server_key: The controller's CURVE public key (Z85), or None.
        curve_client_cert: This client's CURVE certificate file (None: fresh keys).
        local: Local decision mode (:mod:`sglang_hooks.local`): each telemetry is
            answered on the I/O thread; the controller's answers are ignored.
        monotonic: The clock that ages decisions (their arrival, the timeout): the same
            one as the ``now`` given to :meth:`send_telemetry` (the socket's own timers,
            HELLO and the polling, use real time).
        poll_s: How often the I/O thread looks at the outbox and the socket while
            telemetry flows (default ``_POLL_S``, in local mode ``_LOCAL_POLL_S``): each
            look takes the GIL, which the scheduler thread's own work then waits for.
        plain_looks: Look as before the lean looks (EVENTS asked every look, pyzmq's
            send and receive, every decision through :func:`~controller.wire.decode`):
            for A/B measurements.
        held_send: Send through libzmq with the GIL kept too (receives always are, unless
            ``plain_looks``): for A/B measurements.
    """

    def __init__(self, endpoint: str | None, hello: Hello, timeout_s: float,
                 curve_server_key: str | None = None,
                 curve_client_cert: str | None = None, local: object = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 poll_s: float | None = None, plain_looks: bool = False,
                 held_send: bool = False) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._monotonic = monotonic
        self.counters: Counter[str] = Counter()
        #: The marker every rank should apply now (None: nothing decided yet), replaced
        #: (one attribute store) by the I/O thread whenever what it decides changes;
        #: ``seq`` increases with each.
        self.marker: DecisionMarker | None = None
        #: The I/O thread's latest view: a Decision, TIMED_OUT or None.
        self.current: Decision | str | None = None
        self._age = DecisionAge(timeout_s, self.counters)
        self._marker_key: tuple | None = None
        # Between the threads: a deque (append/popleft are atomic), a flag and a pipe.
        self._outbox: deque[tuple] = deque()
        self._stop = False
        #: Set by the I/O thread before it blocks (then checks the outbox once more).
        self._sleeping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._local = local
        self._poll_s = poll_s or (_POLL_S if local is None else _LOCAL_POLL_S)
        self._plain_looks = plain_looks
        self._held_send = held_send and not plain_looks
        self._held: HeldCalls | None = None  # the I/O thread's socket calls (set there)
        # A repeated decision (the same policy, grid and steps) is read without msgpack's
        # general path: the same result, a fraction of the time the GIL is held for it.
        self._decode = (functools.partial(decode, accept_policy=True) if plain_looks
                        else DecisionDecoder(accept_policy=True))
        #: Work the I/O thread does after each look's telemetry (add_chore).
        self._chores: list[Callable[[], None]] = []
        #: What the I/O thread does with each new marker before publishing it
        #: (add_marker_chore).
        self._marker_chores: list[Callable[[DecisionMarker], None]] = []
        self._context = zmq.Context(io_threads=1)
        self._sock = (self._socket(endpoint, curve_server_key, curve_client_cert)
                      if endpoint else None)
        self._thread = threading.Thread(target=self._run, args=(hello,),
                                        name="specctl-client", daemon=True)
        self._thread.start()

    @property
    def answered_step(self) -> int:
        """The telemetry step the newest accepted decision answers (-1: none yet)."""
        return self._age.answered_step

    # -- scheduler thread --------------------------------------------------------------

    def send_telemetry(self, payload: bytes | tuple, step_index: int, now: float) -> None:
        """Queue one telemetry message: a frame, or :func:`telemetry_frame`'s arguments."""
        outbox = self._outbox
        if len(outbox) >= _OUTBOX_LIMIT:  # the I/O thread is not keeping up
            self.counters["telemetry_backlog_dropped"] += 1
            return
        outbox.append((payload, step_index, now))
        if self._sleeping:
            self._wake()

    def send_step(self, step: tuple) -> None:
        """Queue one step's values as the hooks read them (:data:`raw_step.STEP_FIELDS`):
        the I/O thread makes its telemetry (:func:`~sglang_hooks.raw_step.telemetry_of`)
        under this client's server name and rank (its HELLO's)."""
        outbox = self._outbox
        if len(outbox) >= _OUTBOX_LIMIT:  # the I/O thread is not keeping up
            self.counters["telemetry_backlog_dropped"] += 1
            return
        outbox.append(step)
        if self._sleeping:
            self._wake()

    def add_chore(self, chore: Callable[[], None]) -> None:
        """Have the I/O thread call ``chore()`` after each look's telemetry (and before
        it blocks): work taken off the scheduler thread (the policy feeding SGLang's
        rule). An exception from it is counted (``chore_failed``), never fatal."""
        self._chores.append(chore)

    def add_marker_chore(self, chore: Callable[[DecisionMarker], None]) -> None:
        """Have the I/O thread call ``chore(marker)`` with each new marker before it
        publishes it (the policy tables the marker's steps per batch size, so that the
        scheduler thread only indexes them). An exception from it is counted
        (``marker_chore_failed``); the marker is published all the same."""
        self._marker_chores.append(chore)

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

    # -- I/O thread ----------------------------------------------------------------------

    def _publish(self, now: float) -> None:
        """Age the decisions; publish a new marker if what the ranks should run changed."""
        want = self._age.want(now)
        if want is self.current:
            return
        self.current = want
        if want is None:
            return
        marker = marker_for(want)
        if marker.key == self._marker_key:
            return
        self._marker_key = marker.key
        self._set_marker(marker)

    def _set_marker(self, marker: DecisionMarker) -> None:
        seq = self.marker.seq + 1 if self.marker is not None else 1
        marker = marker._replace(seq=seq)
        for chore in self._marker_chores:
            try:
                chore(marker)
            except Exception:
                counters = self.counters
                counters["marker_chore_failed"] += 1
                if counters["marker_chore_failed"] == 1:
                    log.exception("specctl: a marker chore of the controller client's thread "
                                  "failed (counted; the marker is published)")
        self.marker = marker  # one store: the scheduler thread reads it

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

    def _run(self, hello: Hello) -> None:
        _punctual_sleeps()  # this thread's looks come when asked (the slack is per thread)
        sock, counters, outbox, wake = self._sock, self.counters, self._outbox, self._wake_r
        age = self._age
        local = self._local
        poller = zmq.Poller()
        if sock is not None:
            poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        next_hello = 0.0 if sock is not None else float("inf")
        hello_frame, said = None, ""
        last_telemetry = -_ACTIVE_S
        # Between looks: the wake-up pipe (close() is not left waiting for a long look).
        pause = FdWait([wake])
        # ZeroMQ's notification descriptor: readable once the socket's state may have
        # changed (a decision arrived) until EVENTS is asked. A send may take in what
        # arrived without it turning readable, so after sending EVENTS is asked.
        arrived = (FdWait([sock.get(zmq.FD)], hold_gil=True)
                   if sock is not None and not self._plain_looks else None)
        # Sends through pyzmq unless asked (held_send): a send wakes ZeroMQ's own I/O
        # thread, and on a busy host the woken thread can take this one's core while it
        # holds the GIL (wall 68-300 us per held send against 10-25 us of CPU, measured
        # on the shared 2-core machine); a receive wakes nobody.
        self._held = held = (HeldCalls(sock, pyzmq=self._plain_looks,
                                       pyzmq_send=not self._held_send)
                             if sock is not None else None)
        try:
            while not self._stop:
                counters["io_wakeups"] += 1
                if time.monotonic() - last_telemetry < _ACTIVE_S:
                    # Serving: look every _POLL_S instead of being woken, so queuing
                    # telemetry costs the scheduler thread no system call. A look holds
                    # the GIL, which SGLang's work on the scheduler thread may then wait
                    # for: a look with nothing to do asks ZeroMQ nothing (EVENTS costs a
                    # few us, the descriptor's check one).
                    if pause.wait(self._poll_s):  # GIL released
                        self._drain_wake()
                    if sock is not None and (arrived is None or arrived.wait(0.0)):
                        self._receive(sock)  # (plain looks: EVENTS every look)
                else:
                    self._block(poller, sock, wake, next_hello)
                now = time.monotonic()
                sent = now >= next_hello
                if sent:
                    if hello_frame is None or (local is not None and local.digest != said):
                        # Local mode: the HELLO says which policy decides (the hub pushes
                        # its own when they differ).
                        said = local.digest if local is not None else ""
                        hello_frame = encode_hello(dataclasses.replace(hello,
                                                                       policy_digest=said))
                    # False: not connected (yet): try again soon
                    next_hello = now + (HELLO_INTERVAL_S if held.send(hello_frame)
                                        else HELLO_RETRY_S)
                while outbox:
                    # Per frame: telemetry queued after a check before the loop would be
                    # sent without the thread knowing that it is serving.
                    last_telemetry = now
                    sent = True
                    item = outbox.popleft()
                    if len(item) == 3:  # send_telemetry's (payload, step, queued)
                        payload, step, queued = item
                        frame = (payload if type(payload) is bytes
                                 else telemetry_frame(*payload))
                    else:  # send_step's values as read
                        telemetry = telemetry_of(hello.server, hello.rank, item)
                        step, queued = telemetry[2], item[3]
                        frame = telemetry_frame(*telemetry)
                    age.sent(step, queued)
                    if sock is not None:
                        if held.send(frame):
                            counters["telemetry_sent"] += 1
                        else:
                            counters["telemetry_dropped"] += 1
                    if local is not None:
                        self._decide_locally(frame)
                if sent and sock is not None:
                    self._receive(sock)  # what the sends took in (the descriptor won't say)
                for chore in self._chores:
                    try:
                        chore()
                    except Exception:
                        counters["chore_failed"] += 1
                        if counters["chore_failed"] == 1:
                            log.exception("specctl: a chore of the controller client's "
                                          "thread failed (counted)")
                self._publish(self._monotonic())
        except Exception:  # never let a bug here go unnoticed, nor reach SGLang
            counters["client_thread_failed"] += 1
            log.exception("specctl: controller client thread stopped (fallback from now on)")
            # Nothing will age decisions any more: every rank falls back, for good.
            self.current = TIMED_OUT
            self._set_marker(marker_for(TIMED_OUT))
        finally:
            if sock is not None:
                sock.close(linger=0)
            self._context.term()

    def _decide_locally(self, frame: bytes) -> None:
        counters = self.counters
        try:
            decision = self._local.decide(frame)
        except WireError as exc:  # what the daemon would have refused: no answer
            counters[f"local_wire_error_{exc.kind}"] += 1
            return
        except Exception:  # a bug in the decision: counted and logged once; the stream
            # starts afresh, as the daemon resets a stream that failed, and this step gets
            # no answer (it ages to the fallback). Local mode is not lost for good over it.
            counters["local_decide_failed"] += 1
            if counters["local_decide_failed"] == 1:
                log.exception("specctl: a local decision failed (counted; the stream "
                              "starts afresh)")
            self._local.restart()
            return
        counters["local_decisions"] += 1
        self._age.accept(decision, self._monotonic())

    def _install(self, push: PolicyPush) -> None:
        """A policy the hub pushed: local mode decides with it; remote mode has no use."""
        counters = self.counters
        if self._local is None:
            counters["policy_pushes_ignored"] += 1
            return
        try:
            installed = self._local.install(push)
        except PolicyFileError as exc:
            counters["policy_pushes_refused"] += 1
            log.error("specctl: the policy specctl-serve pushed is not valid, deciding with "
                      "the previous one: %s", exc)
            return
        if installed:
            counters["policy_pushes_installed"] += 1
            log.info("specctl: deciding with policy %r pushed by specctl-serve", push.name)
        else:
            counters["policy_pushes_unchanged"] += 1

    def _block(self, poller, sock, wake: int, next_hello: float) -> None:
        """Idle: sleep until a decision, a wake-up, the next HELLO or a deadline is due."""
        now = time.monotonic()
        wait_s = min(next_hello, now + HELLO_INTERVAL_S) - now  # inf: no controller
        deadline = self._age.deadline()
        if deadline is not None:
            # On the decisions' clock (the injected one): how long until it passes.
            wait_s = min(wait_s, deadline - self._monotonic())
        # +1 ms: the poll's resolution; want() needs the deadline passed.
        timeout_ms = max(0, int(wait_s * 1e3) + 1)
        self._sleeping = True
        if self._outbox or self._stop:  # queued after the last send: do not block
            timeout_ms = 0
        events = dict(poller.poll(timeout_ms))  # GIL released while blocked
        self._sleeping = False
        if wake in events:
            self._drain_wake()
        if sock in events:
            self._receive(sock)

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _receive(self, sock) -> None:
        """Take the decisions waiting on the socket (aged by their arrival time)."""
        counters = self.counters
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            frame = self._held.recv()
            try:
                message = self._decode(frame)
            except WireError as exc:
                counters[f"wire_error_{exc.kind}"] += 1
                continue
            if type(message) is PolicyPush:
                self._install(message)
                continue
            if type(message) is not Decision:
                counters["wire_error_kind"] += 1
                continue
            if self._local is not None:  # decided here: the hub's answer is not needed
                counters["remote_decisions_ignored"] += 1
                continue
            self._age.accept(message, self._monotonic())


def telemetry_frame(server: str, rank: int, step_index: int, time_s: float, batch_size: int,
                    waiting: int, running: int, kv_used: int, kv_capacity: int, prefill: int,
                    steps_used: int, accepted: object, latency_s: float,
                    warmup: bool | None = None,
                    before_prefill: bool | None = None) -> bytes:
    """One TELEMETRY frame from the values the hooks captured (``accepted``: SGLang's
    per-request accepted drafts, converted here, off the scheduler thread; ``warmup``:
    the re-entry warm-up flag, ``before_prefill`` whether a prefill was launched right
    after the step, each None where unknown)."""
    blob, total = telemetry_bytes(accepted, steps_used, batch_size)
    return pack_telemetry(server, rank, step_index, time_s, batch_size, waiting, running,
                          kv_used, kv_capacity, prefill, steps_used, blob, total, latency_s,
                          warmup, before_prefill)


def client_name(version: str) -> str:
    """How the plugin introduces itself in HELLO."""
    return f"specctl-plugin sglang={version} pid={os.getpid()}"

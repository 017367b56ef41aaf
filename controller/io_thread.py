"""ZeroMQ's I/O thread in the daemon: scheduled as a batch thread while polls are large.

Under the 128-stream flood a quarter of ``specctl-serve``'s CPU is ZeroMQ's I/O thread,
and most of that the kernel switching to it: every answer goes to another connection's
pipe, and each wakes the I/O thread, which (as a normal thread) preempts the daemon's
thread mid-poll, answer after answer. Linux's ``SCHED_BATCH`` policy makes a woken
thread wait for the running one instead of preempting it, so the I/O thread takes a
poll's answers in fewer, longer turns. Measured on the shared 2-core machine (load 5,
five alternating pairs, ``bench_throughput``): 17.2k -> 19.9k decisions per CPU-second
(median), and 8 servers x 1 kHz answered 88-94% -> 92-99.6%. But a lone answer then
waits for the running thread's turn to end: one server at 1 kHz went from 391-532 us
to 399-1,284 us (p50). So the policy follows the load: batch while polls carry many
answers, normal (preempting, prompt) once they have carried few for a while.

Linux only (``os.sched_setscheduler`` on the I/O thread's id, found by its thread name in
``/proc``: the context's own name prefix tells it from other contexts'); elsewhere, or
where the kernel refuses, it does nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import zmq

log = logging.getLogger(__name__)

#: Answers in a poll at which the I/O thread becomes a batch thread; it goes back to
#: normal once no poll has had that many for CALM_S seconds (a flood's polls alternate
#: large ones with stragglers: going back at the first small one flipped it 13 times a
#: second).
BATCH_AT = 8
CALM_S = 0.1
#: Each policy's context gets its own thread-name prefix (ZMQ_THREAD_NAME_PREFIX, an
#: integer in libzmq 4.3): its I/O thread is then "<prefix>/ZMQbg/IO/0", told apart from
#: every other context's in the process.
_PREFIXES = itertools.count(9000)


def io_thread_ids(prefix: str = "", pid: int | None = None) -> list[int]:
    """Ids of the threads of process ``pid`` (this one by default) whose name starts
    with ``prefix`` + "ZMQbg/IO/": ZeroMQ's I/O threads (libzmq 4.3 names them so)."""
    start = prefix + "ZMQbg/IO/"
    tasks = Path(f"/proc/{pid or os.getpid()}/task")
    ids = []
    try:
        for task in tasks.iterdir():
            try:
                name = (task / "comm").read_text().rstrip("\n")
            except OSError:  # the thread ended meanwhile
                continue
            # Linux keeps 15 characters of a thread's name.
            if name.startswith(start[:15]):
                ids.append(int(task.name))
    except OSError:  # no /proc
        return []
    return ids


class IoThreadPolicy:
    """Switches a ZeroMQ context's I/O threads between ``SCHED_BATCH`` and
    ``SCHED_OTHER`` with the number of answers per poll (:meth:`after_poll`).

    Create it before the context's first socket: it names the context's threads. They
    are looked up when first needed (ZeroMQ's thread names itself once it runs).
    """

    def __init__(self, context: zmq.Context, batch_at: int = BATCH_AT,
                 calm_s: float = CALM_S) -> None:
        if batch_at < 1 or calm_s < 0:
            raise ValueError(f"batch_at must be >= 1 and calm_s >= 0, got {batch_at}, {calm_s}")
        self.batch_at = batch_at
        self.calm_s = calm_s
        self.batch = False
        self.switches = 0
        self._last_large = 0.0
        number = next(_PREFIXES)
        self.prefix = f"{number}/"
        usable = hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH")
        try:
            context.set(zmq.THREAD_NAME_PREFIX, number)
        except (AttributeError, zmq.ZMQError):  # an older libzmq: leave it alone
            usable = False
        #: The threads switched (None: not looked up yet; empty: nothing to do).
        self.threads: list[int] | None = None if usable else []

    def after_poll(self, answers: int, now: float | None = None) -> None:
        """Batch from a poll of ``batch_at`` answers on; normal again once none has had
        that many for ``calm_s`` (``now``: ``time.monotonic()`` by default)."""
        if self.threads == []:
            return
        if answers >= self.batch_at:
            self._last_large = time.monotonic() if now is None else now
            if self.threads is None:
                self.threads = io_thread_ids(self.prefix)
            if not self.batch:
                self._set(True)
        elif self.batch:
            now = time.monotonic() if now is None else now
            if now - self._last_large > self.calm_s:
                self._set(False)

    def _set(self, batch: bool) -> None:
        policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
        try:
            for tid in self.threads:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError as exc:  # not permitted, or the thread is gone: stay as we are
            log.warning("cannot change ZeroMQ's I/O thread's scheduling (%s): left as it is",
                        exc)
            self.threads = []
            return
        self.batch = batch
        self.switches += 1

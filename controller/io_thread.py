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
answers, normal (preempting, prompt) while they carry few.

Linux only (``os.sched_setscheduler`` on the I/O thread's id, found by ZeroMQ's thread
name in ``/proc``); elsewhere, or where the kernel refuses, it does nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

#: ZeroMQ names its I/O threads so (``ZMQbg/IO/<n>``; libzmq 4.3).
_IO_THREAD_PREFIX = "ZMQbg/IO/"
#: Answers in a poll at which the I/O thread becomes a batch thread, and at or below
#: which it goes back to normal (apart, so that a load near one does not flip it each poll).
BATCH_AT = 8
NORMAL_AT = 2


def io_thread_ids(pid: int | None = None) -> list[int]:
    """The thread ids of ZeroMQ's I/O threads in process ``pid`` (this one by default)."""
    tasks = Path(f"/proc/{pid or os.getpid()}/task")
    ids = []
    try:
        for task in tasks.iterdir():
            try:
                if (task / "comm").read_text().startswith(_IO_THREAD_PREFIX):
                    ids.append(int(task.name))
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
    except OSError:  # no /proc
        return []
    return ids


class IoThreadPolicy:
    """Switches ZeroMQ's I/O threads between ``SCHED_BATCH`` and ``SCHED_OTHER`` with the
    number of answers per poll (:meth:`after_poll`). ``exclude``: the I/O threads that
    were there before the context was made (other contexts' in the same process). The
    context's own are looked up when first needed: ZeroMQ's thread names itself once it
    runs, which may be after the first socket is returned."""

    def __init__(self, exclude: set[int] | frozenset[int] = frozenset(),
                 batch_at: int = BATCH_AT, normal_at: int = NORMAL_AT) -> None:
        if normal_at >= batch_at:
            raise ValueError(f"normal_at ({normal_at}) must be below batch_at ({batch_at})")
        self.batch_at = batch_at
        self.normal_at = normal_at
        self.batch = False
        self.switches = 0
        self._exclude = frozenset(exclude)
        usable = hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH")
        #: The threads switched (None: not looked up yet; empty: nothing to do).
        self.threads: list[int] | None = None if usable else []

    def after_poll(self, answers: int) -> None:
        """Batch from ``batch_at`` answers in a poll on, normal again at ``normal_at``."""
        if self.threads is None and answers >= self.batch_at:
            self.threads = [t for t in io_thread_ids() if t not in self._exclude]
        if not self.threads:
            return
        if not self.batch and answers >= self.batch_at:
            self._set(True)
        elif self.batch and answers <= self.normal_at:
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

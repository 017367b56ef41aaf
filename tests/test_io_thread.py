"""The daemon's ZeroMQ I/O thread: batch-scheduled while polls are large."""

from __future__ import annotations

import os
import sys
import time

import pytest
import zmq

from controller.io_thread import IoThreadPolicy, io_thread_ids

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling")


@pytest.fixture
def context_threads():
    """A fresh context with a socket (its I/O thread running), and that thread's id."""
    before = set(io_thread_ids())
    context = zmq.Context(io_threads=1)
    sock = context.socket(zmq.DEALER)
    try:
        new: set[int] = set()
        for _ in range(500):  # the thread names itself once it runs: wait for it
            new = set(io_thread_ids()) - before
            if new or not sys.platform.startswith("linux"):
                break
            time.sleep(0.01)
        yield before, new
    finally:
        sock.close(linger=0)
        context.term()


@linux
def test_the_new_contexts_io_thread_is_found(context_threads):
    _, new = context_threads
    assert len(new) == 1


@linux
def test_the_policy_follows_the_answers_per_poll_with_hysteresis(context_threads):
    before, new = context_threads
    policy = IoThreadPolicy(exclude=before, batch_at=8, normal_at=2)
    (tid,) = new
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    policy.after_poll(7)
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    policy.after_poll(8)
    assert set(policy.threads) == new  # other contexts' threads are left alone
    assert os.sched_getscheduler(tid) == os.SCHED_BATCH
    policy.after_poll(3)  # between the two: stays batch
    assert os.sched_getscheduler(tid) == os.SCHED_BATCH
    policy.after_poll(2)
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    assert policy.switches == 2
    for tid_before in before:  # never touched
        assert os.sched_getscheduler(tid_before) == os.SCHED_OTHER


def test_thresholds_must_leave_a_gap():
    with pytest.raises(ValueError, match="normal_at"):
        IoThreadPolicy(batch_at=4, normal_at=4)


@linux
def test_a_refused_change_disables_it_instead_of_raising(context_threads, monkeypatch):
    before, _ = context_threads
    policy = IoThreadPolicy(exclude=before)

    def refuse(*args):
        raise PermissionError("not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    policy.after_poll(100)
    assert policy.threads == [] and not policy.batch

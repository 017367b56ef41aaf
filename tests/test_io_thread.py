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
def policy_and_thread():
    """A policy on a fresh context with a socket (its I/O thread running), that thread's
    id, and another context's I/O thread (which must be left alone)."""
    other = zmq.Context(io_threads=1)
    other_sock = other.socket(zmq.DEALER)
    context = zmq.Context(io_threads=1)
    policy = IoThreadPolicy(context, batch_at=8, calm_s=0.1)
    sock = context.socket(zmq.DEALER)
    try:
        ours: list[int] = []
        for _ in range(500):  # the thread names itself once it runs: wait for it
            ours = io_thread_ids(policy.prefix)
            if ours and set(io_thread_ids()) - set(ours):
                break
            time.sleep(0.01)
        yield policy, ours, set(io_thread_ids()) - set(ours)
    finally:
        sock.close(linger=0)
        other_sock.close(linger=0)
        context.term()
        other.term()


@linux
def test_the_contexts_own_io_thread_is_found(policy_and_thread):
    _, ours, others = policy_and_thread
    assert len(ours) == 1
    assert others  # the other context's, named without the prefix


@linux
def test_the_policy_follows_the_answers_per_poll(policy_and_thread):
    policy, (tid,), others = policy_and_thread
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    policy.after_poll(7, now=1.0)
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    policy.after_poll(8, now=1.0)
    assert policy.threads == [tid]
    assert os.sched_getscheduler(tid) == os.SCHED_BATCH
    policy.after_poll(1, now=1.05)  # a straggler right after: stays batch
    policy.after_poll(0, now=1.05)
    assert os.sched_getscheduler(tid) == os.SCHED_BATCH
    policy.after_poll(9, now=1.15)  # large again: calm counts from here
    policy.after_poll(1, now=1.2)
    assert os.sched_getscheduler(tid) == os.SCHED_BATCH
    policy.after_poll(1, now=1.3)  # none large for more than 0.1 s: normal
    assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    assert policy.switches == 2
    for other in others:  # other contexts' threads are never touched
        assert os.sched_getscheduler(other) == os.SCHED_OTHER


def test_nonsense_settings_are_refused():
    context = zmq.Context()
    try:
        with pytest.raises(ValueError, match="batch_at"):
            IoThreadPolicy(context, batch_at=0)
        with pytest.raises(ValueError, match="calm_s"):
            IoThreadPolicy(context, calm_s=-1.0)
    finally:
        context.term()


@linux
def test_a_refused_change_disables_it_instead_of_raising(policy_and_thread, monkeypatch):
    policy, _, _ = policy_and_thread

    def refuse(*args):
        raise PermissionError("not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    policy.after_poll(100)
    assert policy.threads == [] and not policy.batch

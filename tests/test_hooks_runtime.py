"""The plugin's per-process runtime, hook by hook: fast, no SGLang, no socket, no thread.

``tests/test_sglang_inside.py`` runs the same hooks inside a real SGLang (seconds per
test, too slow per mutant); here each hook is called directly with a stand-in
scheduler, an ``original`` that does what SGLang's method does to the state the hooks
read, and recording stand-ins for the controller client and the recorder, on a manual
clock (binary fractions: the latencies compare exactly).
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from types import SimpleNamespace

import pytest

from controller.wire import Hello
from sglang_hooks import raw_step
from sglang_hooks import runtime as runtime_module
from sglang_hooks.client import client_name
from sglang_hooks.compat import Ranks
from sglang_hooks.config import PluginConfig
from sglang_hooks.marker import CONTROLLER, FALLBACK, DecisionMarker, RuleMarker
from sglang_hooks.raw_step import request_copies, telemetry_of
from sglang_hooks.runtime import Runtime
from sglang_hooks.testing import DECODE, EXTEND, BatchStandIn, ManualClock, ReqStandIn

SOURCE = Ranks(0, 1, 0, 1, 0, False)
T0 = 1000.0


class ClientStandIn:
    """What the runtime uses of a ControllerClient: the marker, telemetry, counters."""

    def __init__(self) -> None:
        self.marker: DecisionMarker | None = None
        self.sent: list[tuple] = []
        self.raw: list[tuple] = []  # send_step's arguments
        self.server, self.rank = "srv", 0  # its HELLO's (the runtime's at start_source)
        self.counters: Counter[str] = Counter({"telemetry_sent": 7})
        self.closed = 0

    def send_telemetry(self, payload: tuple, step_index: int, now: float) -> None:
        self.sent.append((payload, step_index, now))

    def send_step(self, step: tuple) -> None:
        # What the client's I/O thread makes of it (the HELLO's server and rank: the
        # runtime's), recorded as send_telemetry's arguments.
        self.raw.append(step)
        telemetry = telemetry_of(self.server, self.rank, step)
        self.send_telemetry(telemetry, telemetry[2], step[3])

    def close(self) -> None:
        self.closed += 1


class RecorderStandIn:
    """What the runtime uses of a Recorder."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []
        self.arrivals: list[tuple] = []
        self.finishes: list[tuple] = []
        self.finished: list[list] = []
        self.counters: Counter[str] = Counter({"written": 3})
        self.closed = 0
        self.calls: Counter[str] = Counter()  # add_telemetry and add_finished
        self.prefill_lens: list[tuple | None] = []  # add_telemetry's, per step
        #: What the scheduler thread handed over: (step tuple or None, finished, count).
        self.handed: list[tuple] = []

    def add_step(self, *args: object) -> None:
        self.steps.append(args)

    def add_telemetry(self, telemetry: tuple, request_ids: object,
                      finished: list | None = None, prefill_lens: tuple | None = None) -> None:
        self.calls["add_telemetry"] += 1
        self._telemetry(telemetry, request_ids, finished, prefill_lens)

    def _telemetry(self, telemetry: tuple, request_ids: object, finished: list | None,
                   prefill_lens: tuple | None) -> None:
        # As add_step's arguments: the telemetry less server and rank, then the ids.
        self.prefill_lens.append(prefill_lens)
        self.steps.append((*telemetry[2:], request_ids))
        if finished is not None:  # as add_finished
            self.finished.append(finished)

    def add_step_values(self, step: tuple, finished: list | None = None,
                        count: int | None = None) -> None:
        # What the recorder's thread makes of it: add_telemetry's arguments.
        self.calls["add_step_values"] += 1
        self.handed.append((step, finished, count))
        requests, lens = request_copies(step)
        if finished is not None and count is not None:
            finished = finished[:count]
        self._telemetry(telemetry_of("srv", 0, step), requests, finished, lens)

    def add_arrival(self, *args: object) -> None:
        self.arrivals.append(args)

    def add_finish(self, *args: object) -> None:
        self.finishes.append(args)

    def add_finished(self, requests: list, count: int | None = None) -> None:
        self.calls["add_finished"] += 1
        self.handed.append((None, requests, count))
        self.finished.append(requests if count is None else requests[:count])

    def close(self) -> None:
        self.closed += 1


class Pool:
    def __init__(self, available: int, evictable: int) -> None:
        self._available, self._evictable = available, evictable

    def available_size(self) -> int:
        return self._available

    def evictable_size(self) -> int:
        return self._evictable


def scheduler(running: int = 4, waiting: int = 3, **extra: object) -> SimpleNamespace:
    """What the hooks read of SGLang's Scheduler: KV use is 10,000 - 6,000 - 1,000."""
    return SimpleNamespace(
        forward_ct=0, waiting_queue=[object()] * waiting,
        running_batch=BatchStandIn([ReqStandIn(f"r{i}") for i in range(running)], DECODE),
        max_total_num_tokens=10_000, token_to_kv_pool_allocator=Pool(6_000, 0),
        tree_cache=Pool(0, 1_000), **extra)


def source(clock: ManualClock, client: object = None, recorder: object = None,
           **cfg: object) -> Runtime:
    """A source-rank runtime, attached, with the given stand-ins."""
    rt = Runtime(PluginConfig(server="srv", **cfg), "test", ranks=SOURCE, monotonic=clock)
    rt._attached = True
    rt.is_source = True
    rt.client, rt.recorder = client, recorder
    return rt


def launch(rt: Runtime, sched: SimpleNamespace, batch: BatchStandIn, steps: int) -> object:
    """``run_batch`` through the hook; the policy reports ``steps`` as SGLang's would."""
    def run_batch(s, b):
        s.forward_ct += 1
        b.forward_iter = s.forward_ct
        rt.last_steps = steps
        return ("ran", b.forward_iter)
    return rt.around_run_batch(run_batch, sched, batch)


def finish(rt: Runtime, sched: SimpleNamespace, batch: BatchStandIn,
           accepted: list[int] | None = None) -> tuple:
    """``process_batch_result`` through the hook; returns (its result, verify_steps seen
    inside)."""
    seen = []

    def process(s, b):
        seen.append(rt.verify_steps)
        if accepted is not None:
            rt.on_verify(accepted)
        return ("processed", b.forward_iter)
    return rt.around_process_batch_result(process, sched, batch), seen[0]


def decode_batch(size: int) -> BatchStandIn:
    return BatchStandIn([ReqStandIn(f"q{i}") for i in range(size)], DECODE)


# -- telemetry of a step ------------------------------------------------------------------


def chosen(rt: Runtime, sched: SimpleNamespace, batch: BatchStandIn, asked: int) -> object:
    """``run_batch`` through the hook, the policy asked for ``asked`` and the off switch
    choosing what runs (as ``SpecctlAdaptiveParams.get_steps_for_batch`` does)."""
    def run_batch(s, b):
        s.forward_ct += 1
        b.forward_iter = s.forward_ct
        rt.last_steps = rt.offswitch.choose(asked)
        return ("ran", b.forward_iter)
    return rt.around_run_batch(run_batch, sched, batch)


#: In :func:`drive`'s plan: a pass of the scheduler loop that launches nothing.
IDLE = None


def drive(rt: Runtime, sched: SimpleNamespace, clock: ManualClock, overlap: bool,
          plan: list) -> None:
    """Each ``(batch, start)`` of ``plan`` launched by ``start(batch)`` and its result
    processed as SGLang's loop does: under overlap scheduling after the next step's launch
    (or an :data:`IDLE` pass), else right away; 1/64 s a step."""
    pending = None
    for item in plan:
        if item is not IDLE:
            batch, start = item
            start(batch)
        if pending is not None:
            finish(rt, sched, pending)
        pending = None if item is IDLE else batch
        if not overlap and pending is not None:
            finish(rt, sched, pending)
            pending = None
        if item is not IDLE:
            clock.advance(0.015625)
    if pending is not None:
        finish(rt, sched, pending)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_re_entry_warm_up_is_flagged_in_the_telemetry_and_no_other_step(overlap):
    """With the off path in use, the first step asked to speculate after an off step runs
    steps 0 and is sent with ``warmup`` True; off steps, extend steps and speculative steps
    False. Under overlap scheduling (step N+1 launched before N's result) the flag stays
    with its step."""
    clock = ManualClock(T0)
    client, recorder = ClientStandIn(), RecorderStandIn()
    rt = source(clock, client, recorder)
    rt.offswitch.ready = True
    sched = scheduler()
    # asked: 3 (speculates), 0 (off), 3 (the warm-up), 0 (off again right after it: not a
    # warm-up), an extend, 2 (the warm-up), 2, 2 (drafting), 0, 0; three times (more steps
    # than the runtime's ring holds: a slot's flag is its own step's).
    plan = [3, 0, 3, 0, None, 2, 2, 2, 0, 0] * 3
    drive(rt, sched, clock, overlap, [
        (BatchStandIn([ReqStandIn("e")], EXTEND), lambda b: launch(rt, sched, b, steps=-1))
        if asked is None else (decode_batch(2), lambda b, asked=asked: chosen(rt, sched, b, asked))
        for asked in plan])
    flags = [sent[0][13] for sent in client.sent]
    # (the second and third rounds start after off: their first step is a warm-up too)
    assert flags == [False, False, True, False, False, True, False, False, False, False] + [
        True, False, True, False, False, True, False, False, False, False] * 2
    assert [sent[0][10] for sent in client.sent] == [3, 0, 0, 0, 0, 0, 2, 2, 0, 0] + [
        0, 0, 0, 0, 0, 0, 2, 2, 0, 0] * 2
    assert [step[11] for step in recorder.steps] == flags  # the recorder's the same
    assert rt.counters["off_warmups"] == 8


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_whose_result_follows_a_prefills_launch_is_flagged_before_prefill(overlap):
    """Under overlap scheduling step N+1 is launched before N's result is processed: N
    is flagged ``before_prefill`` exactly when N+1 is an extend step (its latency carries
    that launch). Without overlap nothing is launched in between: never flagged. A step
    after an idle gap (no launch before its result) is not flagged either."""
    clock = ManualClock(T0)
    client, recorder = ClientStandIn(), RecorderStandIn()
    rt = source(clock, client, recorder)
    sched = scheduler()
    # d: decode, e: extend, "|": the loop idles (the pending result is processed with
    # nothing launched after it). More steps than the runtime's ring holds.
    plan = "ddeddeedd|ed|de" * 3
    drive(rt, sched, clock, overlap, [
        IDLE if item == "|" else
        (BatchStandIn([ReqStandIn("e")], EXTEND), lambda b: launch(rt, sched, b, steps=-1))
        if item == "e" else (decode_batch(2), lambda b: launch(rt, sched, b, steps=3))
        for item in plan])
    # Under overlap: the next launched step is an extend one, and no idle pass came between.
    runs = plan.replace("|", "")
    gaps = [i for i, run in enumerate(plan.split("|")) for _ in run]
    expected = [overlap and i + 1 < len(runs) and runs[i + 1] == "e" and gaps[i] == gaps[i + 1]
                for i in range(len(runs))]
    assert [sent[0][14] for sent in client.sent] == expected
    assert [step[12] for step in recorder.steps] == expected  # the recorder's the same
    assert sum(expected) == (12 if overlap else 0)  # counted by hand


def test_without_the_off_path_the_warmup_flag_is_unknown():
    """The off switch not built (SGLang's own steps=0 on every depth-0 step): the
    telemetry says nothing either way."""
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched = scheduler()
    for asked in (3, 0, 3, 3):
        batch = decode_batch(2)
        chosen(rt, sched, batch, asked)
        finish(rt, sched, batch)
    assert [sent[0][13] for sent in client.sent] == [None] * 4
    assert [sent[0][10] for sent in client.sent] == [3, 0, 3, 3]


def test_a_decode_steps_telemetry_carries_the_schedulers_load_and_the_drafts():
    clock = ManualClock(T0)
    client, recorder = ClientStandIn(), RecorderStandIn()
    rt = source(clock, client, recorder)
    rt.rank = client.rank = 2
    sched = scheduler()
    batch = decode_batch(4)
    assert launch(rt, sched, batch, steps=3) == ("ran", 1)
    clock.advance(0.015625)
    accepted = [1, 2, 0, 3]
    assert finish(rt, sched, batch, accepted) == (("processed", 1), 3)
    # The off path is not in use here (no GPU): whether a step was the warm-up is unknown;
    # nothing was launched after it (no prefill).
    payload = ("srv", 2, 1, T0, 4, 3, 4, 3_000, 10_000, 0, 3, accepted, 0.015625, None, False)
    assert client.sent == [(payload, 1, T0 + 0.015625)]
    assert recorder.steps == [(1, T0, 4, 3, 4, 3_000, 10_000, 0, 3, accepted, 0.015625, None,
                               False, batch.reqs)]
    # The launch's request list and the processed batch's, not copies (the recorder's
    # thread reads the ids of the first batch-size entries of one, finds the finished
    # requests among the first `count` of the other): no copy on the scheduler thread.
    [(step, finished, count)] = recorder.handed
    assert step[0][10] is batch.reqs and step[0][3] == 4
    assert finished is batch.reqs and count == 4
    assert recorder.finished == [batch.reqs]
    # Processed once: processing the same batch again sends nothing more.
    finish(rt, sched, batch, accepted)
    assert len(client.sent) == 1 and len(recorder.steps) == 1


@pytest.mark.parametrize(("extend_tokens", "reqs", "prefill"),
                         [(100, 2, 100), (None, 2, 2), (0, 2, 2), (None, 0, 1)])
def test_an_extend_step_counts_its_prefill_its_requests_as_running_and_no_drafts(
        extend_tokens, reqs, prefill):
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched = scheduler(running=4, waiting=0)
    batch = BatchStandIn([ReqStandIn(f"e{i}") for i in range(reqs)], EXTEND, extend_tokens)
    launch(rt, sched, batch, steps=3)  # what the policy said does not make it a draft step
    clock.advance(0.25)
    finish(rt, sched, batch)
    [(payload, step, _)] = client.sent
    assert step == 1
    # (batch size, waiting, running, prefill, steps used, accepted)
    assert payload[4:7] == (reqs, 0, 4 + reqs) and payload[9:12] == (prefill, 0, None)


def test_a_decode_step_the_policy_did_not_see_reports_no_steps():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched, batch = scheduler(running=0), decode_batch(1)
    sched.running_batch = None  # nothing running before this batch
    launch(rt, sched, batch, steps=-1)
    finish(rt, sched, batch)
    assert client.sent[0][0][6] == 0 and client.sent[0][0][10] == 0


def test_an_idle_batch_or_a_broken_runtime_sends_nothing():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched = scheduler()
    idle = BatchStandIn([], SimpleNamespace(is_decode=lambda: False, is_extend=lambda: False))
    launch(rt, sched, idle, steps=0)
    finish(rt, sched, idle)
    rt._broken = True
    batch = decode_batch(2)
    launch(rt, sched, batch, steps=2)
    finish(rt, sched, batch)
    assert client.sent == []
    assert rt.counters["unmatched_results"] == 2


def test_latency_runs_from_the_previous_result_unless_the_server_sat_idle(monkeypatch):
    monkeypatch.setattr(raw_step, "IDLE_GAP_S", 0.0625)
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched = scheduler()
    first, second, third, fourth = (decode_batch(1) for _ in range(4))
    launch(rt, sched, first, 1)
    clock.advance(0.25)
    launch(rt, sched, second, 1)  # overlap: launched before the first result
    clock.advance(0.25)
    finish(rt, sched, first)  # first step: from its launch
    clock.advance(0.125)
    finish(rt, sched, second)  # from the previous result, not from its launch
    clock.advance(0.0625)  # a gap of exactly _IDLE_GAP_S: not idle yet
    launch(rt, sched, third, 1)
    clock.advance(0.03125)
    finish(rt, sched, third)
    clock.advance(0.125)  # idle: the next step starts at its own launch
    launch(rt, sched, fourth, 1)
    clock.advance(0.03125)
    finish(rt, sched, fourth)
    assert [sent[0][12] for sent in client.sent] == [0.5, 0.125, 0.09375, 0.03125]


def test_the_idle_gap_is_fifty_milliseconds():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched = scheduler()
    batches = [decode_batch(1) for _ in range(3)]
    launch(rt, sched, batches[0], 1)
    clock.advance(0.125)
    finish(rt, sched, batches[0])
    clock.advance(0.046875)  # below 50 ms: one step
    launch(rt, sched, batches[1], 1)
    clock.advance(0.015625)
    finish(rt, sched, batches[1])
    clock.advance(0.0625)  # above 50 ms: idle
    launch(rt, sched, batches[2], 1)
    clock.advance(0.015625)
    finish(rt, sched, batches[2])
    assert [sent[0][12] for sent in client.sent] == [0.125, 0.0625, 0.015625]


def test_a_steps_finished_requests_go_to_the_recorder_with_its_telemetry():
    # One call per step on the scheduler thread; a result without telemetry to send (here
    # the same batch processed again) still hands its requests over alone.
    clock = ManualClock(T0)
    recorder = RecorderStandIn()
    rt = source(clock, ClientStandIn(), recorder)
    sched, batch = scheduler(), decode_batch(2)
    launch(rt, sched, batch, 2)
    finish(rt, sched, batch, [1, 2])
    assert recorder.calls == {"add_step_values": 1}
    assert recorder.finished == [batch.reqs]
    finish(rt, sched, batch, [1, 2])
    assert recorder.calls == {"add_step_values": 1, "add_finished": 1}
    assert recorder.finished == [batch.reqs, batch.reqs]
    assert recorder.handed[1] == (None, batch.reqs, 2) and recorder.handed[1][1] is batch.reqs


def test_requests_appended_to_a_batchs_list_later_are_not_the_steps():
    # The recorder's thread reads the lists after the hooks returned; SGLang 0.5.15's
    # merge_batch may have extended a batch's list in place by then (appending is the only
    # change in place SGLang makes: sglang_hooks.contract.APPEND_ONLY). The step's ids and
    # finished requests are those it had when the hooks saw it.
    clock = ManualClock(T0)
    recorder = RecorderStandIn()
    rt = source(clock, None, recorder)
    sched, batch = scheduler(), decode_batch(2)
    launch(rt, sched, batch, 2)
    finish(rt, sched, batch, [1, 2])
    finish(rt, sched, batch, [1, 2])  # processed again: the finished requests alone
    late = ReqStandIn("late")
    late.finished_reason = "length"
    batch.reqs.append(late)  # merged after the result
    [(step, finished, count), (_, again, count_again)] = recorder.handed
    requests, _ = request_copies(step)  # as the recorder's thread reads them, now
    assert [r.rid for r in requests] == ["q0", "q1"]
    assert finished[:count] == again[:count_again] == batch.reqs[:2]


def test_only_the_recorder_gets_the_step_without_a_client():
    clock = ManualClock(T0)
    recorder = RecorderStandIn()
    rt = source(clock, None, recorder)
    sched, batch = scheduler(), decode_batch(1)
    batch.reqs[0].finished_reason = "length"
    batch.reqs[0].output_ids = [5, 6, 7]
    launch(rt, sched, batch, 2)
    finish(rt, sched, batch, [2])
    assert [s[0] for s in recorder.steps] == [1]
    assert recorder.finished == [batch.reqs]  # the recorder's thread finds q0 finished


def test_a_result_of_a_step_launched_before_attach_is_counted_not_sent():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    batch = decode_batch(1)
    batch.forward_iter = 5
    result, verify = finish(rt, scheduler(), batch)
    assert result == ("processed", 5) and verify == -1
    assert rt.counters["unmatched_results"] == 1 and client.sent == []


def test_a_launch_over_an_unsent_slot_is_counted():
    clock = ManualClock(T0)
    rt = source(clock, ClientStandIn())
    sched = scheduler()
    launch(rt, sched, decode_batch(1), 1)
    sched.forward_ct = 16  # step 17 shares the ring slot of step 1, never processed
    launch(rt, sched, decode_batch(1), 1)
    assert rt.counters["telemetry_overwritten"] == 1
    launch(rt, sched, decode_batch(1), 1)
    assert rt.counters["telemetry_overwritten"] == 1


def test_a_follower_runs_the_hooks_but_never_sends():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    rt.is_source = False
    sched, batch = scheduler(), decode_batch(1)
    launch(rt, sched, batch, 4)
    assert finish(rt, sched, batch, [1]) == (("processed", 1), 4)
    assert client.sent == [] and rt.counters == Counter()


def test_hooks_take_the_batch_as_a_keyword_too():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched, batch = scheduler(), decode_batch(1)

    def run_batch(s, batch):
        s.forward_ct += 1
        batch.forward_iter = s.forward_ct
        rt.last_steps = 2
        return "ran"

    assert rt.around_run_batch(run_batch, sched, batch=batch) == "ran"
    assert rt.around_process_batch_result(lambda s, batch: "done", sched, batch=batch) == "done"
    assert client.sent[0][0][10] == 2 and rt.counters == Counter()


def test_drafts_reported_outside_a_result_are_not_sent_with_the_next_step():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched, batch = scheduler(), decode_batch(2)
    launch(rt, sched, batch, 2)
    rt.on_verify([1, 2])  # no batch result being processed: nothing to attach it to
    finish(rt, sched, batch)
    rt.on_verify([2, 2])  # after the result
    assert client.sent[0][0][11] is None and rt.counters == Counter()
    second = decode_batch(2)
    launch(rt, sched, second, 2)
    finish(rt, sched, second)
    assert client.sent[1][0][11] is None


def test_a_scheduler_without_forward_ct_still_runs_its_batch():
    rt = source(ManualClock(T0), ClientStandIn())
    assert rt.around_run_batch(lambda s, b: "ran", SimpleNamespace(), decode_batch(1)) == "ran"
    assert rt.counters["fault_run_batch"] == 1 and rt.counters["faults"] == 1


def test_a_batch_without_forward_iter_still_gets_its_result_processed():
    rt = source(ManualClock(T0), ClientStandIn())
    rt.verify_steps = 3
    batch = SimpleNamespace(reqs=[])
    assert rt.around_process_batch_result(lambda s, b: "done", scheduler(), batch) == "done"
    assert rt.verify_steps == -1 and rt.counters["fault_result"] == 1


def test_a_launch_that_cannot_be_read_is_counted_and_the_batch_runs():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched = scheduler()
    del sched.tree_cache
    batch = decode_batch(1)
    assert launch(rt, sched, batch, 1) == ("ran", 1)
    assert rt.counters["fault_launch"] == 1
    assert finish(rt, sched, batch)[0] == ("processed", 1)
    assert client.sent == []


def test_a_failing_send_is_counted_after_the_result():
    clock = ManualClock(T0)
    client = ClientStandIn()
    client.send_step = None  # not callable: the send raises
    rt = source(clock, client)
    sched, batch = scheduler(), decode_batch(1)
    launch(rt, sched, batch, 1)
    assert finish(rt, sched, batch)[0] == ("processed", 1)
    assert rt.counters["fault_result"] == 1


def test_faults_are_counted_per_site_logged_once_and_turn_the_controller_off(caplog):
    rt = source(ManualClock(T0), ClientStandIn())
    with caplog.at_level(logging.ERROR, logger="sglang_hooks.runtime"):
        for _ in range(3):
            rt.fault("pull", ValueError("x"))
        rt.fault("launch", KeyError("y"))
    assert rt.counters["fault_pull"] == 3 and rt.counters["fault_launch"] == 1
    assert rt.counters["faults"] == 4
    assert [r.getMessage() for r in caplog.records] == [
        "specctl: error in pull (counted, SGLang unaffected)",
        "specctl: error in launch (counted, SGLang unaffected)"]
    assert caplog.records[0].exc_info[0] is ValueError
    for _ in range(runtime_module._MAX_FAULTS - 5):
        rt.fault("pull", ValueError("x"))
    assert not rt._broken  # 999 faults
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="sglang_hooks.runtime"):
        rt.fault("pull", ValueError("x"))
        rt.fault("pull", ValueError("x"))
    assert rt._broken and rt.counters["faults"] == 1001
    assert [r.getMessage() for r in caplog.records] == [
        "specctl: 1000 errors; the controller is ignored from now on (every rank falls "
        "back to the 'sglang' rule)"]


def test_the_fault_limit_is_a_thousand():
    assert runtime_module._MAX_FAULTS == 1000


# -- markers: what the source attaches, when every rank applies them -----------------------


def marker(seq: int, mode: str = CONTROLLER, apply_from: int = 3, steps: int = 5,
           policy: str = "p") -> DecisionMarker:
    return DecisionMarker(seq, mode, apply_from, (1,), (steps,) if mode == CONTROLLER else (),
                          policy)


def test_the_source_announces_its_rule_once_then_attaches_each_new_marker_once():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client, fallback="table", table=((1, 3),), explore_dwell=5,
                min_switch_steps=6)
    pulled: list = []
    assert rt.after_pull_raw_reqs(pulled) is None
    assert pulled == [RuleMarker("table", ((1, 3),), 5, 6)]
    rt.after_pull_raw_reqs(pulled)
    assert len(pulled) == 1  # no marker yet, no second announcement
    client.marker = marker(1)
    rt.after_pull_raw_reqs(pulled)
    rt.after_pull_raw_reqs(pulled)  # the same marker object: attached once
    assert pulled[1:] == [marker(1)]
    client.marker = marker(2, FALLBACK, 0, policy="")  # the controller timed out
    rt.after_pull_raw_reqs(pulled)
    client.marker = marker(3, FALLBACK, 0, policy="p")  # the controller said: fall back
    rt.after_pull_raw_reqs(pulled)
    assert pulled[2:] == [marker(2, FALLBACK, 0, policy=""), marker(3, FALLBACK, 0)]
    assert rt.counters["markers_controller"] == 1 and rt.counters["markers_fallback"] == 2
    assert rt.counters["timeouts"] == 1


def test_nothing_is_attached_to_no_pull_or_off_the_source():
    clock = ManualClock(T0)
    client = ClientStandIn()
    client.marker = marker(1)
    rt = source(clock, client)
    assert rt.after_pull_raw_reqs(None) is None
    rt.is_source = False
    pulled: list = []
    rt.after_pull_raw_reqs(pulled)
    assert pulled == [] and not rt._announced
    rt.is_source = True
    rt.client = None
    rt.after_pull_raw_reqs(pulled)
    assert pulled == [rt.local]  # the rule only: no client, no marker


def test_a_pull_result_that_cannot_take_a_marker_is_a_fault():
    rt = source(ManualClock(T0), ClientStandIn())
    assert rt.after_pull_raw_reqs(()) is None
    assert rt.counters["fault_pull"] == 1


def test_a_broken_runtime_sends_one_last_fallback_if_the_controller_was_in_charge():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    pulled: list = []
    client.marker = marker(4)
    rt.after_pull_raw_reqs(pulled)
    rt._broken = True
    client.marker = marker(5)  # ignored from now on
    rt.after_pull_raw_reqs(pulled)
    rt.after_pull_raw_reqs(pulled)
    assert pulled[1:] == [marker(4), DecisionMarker(5, FALLBACK, 0)]
    assert rt.counters["timeouts"] == 1


@pytest.mark.parametrize("last", [None, DecisionMarker(2, FALLBACK, 0, policy="p")])
def test_a_broken_runtime_not_under_the_controller_attaches_nothing(last):
    rt = source(ManualClock(T0), ClientStandIn())
    rt._announced = True
    rt._last_marker = last
    rt._broken = True
    pulled: list = []
    rt.after_pull_raw_reqs(pulled)
    assert pulled == []


def test_a_marker_applies_from_its_step_and_a_fallback_hands_back_to_the_rule():
    clock = ManualClock(T0)
    rt = source(clock, None)
    sched = scheduler()
    applied = []
    rt.before_process_input_requests(sched, [marker(1, apply_from=3)])
    for _ in range(4):
        launch(rt, sched, decode_batch(1), 2)
        applied.append(rt.controller)
    assert applied == [None, None, marker(1, apply_from=3), marker(1, apply_from=3)]
    assert rt._pending is None
    rt.before_process_input_requests(sched, [marker(2, FALLBACK, 6)])
    launch(rt, sched, decode_batch(1), 2)
    assert rt.controller == marker(1, apply_from=3)  # step 5: not yet
    launch(rt, sched, decode_batch(1), 2)
    assert rt.controller is None  # step 6: the local rule again


def test_an_announced_rule_replaces_the_local_one_and_attach_happens_once():
    rt = Runtime(PluginConfig(server="t"), "test", ranks=Ranks(1, 2, 0, 1, 0, False),
                 follower=True)
    assert rt.local is None  # a follower: SGLang's own until the source speaks
    assert rt.before_process_input_requests(SimpleNamespace(), []) is None
    assert rt._attached and rt.rank == 1
    rule = RuleMarker("explore", (), 2, 1)
    reqs = [rule]
    rt.before_process_input_requests(SimpleNamespace(), reqs)
    assert rt.local == rule and reqs == []


def test_a_marker_in_a_tuple_given_as_a_keyword_comes_back_as_a_keyword():
    rt = source(ManualClock(T0), None)
    sched = SimpleNamespace()
    req = ReqStandIn("a")
    args, kwargs = rt.before_process_input_requests(sched, recv_reqs=(req, marker(1)))
    assert args == (sched,) and kwargs == {"recv_reqs": [req]}


def test_the_trimmer_runs_when_the_depth_run_changes(monkeypatch):
    rt = source(ManualClock(T0), None)
    trims = []
    rt.trimmer = SimpleNamespace(trim=lambda: trims.append(rt.launch_step))
    sched = scheduler()
    for steps in (3, 3, 4, -1, 4, 0):
        launch(rt, sched, decode_batch(1), steps)
    assert trims == [1, 3, 5, 6]
    rt.trimmer = SimpleNamespace(trim=None)
    launch(rt, sched, decode_batch(1), 2)
    assert rt.counters["fault_trim"] == 1


def test_the_trimmer_compares_with_the_step_before_across_the_rings_wrap():
    """The depth run is compared with the previous step's, also where the step's ring
    slot is the first (its previous step's is the ring's last)."""
    rt = source(ManualClock(T0), None)
    trims = []
    rt.trimmer = SimpleNamespace(trim=lambda: trims.append(rt.launch_step))
    sched = scheduler()
    ring = len(rt._ran)
    changes = {ring: 4, 2 * ring + 1: 5}  # at the wrap, and one step past the next
    for step in range(1, 3 * ring + 1):
        launch(rt, sched, decode_batch(1), changes.get(step, 3))
    assert trims == [1, ring, ring + 1, 2 * ring + 1, 2 * ring + 2]


# -- arrivals and finished requests (record mode) -------------------------------------------


def test_arrivals_are_recorded_with_their_prompt_length_batches_included():
    clock = ManualClock(T0)
    recorder = RecorderStandIn()
    rt = source(clock, None, recorder)
    one = SimpleNamespace(rid="a", input_ids=[1, 2, 3])
    batch = SimpleNamespace(batch=[SimpleNamespace(rid="b", input_ids=[1]),
                                   SimpleNamespace(rid="c", input_ids=[])])
    skipped = [SimpleNamespace(rid=7, input_ids=[1]), SimpleNamespace(rid="d"), object()]
    reqs = [one, batch, *skipped]
    assert rt.before_process_input_requests(SimpleNamespace(), reqs) is None
    assert recorder.arrivals == [("a", T0, 3), ("b", T0, 1), ("c", T0, 0)]
    rt.is_source = False
    rt.before_process_input_requests(SimpleNamespace(), [one])
    assert len(recorder.arrivals) == 3


def test_an_arrival_that_cannot_be_recorded_is_a_fault():
    recorder = RecorderStandIn()
    recorder.add_arrival = None
    rt = source(ManualClock(T0), None, recorder)
    rt.before_process_input_requests(SimpleNamespace(), [SimpleNamespace(rid="a",
                                                                         input_ids=[1])])
    assert rt.counters["fault_arrivals"] == 1


# -- the periodic summary -------------------------------------------------------------------


def test_the_summary_is_logged_every_minute_from_the_second_result_on(caplog):
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client, RecorderStandIn())
    rt.counters["markers_controller"] = 2
    client.counters = Counter()  # no telemetry count: the steps below send theirs

    def step() -> None:
        batch = decode_batch(1)
        launch(rt, scheduler(), batch, 1)
        finish(rt, scheduler(), batch)
        rt.after_pull_raw_reqs([])  # pulls say nothing

    with caplog.at_level(logging.INFO, logger="sglang_hooks.runtime"):
        step()  # the first: sets the clock, says nothing
        clock.advance(59.5)
        step()
        assert caplog.records == []
        clock.advance(0.5)  # exactly a minute
        step()
        rt.controller = marker(1)
        clock.advance(60.0)
        step()
    expected = str({"markers_controller": 2, "recorder_written": 3})
    assert [r.getMessage() for r in caplog.records] == [
        f"specctl: {expected}; applied=sglang", f"specctl: {expected}; applied=controller"]


def test_the_summary_without_client_or_recorder_has_the_runtimes_counters():
    clock = ManualClock(T0)
    rt = source(clock, None)
    rt.counters["x"] = 1
    rt._next_summary = T0
    logged = []
    rt_log = runtime_module.log
    original = rt_log.info
    rt_log.info = lambda *args: logged.append(args)
    try:
        rt._summary(T0)
    finally:
        rt_log.info = original
    assert logged == [("specctl: %s; applied=%s", {"x": 1}, "sglang")]
    assert rt._next_summary == T0 + 60.0


# -- wiring: attach, the source's client and recorder, close --------------------------------


class Built:
    """Records the arguments a monkeypatched constructor was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args: object, **kwargs: object) -> SimpleNamespace:
        self.calls.append((args, kwargs))
        return SimpleNamespace(close=lambda: None, counters=Counter())


def test_the_source_builds_its_client_with_the_servers_hello(monkeypatch):
    built = Built()
    monkeypatch.setattr(runtime_module, "ControllerClient", built)
    cfg = PluginConfig(server="srv", controller="ipc:///nowhere", timeout_s=0.25,
                       curve_server_key="K", curve_client_cert="C", io_poll_s=0.002)
    clock = ManualClock(T0)
    rt = Runtime(cfg, "9.9", ranks=Ranks(0, 2, 0, 1, 1, False), monotonic=clock)
    rt.policy = SimpleNamespace(candidate_steps=[0, 1, 3])
    rt.attach(SimpleNamespace())
    assert rt.is_source and rt.rank == 2 and rt.recorder is None
    [(args, kwargs)] = built.calls
    assert args == ("ipc:///nowhere", Hello("srv", 2, (0, 1, 3), client_name("9.9")), 0.25,
                    "K", "C", None)
    assert kwargs == {"monotonic": clock, "poll_s": 0.002, "plain_looks": False,
                      "held_send": False}


def test_local_mode_builds_the_local_decisions_from_the_policy_file(monkeypatch):
    import sglang_hooks.local

    built, local = Built(), Built()
    monkeypatch.setattr(runtime_module, "ControllerClient", built)
    monkeypatch.setattr(sglang_hooks.local, "LocalDecisions", local)
    cfg = PluginConfig(server="srv", policy="/p.npz", profile="/prof.yaml", probe=False,
                       guard=True)
    rt = Runtime(cfg, "test", ranks=SOURCE)
    rt.policy = SimpleNamespace(candidate_steps=(0, 2))
    rt.start_source()
    # SPECCTL_PROBE=0, SPECCTL_GUARD=1
    assert local.calls == [(("/p.npz", (0, 2), "/prof.yaml", False, True), {})]
    [(args, _)] = built.calls
    assert args[0] is None and args[1].candidate_steps == (0, 2)
    assert args[5] is not None and args[5] is not local.calls  # the LocalDecisions built


def test_record_explore_records_without_a_client(monkeypatch):
    import sglang_hooks.recorder

    built, recorder = Built(), Built()
    monkeypatch.setattr(runtime_module, "ControllerClient", built)
    monkeypatch.setattr(sglang_hooks.recorder, "start_recorder", recorder)
    cfg = PluginConfig(server="srv", controller="ipc:///nowhere", record_dir="/rec",
                       record_explore=True, explore_dwell=3, record_flush_s=2.5)
    rt = Runtime(cfg, "7.0", ranks=SOURCE)
    rt.start_source()  # no policy object: no candidates
    assert built.calls == [] and rt.client is None and rt.is_source
    assert recorder.calls == [(("/rec", "srv", 0, 2.5), {"meta": {
        "sglang_version": "7.0", "rule": "explore", "explore_dwell": 3,
        "candidate_steps": [], "controller": "ipc:///nowhere"}})]
    assert rt.recorder is not None


def test_no_controller_and_no_policy_means_no_client():
    rt = Runtime(PluginConfig(server="srv"), "test", ranks=SOURCE)
    rt.start_source()
    assert rt.client is None and rt.recorder is None and rt.is_source


@pytest.mark.parametrize(("ranks", "policy", "warning"), [
    (Ranks(0, 1, 0, 1, 0, False), None, "does not run --speculative-adaptive"),
    (Ranks(1, 2, 0, 1, 0, False), None, None),
    (Ranks(0, 1, 0, 2, 0, False), object(), "pipeline parallelism"),
    (Ranks(0, 1, 0, 1, 0, True), object(), "pipeline parallelism"),
    (Ranks(1, 2, 0, 2, 0, False), object(), None),
    (Ranks(1, 2, 0, 1, 0, False), object(), None),
])
def test_only_tp_rank_0_of_a_supported_layout_with_a_policy_becomes_the_source(
        ranks, policy, warning, caplog, monkeypatch):
    monkeypatch.setattr(runtime_module, "ControllerClient", Built())
    rt = Runtime(PluginConfig(server="srv", controller="ipc:///x"), "test", ranks=ranks)
    rt.policy = policy
    with caplog.at_level(logging.WARNING, logger="sglang_hooks.runtime"):
        rt.attach(SimpleNamespace())
    assert not rt.is_source and rt.client is None and rt.rank == ranks.world_rank
    messages = [r.getMessage() for r in caplog.records]
    assert (messages == []) if warning is None else (len(messages) == 1
                                                      and warning in messages[0])


def test_a_follower_never_becomes_the_source():
    rt = Runtime(PluginConfig(server="srv", controller="ipc:///x"), "test",
                 ranks=SOURCE, follower=True)
    rt.policy = object()
    rt.attach(SimpleNamespace())
    assert not rt.is_source and rt.client is None and rt._attached


@pytest.mark.parametrize(("port", "expected"), [(30001, "-30001"), (None, "")])
def test_a_source_without_a_configured_name_is_named_after_host_and_port(port, expected,
                                                                           monkeypatch):
    monkeypatch.setattr(runtime_module, "ControllerClient", Built())
    rt = Runtime(PluginConfig(), "test", ranks=SOURCE)
    rt.policy = SimpleNamespace(candidate_steps=())
    rt.attach(SimpleNamespace(server_args=SimpleNamespace(port=port)))
    assert rt.server == socket.gethostname() + expected and rt.is_source


def test_a_configured_name_wins():
    rt = Runtime(PluginConfig(server="mine"), "test", ranks=SOURCE)
    rt.policy = SimpleNamespace(candidate_steps=())
    rt.attach(SimpleNamespace(server_args=SimpleNamespace(port=1)))
    assert rt.server == "mine"


def test_a_failed_attach_is_a_fault_and_leaves_no_source(monkeypatch):
    def no_ranks(scheduler, version):
        raise RuntimeError("no parallel state")

    monkeypatch.setattr(runtime_module, "read_ranks", no_ranks)
    rt = Runtime(PluginConfig(server="srv"), "test")
    rt.is_source = True
    rt.attach(SimpleNamespace())
    assert rt.counters["fault_attach"] == 1 and not rt.is_source and rt._attached


def test_ranks_are_read_from_the_scheduler_once(monkeypatch):
    reads = []
    monkeypatch.setattr(runtime_module, "read_ranks",
                        lambda s, v: reads.append(v) or Ranks(1, 2, 0, 1, 0, False))
    rt = Runtime(PluginConfig(server="srv"), "0.5.23")
    rt.attach(SimpleNamespace())
    rt.attach(SimpleNamespace())
    assert reads == ["0.5.23"] and rt.rank == 1


def test_a_runtime_with_a_policy_gets_the_processes_trimmer(monkeypatch):
    trimmer = object()
    monkeypatch.setattr(runtime_module.OverridesLogTrimmer, "for_this_process",
                        classmethod(lambda cls: trimmer))
    with_policy = Runtime(PluginConfig(server="srv"), "test", ranks=Ranks(1, 2, 0, 1, 0, False))
    with_policy.policy = object()
    with_policy.attach(SimpleNamespace())
    without = Runtime(PluginConfig(server="srv"), "test", ranks=Ranks(1, 2, 0, 1, 0, False))
    without.attach(SimpleNamespace())
    assert with_policy.trimmer is trimmer and without.trimmer is None


def test_close_stops_the_client_the_recorder_and_the_timing(tmp_path):
    client, recorder = ClientStandIn(), RecorderStandIn()
    rt = source(ManualClock(T0), client, recorder, hook_timing=str(tmp_path / "t"))
    rt.close()
    assert client.closed == 1 and recorder.closed == 1 and rt.client is None
    assert not rt.is_source
    assert (tmp_path / f"t.{os.getpid()}.json").is_file()  # the timing's last write
    rt.close()  # again: nothing left to close twice
    assert client.closed == 1


def test_the_hook_table_names_sglangs_methods_and_hook_types(tmp_path):
    rt = source(ManualClock(T0), None)
    table = rt.hook_table()
    assert table == {
        "_pull_raw_reqs": (rt.after_pull_raw_reqs, "AFTER"),
        "process_input_requests": (rt.before_process_input_requests, "BEFORE"),
        "run_batch": (rt.around_run_batch, "AROUND"),
        "process_batch_result": (rt.around_process_batch_result, "AROUND"),
    }
    assert rt.clock is None


def test_with_hook_timing_every_hook_is_timed_and_each_launch_ends_a_step(tmp_path):
    clock = ManualClock(T0)
    rt = source(clock, None, hook_timing=str(tmp_path / "timing"))
    try:
        assert rt.clock.path == f"{tmp_path / 'timing'}.{os.getpid()}.json"
        table = rt.hook_table()
        assert [kind for _, kind in table.values()] == ["AFTER", "BEFORE", "AROUND", "AROUND"]
        assert all(hook != getattr(rt, name) for (hook, _), name in zip(
            table.values(), ["after_pull_raw_reqs", "before_process_input_requests",
                             "around_run_batch", "around_process_batch_result"], strict=True))
        sched = scheduler()
        run_batch = table["run_batch"][0]

        def original(s, b):
            s.forward_ct += 1
            b.forward_iter = s.forward_ct
            return "ran"

        assert run_batch(original, sched, decode_batch(1)) == "ran"
        table["process_input_requests"][0](sched, [])
        launch(rt, sched, decode_batch(1), 1)
        assert rt.clock.total_steps == 2
    finally:
        rt.close()


# -- what the first mutation run found unchecked ----------------------------------------------


def record_faults(rt: Runtime) -> list[tuple[str, str]]:
    """(site, exception type) of every fault the runtime reports (still counted)."""
    seen: list[tuple[str, str]] = []
    count = rt.fault

    def fault(where: str, exc: BaseException) -> None:
        seen.append((where, type(exc).__name__))
        count(where, exc)

    rt.fault = fault
    return seen


def test_a_fresh_runtime_knows_nothing_yet():
    rt = Runtime(PluginConfig(server="srv", off_path="decode"), "test")
    assert (rt.verify_steps, rt.launch_step, rt.last_steps) == (-1, 0, -1)
    assert rt.is_source is False and rt.follower is False and rt.controller is None
    assert rt.offswitch.counters is rt.counters and rt.offswitch.build is True
    other = Runtime(PluginConfig(server="srv", off_path="sglang"), "test", follower=True)
    assert other.offswitch.build is False and other.follower is True
    # A prefill while off skips the draft's extend unless SPECCTL_OFF_PREFILL=draft.
    assert rt.offswitch.skip_prefill is True
    drafting = Runtime(PluginConfig(server="srv", off_prefill="draft"), "test")
    assert drafting.offswitch.skip_prefill is False
    rt.attach_policy("the policy")
    assert rt.policy == "the policy"


def test_a_broken_runtime_that_never_attached_a_marker_attaches_nothing():
    rt = source(ManualClock(T0), ClientStandIn())
    rt._announced = True
    rt._broken = True
    pulled: list = []
    rt.after_pull_raw_reqs(pulled)
    assert pulled == [] and rt.counters == Counter()


def test_timeouts_and_overwrites_add_up():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    for seq in (1, 2):
        client.marker = marker(seq, FALLBACK, 0, policy="")
        rt.after_pull_raw_reqs([])
    assert rt.counters["timeouts"] == 2
    sched = scheduler()
    for forward_ct in (0, 16, 32):  # three launches into one ring slot, none processed
        sched.forward_ct = forward_ct
        launch(rt, sched, decode_batch(1), 1)
    assert rt.counters["telemetry_overwritten"] == 2


def test_a_source_without_a_client_attaches_only_its_rule():
    rt = source(ManualClock(T0), None)
    pulled: list = []
    rt.after_pull_raw_reqs(pulled)
    rt.after_pull_raw_reqs(pulled)
    assert pulled == [rt.local] and rt.counters == Counter()


def test_a_full_cache_reports_no_negative_use_and_steps_are_reported_as_run():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched = scheduler()
    sched.token_to_kv_pool_allocator = Pool(10_000, 0)  # all free: 0 used
    for steps in (1, 0):
        batch = decode_batch(1)
        launch(rt, sched, batch, steps)
        finish(rt, sched, batch)
    assert [sent[0][7] for sent in client.sent] == [0, 0]  # kv used
    assert [sent[0][10] for sent in client.sent] == [1, 0]  # steps used
    assert [sent[0][11] for sent in client.sent] == [None, None]
    assert rt.counters == Counter()


def test_a_step_the_policy_was_not_asked_about_reports_no_depth():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched = scheduler()
    first = decode_batch(1)
    launch(rt, sched, first, 3)
    finish(rt, sched, first)

    def run_batch(s, b):  # the policy is not asked (last_steps stays as the hook set it)
        s.forward_ct += 1
        b.forward_iter = s.forward_ct
        return "ran"

    second = decode_batch(1)
    rt.around_run_batch(run_batch, sched, second)
    assert rt.last_steps == -1
    _, verify = finish(rt, sched, second)
    assert verify == -1 and client.sent[1][0][10] == 0


def test_request_ids_are_kept_only_for_the_recorder():
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    sched, batch = scheduler(), decode_batch(2)
    launch(rt, sched, batch, 1)
    finish(rt, sched, batch)
    assert client.raw[0][0][10] is None  # the launch tuple's request list copy


def test_hooks_pass_the_scheduler_and_keywords_on_to_sglang_even_on_a_fault():
    rt = source(ManualClock(T0), ClientStandIn())
    faults = record_faults(rt)
    broken = SimpleNamespace()  # no forward_ct
    batch = SimpleNamespace(reqs=[])  # no forward_iter

    def original(s, batch, flag):
        return (s, batch, flag)

    assert rt.around_run_batch(original, broken, batch=batch, flag=1) == (broken, batch, 1)
    assert rt.around_process_batch_result(original, broken, batch=batch, flag=2) == (
        broken, batch, 2)
    assert faults == [("run_batch", "AttributeError"), ("result", "AttributeError")]


def test_a_followers_result_reaches_sglang_with_its_scheduler_and_keywords():
    rt = source(ManualClock(T0), ClientStandIn())
    rt.is_source = False
    sched, batch = scheduler(), decode_batch(1)
    batch.forward_iter = 1

    def original(s, batch, flag):
        return (s, batch, flag)

    assert rt.around_process_batch_result(original, sched, batch=batch, flag=3) == (
        sched, batch, 3)


def test_a_sources_result_reaches_sglang_with_its_scheduler():
    clock = ManualClock(T0)
    rt = source(clock, ClientStandIn())
    sched, batch = scheduler(), decode_batch(1)
    launch(rt, sched, batch, 1)
    assert rt.around_process_batch_result(lambda s, b: s, sched, batch) is sched
    rt.on_verify([1])  # after the result: nothing being processed
    assert rt.counters == Counter()


class OddStep(int):
    """A step index whose comparison fails (the lookup's fault handler)."""

    def __ne__(self, other: object) -> bool:
        raise TypeError("cannot compare")


def test_faults_name_their_site_and_carry_the_exception(caplog):
    clock = ManualClock(T0)
    client = ClientStandIn()
    rt = source(clock, client)
    faults = record_faults(rt)
    sched = scheduler()
    batch = decode_batch(1)
    batch.forward_iter = OddStep(3)
    rt.around_process_batch_result(lambda s, b: "done", sched, batch)  # lookup fails
    rt.trimmer = SimpleNamespace(trim=None)
    launch(rt, sched, decode_batch(1), 2)  # the trim fails
    rt.trimmer = None
    del sched.tree_cache
    launch(rt, sched, decode_batch(1), 3)  # the launch cannot be read
    client.send_step = None
    ok = decode_batch(1)
    sched.tree_cache = Pool(0, 1_000)
    launch(rt, sched, ok, 3)
    finish(rt, sched, ok)  # the send fails
    rt.after_pull_raw_reqs(())  # cannot append
    recorder = RecorderStandIn()
    recorder.add_arrival = None
    rt.recorder = recorder
    rt.before_process_input_requests(sched, [SimpleNamespace(rid="a", input_ids=[1])])
    assert faults == [("result", "TypeError"), ("trim", "TypeError"), ("launch", "AttributeError"),
                      ("result", "TypeError"), ("pull", "AttributeError"),
                      ("arrivals", "TypeError")]


def test_a_failed_attach_carries_its_exception(monkeypatch):
    def no_ranks(scheduler, version):
        raise RuntimeError("no parallel state")

    monkeypatch.setattr(runtime_module, "read_ranks", no_ranks)
    rt = Runtime(PluginConfig(server="srv"), "test")
    faults = record_faults(rt)
    rt.attach(SimpleNamespace())
    assert faults == [("attach", "RuntimeError")]


def test_attach_reads_the_ranks_of_the_scheduler_it_is_given(monkeypatch):
    given = []
    monkeypatch.setattr(runtime_module, "read_ranks",
                        lambda s, v: given.append(s) or Ranks(1, 2, 0, 1, 0, False))
    rt = Runtime(PluginConfig(server="srv"), "test")
    sched = SimpleNamespace()
    rt.before_process_input_requests(sched, [])
    assert given == [sched]


def test_a_source_without_server_args_is_named_after_its_host(monkeypatch):
    monkeypatch.setattr(runtime_module, "ControllerClient", Built())
    rt = Runtime(PluginConfig(), "test", ranks=SOURCE)
    rt.policy = SimpleNamespace(candidate_steps=())
    rt.attach(SimpleNamespace())
    assert rt.server == socket.gethostname() and rt.is_source


@pytest.mark.parametrize(("ranks", "policy", "message"), [
    (SOURCE, None, "specctl: this server does not run --speculative-adaptive (no adaptive "
                   "policy was built); specctl does nothing"),
    (Ranks(0, 1, 0, 2, 0, False), object(),
     "specctl: pipeline parallelism / attention DP is not supported; every rank runs the "
     "local 'table' rule, no controller, no recording"),
])
def test_the_warnings_say_what_specctl_does_instead(ranks, policy, message, caplog):
    rt = Runtime(PluginConfig(server="srv", fallback="table"), "test", ranks=ranks)
    rt.policy = policy
    with caplog.at_level(logging.WARNING, logger="sglang_hooks.runtime"):
        rt.attach(SimpleNamespace())
    assert [r.getMessage() for r in caplog.records] == [message]


@pytest.mark.parametrize("controller", [None, "ipc:///c"])
def test_the_source_says_what_it_runs(controller, caplog, monkeypatch):
    monkeypatch.setattr(runtime_module, "ControllerClient", Built())
    cfg = PluginConfig(server="srv", controller=controller, policy=None, record_dir=None)
    rt = Runtime(cfg, "test", ranks=SOURCE)
    with caplog.at_level(logging.INFO, logger="sglang_hooks.runtime"):
        rt.start_source()
    assert [r.getMessage() for r in caplog.records] == [
        f"specctl: source rank of server 'srv': controller={controller}, local policy=None, "
        "rule=sglang, recording=None"]


def test_the_source_names_its_local_policy_and_recording(caplog, monkeypatch, tmp_path):
    import sglang_hooks.local
    import sglang_hooks.recorder

    monkeypatch.setattr(runtime_module, "ControllerClient", Built())
    monkeypatch.setattr(sglang_hooks.local, "LocalDecisions", Built())
    monkeypatch.setattr(sglang_hooks.recorder, "start_recorder", Built())
    cfg = PluginConfig(server="srv", policy="/p.npz", record_dir="/rec", fallback="table")
    rt = Runtime(cfg, "test", ranks=SOURCE)
    with caplog.at_level(logging.INFO, logger="sglang_hooks.runtime"):
        rt.start_source()
    assert [r.getMessage() for r in caplog.records] == [
        "specctl: source rank of server 'srv': controller=None, local policy=/p.npz, "
        "rule=table, recording=/rec"]


def test_a_marker_already_taken_is_not_queued_again():
    rt = source(ManualClock(T0), None)
    sched = scheduler()
    rt.before_process_input_requests(sched, [marker(4, apply_from=1)])
    launch(rt, sched, decode_batch(1), 2)
    assert rt.controller == marker(4, apply_from=1) and rt._pending is None
    rt.before_process_input_requests(sched, [marker(4, apply_from=1)])
    assert rt._pending is None


def test_a_tuple_list_keeps_the_arguments_after_it():
    rt = source(ManualClock(T0), None)
    sched = SimpleNamespace()
    req = ReqStandIn("a")
    args, kwargs = rt.before_process_input_requests(sched, (req, marker(1)), "more", "args")
    assert args == (sched, [req], "more", "args") and kwargs == {}


def test_arrivals_without_a_rid_or_ids_are_skipped_not_faults():
    recorder = RecorderStandIn()
    rt = source(ManualClock(T0), None, recorder)
    rt.before_process_input_requests(SimpleNamespace(), [SimpleNamespace(input_ids=[1]),
                                                         SimpleNamespace(rid="b")])
    assert recorder.arrivals == [] and rt.counters == Counter()


def test_hook_timing_times_around_hooks_without_sglangs_own_time(tmp_path, monkeypatch):
    """An AROUND hook's wrapper leaves out the original's time, a plain one would not: on
    a clock that moves only inside SGLang's original (a second per call), the around
    wrapper of run_batch records none of it."""
    import sglang_hooks.timing

    rt = source(ManualClock(T0), None, hook_timing=str(tmp_path / "timing"))
    try:
        table = rt.hook_table()
        now = [0]
        monkeypatch.setattr(sglang_hooks.timing.time, "perf_counter_ns", lambda: now[0])
        rt.clock.plain_overhead_ns = rt.clock.around_overhead_ns = 0

        def original(s, b):
            now[0] += 10**9
            s.forward_ct += 1
            b.forward_iter = s.forward_ct
            return "ran"

        rt.clock.current_ns = 0
        assert table["run_batch"][0](original, scheduler(), decode_batch(1)) == "ran"
        assert rt.clock.current_ns == 0
        rt.clock.current_ns = 0
        assert table["process_input_requests"][0](SimpleNamespace(), []) is None
        assert rt.clock.current_ns == 0  # a plain hook: the whole (clock-free) call
        pulled: list = []
        table["_pull_raw_reqs"][0](pulled)  # AFTER: called with SGLang's result alone
        assert pulled == [rt.local]
    finally:
        rt.close()


def test_without_a_client_the_source_names_no_controller_and_no_policy(caplog, monkeypatch):
    import sglang_hooks.recorder

    monkeypatch.setattr(sglang_hooks.recorder, "start_recorder", Built())
    cfg = PluginConfig(server="srv", controller="ipc:///c", policy="/p.npz", record_dir="/rec",
                       record_explore=True)  # exploring: no controller, no local policy
    rt = Runtime(cfg, "test", ranks=SOURCE)
    with caplog.at_level(logging.INFO, logger="sglang_hooks.runtime"):
        rt.start_source()
    assert rt.client is None
    assert [r.getMessage() for r in caplog.records] == [
        "specctl: source rank of server 'srv': controller=None, local policy=None, "
        "rule=explore, recording=/rec"]


def test_finished_requests_without_a_recorder_are_no_fault():
    clock = ManualClock(T0)
    rt = source(clock, ClientStandIn())
    sched, batch = scheduler(), decode_batch(1)
    batch.reqs[0].finished_reason = "stop"
    launch(rt, sched, batch, 1)
    finish(rt, sched, batch)
    assert rt.counters == Counter()


def test_an_extend_steps_prefix_and_new_tokens_per_request_go_to_the_recorder_as_copies():
    """The trace's attention pairs need each request's cached prefix and new tokens at
    launch; SGLang may change the batch's lists before the result. Decode steps and a
    batch without the lists give none."""
    clock = ManualClock(T0)
    recorder = RecorderStandIn()
    rt = source(clock, ClientStandIn(), recorder)
    sched = scheduler()
    extend = BatchStandIn([ReqStandIn("a"), ReqStandIn("b")], EXTEND, 300,
                          prefix_lens=[0, 512], extend_lens=[100, 200])
    launch(rt, sched, extend, steps=0)
    extend.prefix_lens.append(7)
    extend.extend_lens[0] = 1
    finish(rt, sched, extend)
    bare = BatchStandIn([ReqStandIn("c")], EXTEND, 50)
    launch(rt, sched, bare, steps=0)
    finish(rt, sched, bare)
    decode = decode_batch(2)
    decode.prefix_lens, decode.extend_lens = [0, 0], [1, 1]
    launch(rt, sched, decode, 2)
    finish(rt, sched, decode, [1, 2])
    assert recorder.prefill_lens == [([0, 512], [100, 200]), None, None]

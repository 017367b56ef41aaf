"""Record mode's writer: bounded, non-blocking, periodic files, a trace the reader accepts."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from env.traces.trace_format import read_trace
from sglang_hooks.compat import Ranks
from sglang_hooks.config import PluginConfig
from sglang_hooks.raw_step import request_copies, telemetry_of
from sglang_hooks.recorder import Recorder, start_recorder
from sglang_hooks.runtime import Runtime
from sglang_hooks.testing import DECODE, BatchStandIn, ReqStandIn, wait_until


def add_steps(recorder: Recorder, first: int, count: int) -> None:
    for step in range(first, first + count):
        recorder.add_step(step, recorder.t0 + step * 0.01, 3, 1, 3, 900, 10_000, 0, 2,
                          bytes([0, 2, 9]), 0.01, ["a", "b", "c"])


def test_steps_and_requests_reach_a_valid_trace(tmp_path):
    recorder = Recorder(tmp_path, "srv", 0, flush_s=60.0)
    recorder.add_arrival("a", recorder.t0 + 0.5, 7)
    recorder.add_arrival("b", recorder.t0 + 0.25, 5)
    add_steps(recorder, 1, 50)
    recorder.add_finish("a", 7, 12)
    recorder.add_finish("b", 5, 0)  # no output: not a request the trace format can hold
    recorder.add_finish("z", 3, 3)  # arrived before recording started: unknown arrival
    recorder.close()
    trace = read_trace(recorder.files)
    assert [s.step_index for s in trace.steps] == list(range(1, 51))
    first = trace.steps[0]
    # 9 accepted drafts at depth 2 is impossible: clamped so the trace stays valid
    assert first.accepted_drafts.tolist() == [0, 2, 2]
    assert first.request_ids == ["a", "b", "c"] and abs(first.time_s - 0.01) < 1e-9
    [request] = trace.requests.records()
    assert (request.request_id, request.prompt_tokens, request.output_tokens) == ("a", 7, 12)
    assert request.arrival_s == pytest.approx(0.5)
    assert recorder.counters["steps"] == 50 and recorder.counters["requests"] == 1


def test_files_are_written_periodically_not_only_at_exit(tmp_path):
    recorder = Recorder(tmp_path, "srv", 0, flush_s=0.2)
    try:
        add_steps(recorder, 1, 10)
        # Without a flush every flush_s, no file would appear before close (a hang guard,
        # not a timing assertion: a loaded machine may take longer than flush_s).
        wait_until(lambda: bool(recorder.files), "a periodic flush")
        add_steps(recorder, 11, 10)
    finally:
        recorder.close()
    assert len(read_trace(recorder.files).steps) == 20


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path):
    recorder = Recorder(tmp_path, "srv", 0, max_queue=100)
    try:
        add_steps(recorder, 1, 20_000)
        # A queue that blocked instead would drop nothing (how long adding takes is a
        # benchmark's business, not a test's: no timed assertion here).
        assert recorder.counters["dropped"] > 0
    finally:
        recorder.close()
    written = len(read_trace(recorder.files).steps)
    assert written + recorder.counters["dropped"] == 20_000


def test_a_restart_into_the_same_directory_reads_as_two_runs(tmp_path):
    # Regression: a second run's step_index starts again at 1 in the same directory;
    # that made the whole directory unreadable ("step_index must strictly increase").
    first = Recorder(tmp_path, "srv", 0)
    add_steps(first, 1, 30)
    first.close()
    second = Recorder(tmp_path, "srv", 0)
    add_steps(second, 1, 20)
    second.close()
    assert first.run_id != second.run_id
    assert all(first.run_id in f.name for f in first.files)
    assert all(second.run_id in f.name for f in second.files)
    trace = read_trace(tmp_path)
    assert [s.step_index for s in trace.steps] == list(range(1, 31)) + list(range(1, 21))
    assert {read_trace(f).meta["run_id"] for f in trace.sources} == {first.run_id, second.run_id}


def test_a_recording_directory_that_cannot_be_made_disables_only_recording(tmp_path, caplog):
    # Regression: Recorder raised from start_source, which turned the controller off too.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="sglang_hooks.recorder"):
        assert start_recorder(blocker / "trace", "srv", 0) is None
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "recording disabled" in warning.getMessage()
    assert str(blocker / "trace") in warning.getMessage()


def test_the_source_rank_keeps_its_controller_when_recording_cannot_start(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = PluginConfig(server="srv", controller=f"ipc://{tmp_path}/ctl.sock",
                       record_dir=str(blocker / "trace"))
    rt = Runtime(cfg, "test", ranks=Ranks(0, 1, 0, 1, 0, False))
    rt.policy = SimpleNamespace(candidate_steps=(0, 1, 3))
    try:
        with caplog.at_level(logging.WARNING, logger="sglang_hooks.recorder"):
            rt.start_source()
        assert rt.is_source and rt.client is not None
        assert rt.recorder is None
        assert sum("recording disabled" in r.getMessage() for r in caplog.records) == 1
    finally:
        rt.close()


def test_the_recorders_thread_reads_ids_and_finished_requests_from_request_lists(tmp_path):
    # The scheduler thread hands over copies of the batch's request lists; the ids and
    # the completions in the trace are what scanning them on the scheduler thread gave.
    recorder = Recorder(tmp_path, "srv", 0, flush_s=60.0)
    reqs = [ReqStandIn(rid, prompt_tokens=p) for rid, p in (("a", 7), ("b", 5), ("c", 3))]
    for req in reqs:
        recorder.add_arrival(req.rid, recorder.t0 + 0.25, len(req.origin_input_ids))
    recorder.add_step(1, recorder.t0 + 0.5, 3, 0, 3, 900, 10_000, 0, 2, bytes([1, 2, 0]),
                      0.01, reqs[:])
    reqs[0].output_ids, reqs[0].finished_reason = [9] * 12, "length"
    reqs[1].output_ids = [9] * 4  # not finished: no completion
    recorder.add_finished(reqs[:])
    recorder.add_finished(reqs[:])  # overlap: a finished request is in the next batch too
    recorder.close()
    trace = read_trace(recorder.files)
    assert trace.steps[0].request_ids == ["a", "b", "c"]
    assert [(r.request_id, r.prompt_tokens, r.output_tokens)
            for r in trace.requests.records()] == [("a", 7, 12)]
    assert recorder.counters["requests"] == 1 and recorder.counters["bad_records"] == 0


def test_a_step_keeps_the_requests_it_launched_with(tmp_path, monkeypatch):
    # SGLang may extend a running batch's list in place (merge_batch) between a step's
    # launch and its result, and after it: the step's ids are its launch's, its finished
    # requests among those its result processed, though the recorder's thread reads the
    # lists themselves later (held here until the last append).
    appended = threading.Event()
    drain = Recorder._drain
    monkeypatch.setattr(Recorder, "_drain", lambda self: (appended.wait(10), drain(self)))
    rt = Runtime(PluginConfig(server="srv"), "test", ranks=Ranks(0, 1, 0, 1, 0, False))
    rt._attached = rt.is_source = True
    rt.recorder = Recorder(tmp_path, "srv", 0, flush_s=60.0)
    sched = SimpleNamespace(
        forward_ct=0, waiting_queue=[], running_batch=None, max_total_num_tokens=100,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 50),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0))
    batch = BatchStandIn([ReqStandIn("a"), ReqStandIn("b")], DECODE)

    def run_batch(s, b):
        s.forward_ct += 1
        b.forward_iter = s.forward_ct
        rt.last_steps = 1
        batch.reqs.append(ReqStandIn("late"))  # merged after the launch, same list

    batch.reqs[0].output_ids, batch.reqs[0].finished_reason = [9] * 3, "length"
    for rid in ("a", "later"):
        rt.recorder.add_arrival(rid, rt.recorder.t0, 7)
    rt.around_run_batch(run_batch, sched, batch)
    rt.around_process_batch_result(lambda s, b: rt.on_verify([1, 0]), sched, batch)
    # Processed again (overlap keeps a finished request in the next batch): the requests
    # alone, no step.
    rt.around_process_batch_result(lambda s, b: None, sched, batch)
    # Merged again after the result, finished already: the recorder's thread reads the
    # list after this (no copy on the scheduler thread), but only the entries it had.
    later = ReqStandIn("later")
    later.output_ids, later.finished_reason = [9] * 2, "length"
    batch.reqs.append(later)
    appended.set()
    rt.close()
    trace = read_trace(rt.recorder.files)
    assert trace.steps[0].request_ids == ["a", "b"]
    # The result processed three requests (one merged during the launch): "a" finished.
    assert [r.request_id for r in trace.requests.records()] == ["a"]
    assert rt.counters == {}


def test_a_step_given_as_the_controllers_telemetry_is_the_same_record(tmp_path):
    # The hooks build one tuple for the controller and the recorder (the arguments of
    # telemetry_frame); the trace holds what add_step's arguments give.
    recorder = Recorder(tmp_path, "srv", 0, flush_s=60.0)
    reqs = [ReqStandIn(rid) for rid in ("a", "b", "c")]
    values = (recorder.t0 + 0.5, 3, 1, 3, 900, 10_000, 0, 2, [1, 2, 0], 0.01)
    recorder.add_step(1, *values, reqs[:])
    recorder.add_telemetry(("srv", 0, 2, *values), reqs[:])
    recorder.add_telemetry(("srv", 0, 3, *values), None)
    recorder.close()
    first, second, third = read_trace(recorder.files).steps
    assert (second.step_index, third.step_index) == (2, 3)
    for field in ("time_s", "batch_size", "waiting_requests", "running_requests",
                  "kv_used_tokens", "kv_capacity_tokens", "prefill_tokens", "steps_used",
                  "step_latency_s", "request_ids"):
        assert getattr(second, field) == getattr(first, field), field
    assert list(second.accepted_drafts) == list(first.accepted_drafts) == [1, 2, 0]
    assert third.request_ids is None
    assert recorder.counters["bad_records"] == 0


def _recorder_with_two_arrivals(folder):
    """A recorder that has seen requests "a" (7 prompt tokens) and "b" (5) arrive."""
    recorder = Recorder(folder, "srv", 0, flush_s=60.0)
    reqs = [ReqStandIn(rid, prompt_tokens=p) for rid, p in (("a", 7), ("b", 5))]
    for req in reqs:
        recorder.add_arrival(req.rid, recorder.t0 + 0.25, len(req.origin_input_ids))
    return recorder, reqs


def test_finished_requests_given_with_the_telemetry_are_the_same_trace(tmp_path):
    # add_telemetry(..., finished) is add_telemetry then add_finished, in one queue item.
    traces = []
    for together in (False, True):
        recorder, reqs = _recorder_with_two_arrivals(tmp_path / str(together))
        values = (recorder.t0 + 0.5, 2, 0, 2, 900, 10_000, 0, 2, [1, 2], 0.01)
        reqs[1].output_ids, reqs[1].finished_reason = [9] * 6, "stop"
        if together:
            recorder.add_telemetry(("srv", 0, 1, *values), reqs[:], reqs[:])
        else:
            recorder.add_telemetry(("srv", 0, 1, *values), reqs[:])
            recorder.add_finished(reqs[:])
        recorder.close()
        trace = read_trace(recorder.files)
        traces.append(([(s.step_index, s.request_ids) for s in trace.steps],
                       [(r.request_id, r.prompt_tokens, r.output_tokens)
                        for r in trace.requests.records()]))
        assert recorder.counters["bad_records"] == 0
    assert traces[0] == traces[1] == ([(1, ["a", "b"])], [("b", 5, 6)])


def test_a_step_given_as_read_is_the_trace_of_its_telemetry(tmp_path):
    # add_step_values(step, finished): what add_telemetry gives for telemetry_of(step),
    # the launch's copies of the requests and of an extend's lengths, and finished.
    traces = []
    for as_read in (False, True):
        recorder, reqs = _recorder_with_two_arrivals(tmp_path / str(as_read))
        t = recorder.t0 + 0.5
        extend = ((1, t, False, 2, 0, 3, 10_000, 6_000, 1_000, 300, reqs[:], [0, 512],
                   [100, 200]), 3, None, t + 0.02, None)
        decode = ((2, t + 0.03, True, 2, 0, 2, 10_000, 5_000, 1_000, None, reqs[:], None,
                   None), 2, [1, 2], t + 0.04, t + 0.02)
        reqs[1].output_ids, reqs[1].finished_reason = [9] * 6, "stop"
        for step, finished in ((extend, None), (decode, reqs[:])):
            if as_read:
                recorder.add_step_values(step, finished)
            else:
                requests, lens = request_copies(step)
                recorder.add_telemetry(telemetry_of("srv", 0, step), requests, finished, lens)
        recorder.close()
        trace = read_trace(recorder.files)
        traces.append(([(s.step_index, s.time_s, s.batch_size, s.running_requests,
                         s.kv_used_tokens, s.prefill_tokens, s.steps_used,
                         list(s.accepted_drafts), s.step_latency_s, s.request_ids,
                         s.prefill_pairs) for s in trace.steps],
                       [(r.request_id, r.prompt_tokens, r.output_tokens)
                        for r in trace.requests.records()]))
        assert recorder.counters["bad_records"] == 0
    assert traces[0] == traces[1]
    steps, requests = traces[1]
    assert [s[0] for s in steps] == [1, 2] and steps[0][3] == 5 and steps[1][6] == 2
    assert steps[0][-1] == 100 * 101 / 2 + 200 * 512 + 200 * 201 / 2
    assert requests == [("b", 5, 6)]


def test_the_warmup_flag_reaches_the_trace_as_given_or_as_read(tmp_path):
    """The telemetry's 14th item (the re-entry warm-up flag) is the record's ``warmup``;
    a 13-item telemetry (a caller before it) and a step tuple of five are unknown."""
    recorder = Recorder(tmp_path, "srv", 0, flush_s=60.0)
    t = recorder.t0 + 0.5
    off = (t, 2, 0, 2, 900, 10_000, 0, 0, None, 0.01)
    recorder.add_telemetry(("srv", 0, 1, *off, False), None)
    recorder.add_telemetry(("srv", 0, 2, *off, True), None)
    recorder.add_telemetry(("srv", 0, 3, *off), None)
    launch = (4, t + 0.1, True, 2, 0, 2, 10_000, 5_000, 1_000, None, None, None, None)
    recorder.add_step_values((launch, 0, None, t + 0.11, t + 0.1, True))
    recorder.add_step_values(((5, *launch[1:]), 0, None, t + 0.12, t + 0.11))
    recorder.close()
    assert [s.warmup for s in read_trace(recorder.files).steps] == [False, True, None, True,
                                                                    None]
    assert recorder.counters["bad_records"] == 0


def test_an_extend_steps_attention_pairs_reach_the_trace(tmp_path):
    """prefix_lens / extend_lens of a prefill step become its prefill_pairs (each new token
    attends to its prompt's cached prefix and to the new tokens up to itself); a step
    without them, or a decode step, records none."""
    recorder = Recorder(tmp_path, "srv", 0, flush_s=60.0)
    prefill = (recorder.t0 + 0.5, 2, 0, 2, 900, 10_000, 300, 0, None, 0.02)
    decode = (recorder.t0 + 0.6, 2, 0, 2, 1200, 10_000, 0, 2, [1, 2], 0.01)
    recorder.add_telemetry(("srv", 0, 1, *prefill), None, None, ([0, 512], [100, 200]))
    recorder.add_telemetry(("srv", 0, 2, *prefill), None)
    recorder.add_telemetry(("srv", 0, 3, *decode), None, None, ([0, 0], [1, 1]))
    recorder.close()
    with_lens, without, decoded = read_trace(recorder.files).steps
    assert with_lens.prefill_pairs == 100 * 101 / 2 + 200 * 512 + 200 * 201 / 2
    assert without.prefill_pairs is None and decoded.prefill_pairs is None

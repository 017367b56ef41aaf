"""Record mode: every step and every finished request, to a Parquet trace.

The scheduler thread only appends plain tuples to a bounded deque (full: the
record is dropped and counted, never waited for): a step's values, and the
request lists it saw with their lengths (not a copy, nor a scan of its requests:
SGLang changes a batch's list in place only by appending, so the first entries
stay the batch's). A daemon thread reads the requests' ids and finish state from
those, turns
everything into :class:`env.traces.schema.StepRecord` /
:class:`~env.traces.schema.RequestRecord` and hands them to
:class:`env.traces.trace_format.TraceWriter`, writing a file at least every
``flush_s`` seconds so that a killed server (SGLang ends its scheduler processes
with SIGKILL) loses at most that much; a clean exit flushes the rest
(``atexit``). Times in the trace count from the recorder's start (``t0``,
stored in the trace metadata as ``t0_monotonic``).

Each recorder is one run with its own ``run_id`` (UTC start time to the
microsecond and a random suffix), in its file names and metadata: a server restarted into the same
directory starts its step counter again, and the reader keeps the runs apart.
:func:`start_recorder` is what the plugin calls: a directory that cannot be
written disables recording (one warning), never the rest of the plugin.
"""

from __future__ import annotations

import atexit
import logging
import secrets
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np

from controller.wire import telemetry_bytes
from env.traces.schema import RequestRecord, StepRecord
from sglang_hooks.raw_step import request_copies, telemetry_of

log = logging.getLogger(__name__)

_STEP, _ARRIVAL, _FINISH, _FINISHED, _TELEMETRY, _VALUES = 0, 1, 2, 3, 4, 5
_CHUNK = 256  # records converted between GIL yields
_MAX_OPEN_REQUESTS = 1_000_000


def new_run_id() -> str:
    """A run id that sorts by start time: ``20261201T151300.123456Z-1a2b3c``.

    Microseconds, so that runs started within one second (tests, a crash loop) still
    sort in start order; the random suffix tells apart runs started at the same time.
    """
    now_ns = time.time_ns()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_ns // 10**9))
    return f"{stamp}.{now_ns // 1000 % 10**6:06d}Z-{secrets.token_hex(3)}"


def check_writable(directory: str | Path) -> None:
    """Create ``directory`` if needed and write (then remove) a probe file there.

    Raises OSError naming the directory when it cannot be created or written.
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".specctl-probe-"):
            pass
    except OSError as exc:
        raise OSError(exc.errno, f"recording directory {str(path)!r} is not writable: "
                                 f"{exc.strerror or exc}") from None


def start_recorder(directory: str | Path, server: str, rank: int, flush_s: float = 30.0,
                   meta: dict | None = None) -> Recorder | None:
    """A started :class:`Recorder`, or None (one warning) if it cannot record there.

    Only recording is disabled: the caller goes on with its controller and rule.
    """
    try:
        check_writable(directory)
        return Recorder(directory, server, rank, flush_s, meta)
    except Exception as exc:  # whatever goes wrong, recording alone is off
        log.warning("specctl: recording disabled: %s (the controller and the rule are "
                    "not affected)", exc)
        return None


class Recorder:
    """Background trace writer fed from the scheduler thread.

    Args:
        directory: Where the trace files go (created if missing).
        server: Server name (file names and records).
        rank: Rank recorded in the step records.
        flush_s: Longest time between two written files.
        meta: Extra trace metadata.
        max_queue: Records buffered before new ones are dropped.
        run_id: This run's id (default: :func:`new_run_id`).
    """

    def __init__(self, directory: str | Path, server: str, rank: int, flush_s: float = 30.0,
                 meta: dict | None = None, max_queue: int = 200_000,
                 run_id: str | None = None) -> None:
        from env.traces.trace_format import TraceWriter  # pyarrow: only when recording

        Path(directory).mkdir(parents=True, exist_ok=True)
        self.server = server
        self.rank = rank
        self.run_id = run_id or new_run_id()
        self.t0 = time.monotonic()
        self.counters: Counter[str] = Counter()
        self._flush_s = flush_s
        self._max_queue = max_queue
        self._queue: deque[tuple] = deque()
        self._open: dict[str, tuple[float, int]] = {}
        self._writer = TraceWriter(
            Path(directory) / "trace", server=server, rank=rank,
            meta={"t0_monotonic": self.t0, "t0_unix": time.time(), **(meta or {})},
            run_id=self.run_id,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specctl-recorder", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- scheduler thread (cheap) -----------------------------------------------

    def add_step(self, step_index: int, time_s: float, batch_size: int, waiting: int,
                 running: int, kv_used: int, kv_capacity: int, prefill_tokens: int,
                 steps_used: int, accepted: bytes | list[int] | None, latency_s: float,
                 request_ids: list | None) -> None:
        """Queue one step (``accepted``: int8 bytes, or SGLang's per-request list).

        ``request_ids``: the batch's request ids, or a copy of its list of requests at
        launch (their ``rid`` is read on the recorder's thread: a request's id never
        changes, so reading it later gives what reading it at launch gives).
        """
        if len(self._queue) >= self._max_queue:
            self.counters["dropped"] += 1
            return
        self._queue.append((_STEP, step_index, time_s, batch_size, waiting, running, kv_used,
                            kv_capacity, prefill_tokens, steps_used, accepted, latency_s,
                            request_ids))

    def add_telemetry(self, telemetry: tuple, request_ids: list | None,
                      finished: list | None = None,
                      prefill_lens: tuple[list, list] | None = None) -> None:
        """Queue one step as the hooks send it to the controller: the arguments of
        :func:`sglang_hooks.client.telemetry_frame` (server, rank, step index, launch
        time, batch size, waiting, running, KV used, KV capacity, prefill tokens, steps
        used, accepted drafts, latency, and optionally the warm-up flag: absent or None
        unknown), as one tuple; ``request_ids`` as in
        :meth:`add_step`: for a caller that has the telemetry already (benchmarks, tests);
        the hooks hand over the values they read (:meth:`add_step_values`), whose
        telemetry is made on the recorder's thread. ``finished``: the processed batch's
        requests, as :meth:`add_finished` takes them (one queue item for both: the same
        trace as the two calls). ``prefill_lens``: an extend step's cached prefix and new tokens
        per request (SGLang's ``prefix_lens`` and ``extend_lens``), for the step's
        attention pairs (``StepRecord.prefill_pairs``)."""
        if len(self._queue) >= self._max_queue:
            self.counters["dropped"] += 1
            return
        self._queue.append((_TELEMETRY, telemetry, request_ids, finished, prefill_lens))

    def add_step_values(self, step: tuple, finished: list | None = None,
                        count: int | None = None) -> None:
        """Queue one step as the hooks read it (:data:`sglang_hooks.raw_step.STEP_FIELDS`:
        its launch's request list and copies of an extend's lengths inside); its
        telemetry is made on the recorder's thread (the trace is what
        :meth:`add_telemetry` of that telemetry, :func:`~sglang_hooks.raw_step.request_copies`
        of the step and ``finished[:count]`` gives). ``finished``, ``count``: as
        :meth:`add_finished` takes them."""
        if len(self._queue) >= self._max_queue:
            self.counters["dropped"] += 1
            return
        self._queue.append((_VALUES, step, finished, count))

    def add_arrival(self, request_id: str, time_s: float, prompt_tokens: int) -> None:
        """Queue a request's arrival at the scheduler."""
        if len(self._queue) < self._max_queue:
            self._queue.append((_ARRIVAL, request_id, time_s, prompt_tokens))

    def add_finish(self, request_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """Queue a request's completion (only those whose arrival was seen are written)."""
        if len(self._queue) < self._max_queue:
            self._queue.append((_FINISH, request_id, prompt_tokens, output_tokens))

    def add_finished(self, requests: list, count: int | None = None) -> None:
        """Queue a processed batch's requests: those finished are completions.

        ``requests``: the batch's list itself (or a copy) and ``count`` its length when
        the batch was processed (None: all of it). Only its first ``count`` entries are
        read, later: SGLang may append to the list meanwhile (0.5.15's ``merge_batch``
        extends a running batch's list in place), never changes them. The recorder's
        thread looks at them (``finished_reason``, ``rid``, the prompt's
        and the output's lengths), so the scheduler thread does not scan the batch. A
        request SGLang has marked finished has its last tokens already (SGLang sets
        ``finished_reason`` after appending them, and appends nothing after), so a later
        look reads the lengths a look right after the result would. A request seen
        finished in several batches (overlap scheduling keeps it in the next one) is
        written once, as before: its arrival is taken by the first.
        """
        if len(self._queue) < self._max_queue:
            self._queue.append((_FINISHED, requests, count))

    # -- lifecycle ----------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Write everything queued and stop the thread (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        atexit.unregister(self.close)

    @property
    def files(self) -> list[Path]:
        """Trace files written so far."""
        return list(self._writer.files)

    # -- background thread ----------------------------------------------------------

    def _run(self) -> None:
        next_flush = time.monotonic() + self._flush_s
        while not self._stop.wait(0.1):
            self._drain()
            if time.monotonic() >= next_flush:
                self._flush()
                next_flush = time.monotonic() + self._flush_s
        self._drain()
        self._flush()
        try:
            self._writer.close()
        except Exception:
            log.exception("specctl recorder: closing the trace failed")

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            for _ in range(min(_CHUNK, len(queue))):
                item = queue.popleft()
                try:
                    self._convert(item)
                except Exception:
                    self.counters["bad_records"] += 1
                    if self.counters["bad_records"] == 1:
                        log.exception("specctl recorder: record %r not written", item[:3])
            time.sleep(0)  # let the scheduler thread have the GIL

    def _flush(self) -> None:
        try:
            path = self._writer.flush()
        except Exception as exc:  # TraceFormatError: the chunk is lost, the next one is not
            self.counters["lost_chunks"] += 1
            log.error("specctl recorder: trace chunk not written: %s", exc)
            return
        if path is not None:
            self.counters["files"] += 1

    def _convert(self, item: tuple) -> None:
        kind = item[0]
        if kind == _VALUES:
            _, step, finished, count = item
            requests, lens = request_copies(step)
            if finished is not None and count is not None:
                finished = finished[:count]
            self._convert((_TELEMETRY, telemetry_of(self.server, self.rank, step), requests,
                           finished, lens))
        elif kind == _TELEMETRY:
            _, telemetry, rids, finished, lens = item
            record = self._step_record((_STEP, *telemetry[2:13], rids))
            if len(telemetry) > 13:
                record.warmup = telemetry[13]
            if len(telemetry) > 14:
                record.before_prefill = telemetry[14]
            if lens is not None and record.prefill_tokens > 0:
                record.prefill_pairs = _attention_pairs(*lens)
            self._writer.add_step(record)
            if finished is not None:
                self._convert((_FINISHED, finished, None))
        elif kind == _STEP:
            self._writer.add_step(self._step_record(item))
        elif kind == _FINISHED:
            _, requests, count = item
            for req in (requests if count is None else requests[:count]):
                if req.finished_reason is not None:
                    self._convert((_FINISH, req.rid, len(req.origin_input_ids),
                                   len(req.output_ids)))
        elif kind == _ARRIVAL:
            _, rid, t, prompt = item
            if len(self._open) >= _MAX_OPEN_REQUESTS:
                self._open.pop(next(iter(self._open)))
            self._open.setdefault(rid, (max(0.0, t - self.t0), prompt))
        else:
            _, rid, prompt, output = item
            arrival = self._open.pop(rid, None)
            if arrival is None or output < 1 or prompt < 1:
                return
            self._writer.add_request(RequestRecord(rid, arrival[0], int(prompt), int(output)))
            self.counters["requests"] += 1

    def _step_record(self, item: tuple) -> StepRecord:
        (_, step, t, batch, waiting, running, kv_used, kv_cap, prefill, steps_used, accepted,
         latency, rids) = item
        if not isinstance(accepted, bytes):  # SGLang's list, converted here (off the hooks)
            accepted = telemetry_bytes(accepted, steps_used, batch)[0]
        drafts = np.frombuffer(accepted, dtype=np.int8)[:batch] if steps_used > 0 else np.empty(0)
        drafts = np.clip(drafts, 0, steps_used).astype(np.int8)
        self.counters["steps"] += 1
        return StepRecord(
            server=self.server, rank=self.rank, step_index=step, time_s=t - self.t0,
            batch_size=batch, waiting_requests=waiting, running_requests=running,
            kv_used_tokens=max(0, kv_used), kv_capacity_tokens=kv_cap,
            prefill_tokens=prefill, steps_used=steps_used, accepted_drafts=drafts,
            step_latency_s=max(0.0, latency),
            request_ids=_ids(rids) if rids is not None and len(rids) == batch else None,
        )


def _attention_pairs(prefix_lens: list, extend_lens: list) -> float:
    """An extend step's attention token pairs, summed over its requests (the cost model's
    definition, :func:`env.sim.cost_model.prefill_pairs`)."""
    # Imported here: on the recorder's thread at the first prefill, not when SGLang loads
    # the plugin (the cost model brings yaml along).
    from env.sim.cost_model import prefill_pairs

    return float(sum(prefill_pairs(e, p) for p, e in zip(prefix_lens, extend_lens,
                                                         strict=True)))


def _ids(requests: list) -> list[str]:
    """Request ids from a list of ids or of SGLang's requests (their ``rid``)."""
    return [r if type(r) is str else r.rid for r in requests]

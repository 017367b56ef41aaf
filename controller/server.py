"""The controller daemon's core: telemetry in, speculation decisions out.

One ROUTER socket serves any number of SGLang servers and ranks. Each
(connection, server, rank) stream (see :mod:`controller.streams`: a client can
only ever touch the streams of its own connection) has its own
:class:`env.features.FeatureBuilder` (the policy file's feature spec), so
observations are built exactly as in training.
Every poll drains all pending frames, folds each stream's records into its
builder, then evaluates the policy once for all streams that sent telemetry:
one batched MLP forward over every stream's ``observation_grid()`` (a row per
batch-size grid value). Each of those streams gets a DECISION for each of its latest
``answers_per_poll`` records (older ones are folded unanswered; an earlier record is
evaluated on a copy of the features as they were after it, in the same batch, so each
gets the decision local mode would make on it): steps per grid value, restricted
to the steps the server offers (its HELLO), ``apply_from_step = step_index +
DECISION_LAG``.
In shadow mode the decision is computed and logged but the reply says "use
your fallback".

No frame stops the daemon: :func:`controller.wire.decode` rejects bad frames
(counted by kind), a stream whose features turn non-finite is reset, and any
other failure while handling one frame is logged and counted, not raised.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import zmq
from threadpoolctl import threadpool_limits

from controller import fast_tanh
from controller.decider import (
    RULES,
    allowed_actions,
    compress,
    evaluate,
    probing_flags,
    served_rule,
)
from controller.io_thread import IoThreadPolicy
from controller.metrics import Metrics
from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from controller.security import CurveConfig, bind, check_endpoint, secure_socket
from controller.streams import Peer, StreamKey, StreamLimits, StreamTable, trim_heap
from controller.wire import (
    DECISION_LAG,
    MAX_POLICY_BYTES,
    TELEMETRY_HEADERS,
    WIRE_VERSION,
    Decision,
    Hello,
    Kind,
    PolicyPush,
    WireError,
    apply_socket_limits,
    decode,
    decode_telemetry_fast,
    encode_decision,
    encode_policy,
    new_decision,
)
from env.features import FeatureBuilder, observation_grids, warm_up
from env.guard import warm_up as warm_up_guard
from env.traces.schema import StepRecord

log = logging.getLogger(__name__)

#: Streams removed (idle or evicted) before the sweep gives freed memory back to the OS.
_TRIM_AFTER_STREAMS = 256
#: Distinct decisions whose wire form (see ControllerServer._answer) is kept at most.
_COMPRESSED_CACHE = 4096
#: pyzmq's compiled send: the Python-level ``zmq.Socket.send`` only adds draft-API
#: arguments (routing_id, group) the daemon never uses: 0.2 vs 0.5 us a call here.
_BACKEND_SEND = zmq.backend.Socket.send
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)
#: Whether another message is queued (see _drain): libzmq's zmq_poll, which asks the
#: socket's ZMQ_EVENTS, without ``Socket.get``'s conversion of the option to its enum
#: (two Python calls in enum.py, ~0.2 us warm and several in a cold poll).
_ZMQ_POLL = zmq.backend.zmq_poll
_POLLIN = int(zmq.POLLIN)
#: Reads of a poll after which the drain asks the socket whether more is queued (beyond:
#: it reads until zmq.Again, see _drain).
_ASKED_READS = 2
#: A HELLO's first bytes after its msgpack fixarray header (of 8, or 9 with a policy
#: digest): WIRE_VERSION, Kind.HELLO.
_HELLO_HEADERS = (bytes([0x98, WIRE_VERSION, Kind.HELLO]), bytes([0x99, WIRE_VERSION, Kind.HELLO]))


@dataclass(frozen=True)
class ServeOptions:
    """How the daemon runs (``configs/serve.yaml`` documents each)."""

    endpoint: str = "ipc:///tmp/specctl-serve.sock"
    shadow: bool = False
    #: Fleet hub: push the served policy to each connection deciding locally with another
    #: (its HELLO says which), and to all those again on reload.
    push_policies: bool = True
    max_streams: int = 4096
    max_streams_per_peer: int = 4
    new_streams_per_s: float = 20.0
    stream_idle_s: float = 600.0
    max_drain: int = 8192
    #: Longest a poll reads frames before answering: a peer flooding the socket (ZeroMQ
    #: hands out frames round-robin across connections) must not delay everyone's answer.
    max_drain_s: float = 0.010
    #: Frames of one connection (and records of one stream) handled per poll at most: the
    #: latest; older ones are shed unread and counted. Only an overloaded daemon, or a
    #: flooding client, has more: answers then stay fresh instead of queueing.
    max_records_per_poll: int = 16
    #: When a round (read, decide, send) took longer than this, the next folds only
    #: ``overload_records_per_poll`` frames per connection: a daemon short of CPU (a busy
    #: host) otherwise spends a round folding records and answers too late for all.
    overload_busy_s: float = 0.02
    overload_records_per_poll: int = 2
    #: Records of one stream answered per poll at most (its latest ones; the older ones
    #: are folded without an answer): each gets the decision the policy makes on the
    #: telemetry up to it, as local mode decides, all in one batched evaluation (an
    #: earlier record's from a copy of the stream's features after it). An older
    #: answer is of no use to the plugin once a newer one arrived; without it, a step
    #: whose telemetry shared a poll with its successor's (a daemon late by more than a
    #: step) has no answer of its own. Default 4: with the compiled features an answer
    #: costs little enough (8 servers x 1 kHz on the shared 2-core machine, load 6: 97-99%
    #: of steps answered at 0.95 cores, against 65% at 0.6 answering only the latest;
    #: with the numpy features 4 answers had made it worse, 71% -> 63%). Always 1 after a
    #: slow round (``overload_busy_s``): a daemon short of CPU answers only the latest.
    answers_per_poll: int = 4
    log_every_s: float = 60.0
    curve: CurveConfig | None = None
    #: Users besides the daemon's own who may connect to an ipc:// endpoint.
    ipc_allowed_uids: tuple[int, ...] = ()
    #: Overrides of the served policy file's acceptance probe (:mod:`env.probe`):
    #: its fields by name, None entries ignored (e.g. ``{"enabled": False}``); None: as
    #: the file says.
    probe: dict | None = None
    #: Overrides of the served policy file's goodput guard (:mod:`env.guard`), likewise.
    guard: dict | None = None


class _Stream:
    """One (connection, server, rank): its feature builder and where to answer."""

    __slots__ = ("allowed", "backlog", "batch_size", "builder", "candidates",
                 "deciding", "identity", "key", "last_seen", "last_step", "pushed", "received",
                 "seq")

    def __init__(self, key: StreamKey, builder: FeatureBuilder, backlog: int) -> None:
        self.key = key
        self.backlog: deque[StepRecord] = deque(maxlen=backlog)
        self.identity = key[0][0]
        self.builder = builder
        self.seq = 0
        self.last_step = -1  # the latest telemetry received
        self.batch_size = 1  # the batch of the latest decode record folded
        self.candidates: tuple[int, ...] | None = None
        self.allowed: np.ndarray | None = None
        self.last_seen = 0.0
        self.received = 0.0
        self.deciding = ""  # local mode: digest of the policy the server decides with
        self.pushed = ""  # digest of the policy last pushed to this stream's connection


class _Answer(NamedTuple):
    """One record to answer: its stream, the features after it (None: folding failed),
    the record, and the batch size the decision's current steps are counted at."""

    stream: _Stream
    builder: FeatureBuilder | None
    record: StepRecord
    batch_size: int


def _unheld(entry: _Answer, stream: _Stream, steps: int) -> bool:
    """Whether the start rule (``ProbeSpec.start_off``) leaves the decision of ``steps``
    for ``entry`` unheld by the plugin's switch hold (the DECISION's ``flags``); the
    stream's features count it (:meth:`env.features.FeatureBuilder.decided`)."""
    builder = entry.builder
    return builder is not None and builder.unheld and stream.builder.decided(steps)


class ControllerServer:
    """Binds the ROUTER socket; :meth:`run` serves until the stop event is set.

    Args:
        holder: The policy being served (reloaded between polls).
        options: Endpoint, shadow mode, limits.
        metrics: Where to count (a private one if None).
        cost_prior: The servers' cost profile (fitted from their recorded traces),
            the prior of the features' latency model; None = telemetry only.

    Raises:
        UnsafeEndpointError: the endpoint is unsafe or cannot be bound, or the CURVE
            key files are missing or unusable (the message says which).
    """

    def __init__(self, holder: PolicyHolder, options: ServeOptions,
                 metrics: Metrics | None = None, cost_prior=None) -> None:
        check_endpoint(options.endpoint, options.curve)
        # The batched policy evaluation (streams x grid rows) is just large enough for
        # OpenBLAS to go multithreaded, and on a busy host its spinning threads cost ~10x
        # the CPU of one thread for the same product (measured: 1,330 rows, 4.7 ms of
        # CPU vs 0.33 ms). The daemon's process answers many streams: one thread each.
        threadpool_limits(1, user_api="blas")
        # The compiled features load (or compile) now, not while the first servers wait.
        warm_up(holder.policy.feature_spec, cost_prior)
        fast_tanh.warm_up()  # likewise the policy's approximate tanh (controller.fast_tanh)
        warm_up_guard(holder.policy.feature_spec)  # and the compiled guard (env.guard)
        self.holder = holder
        # The servers' cost profile: the feature module's latency prior (see env.features).
        self.cost_prior = cost_prior
        self.options = options
        self.metrics = metrics or Metrics()
        self.counters: Counter[str] = Counter()
        self.streams: StreamTable[_Stream] = StreamTable(
            StreamLimits(options.max_streams, options.max_streams_per_peer,
                         options.new_streams_per_s), self._new_stream)
        self._shadow_steps: Counter[int] = Counter()
        self._children: dict[tuple, object] = {}
        self._set_actions(holder.policy)
        self._context = zmq.Context(io_threads=1)
        # Its I/O thread batch-scheduled while polls are large (see controller.io_thread).
        self._io_policy = IoThreadPolicy(self._context)
        sock = self._context.socket(zmq.ROUTER)
        apply_socket_limits(sock)
        # A short queue per peer: telemetry that would wait longer is better dropped
        # (the server counts it) than answered late (the server ignores late answers).
        sock.setsockopt(zmq.RCVHWM, 256)
        sock.setsockopt(zmq.SNDHWM, 1024)
        self._auth = None
        try:
            self._auth = secure_socket(sock, self._context, options.endpoint, options.curve,
                                       options.ipc_allowed_uids)
            bind(sock, options.endpoint)
        except BaseException:
            self._sock = sock
            self.close()
            raise
        self._with_user_id = options.curve is not None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._asking = [(sock, _POLLIN)]  # _drain's question to zmq_poll
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._next_sweep = time.monotonic() + 10.0
        self._next_log = time.monotonic() + options.log_every_s
        self._next_error_log = 0.0
        self._busy_s = 0.0  # how long the latest round took (read, decide, send)
        #: Wire forms by the chosen actions' indices as bytes (see _answer, _wire).
        self._compressed: dict[bytes, tuple[tuple[int, ...], ...]] = {}
        self._too_big_logged = ""  # digest of a policy too big to push, once warned
        self._telemetry_folded = 0  # telemetry accepted since the last decide()
        self._evicted = 0
        self._freed = 0  # streams removed since the heap was last trimmed
        self._evicted_at_sweep = 0
        holder.on_reload = self._on_reload
        self.metrics.set_policy(holder.policy.name, str(holder.path))

    # -- loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event, poll_ms: int = 50) -> None:
        """Serve until ``stop`` is set (checked at least every ``poll_ms``)."""
        while not stop.is_set():
            self.poll_once(poll_ms)

    def poll_once(self, timeout_ms: int = 50) -> int:
        """Wait up to ``timeout_ms`` for frames, answer them all; returns decisions sent."""
        now = time.monotonic()
        if self.holder.poll(now) is False:
            self.metrics.reloads.labels(result="error").inc()
        if now >= self._next_sweep:
            self._sweep(now)
        if now >= self._next_log:
            self._log_summary(now)
        if not self._poller.poll(timeout_ms):
            return 0
        started = time.perf_counter()
        sent = self._send(self.decide(self._drain()))
        self._busy_s = time.perf_counter() - started
        self._io_policy.after_poll(sent)
        return sent

    def close(self) -> None:
        """Close the socket (an ipc:// path is removed by ZeroMQ)."""
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    # -- frames in ------------------------------------------------------------------------

    def _drain(self) -> dict[StreamKey, _Stream]:
        """Read the pending frames; returns the streams that sent telemetry.

        Reading is cheap and decoding and folding are not, so frames are first read
        (for up to ``max_drain_s``) and only each connection's latest
        ``max_records_per_poll`` are handled (and every HELLO): an overloaded daemon, or
        a connection flooding it, sheds old frames unread and answers from fresh ones,
        instead of working through a backlog whose answers would all arrive too late.
        """
        sock, with_user_id = self._sock, self._with_user_id
        options = self.options
        # A slow previous round means the daemon is short of CPU: fold less, answer fresher.
        keep = (options.overload_records_per_poll if self._busy_s > options.overload_busy_s
                else options.max_records_per_poll)
        keep = max(keep, 1)
        latest: dict[Peer, list[bytes]] = {}  # each connection's frames, oldest first
        hellos: list[tuple[Peer, bytes]] = []
        shed = 0
        clock = time.perf_counter
        started = clock()  # the latency clock of every frame read now (an upper bound)
        deadline = started + options.max_drain_s
        recv, asking = sock.recv, self._asking
        # The poll said a message is queued. After each of a poll's first two reads the
        # socket is asked whether another is (ZMQ_EVENTS) rather than read until a recv
        # raises zmq.Again: in a poll after an idle millisecond, the caches cold, the raise
        # costs the daemon 13-30 us more than the question (1.5 us warm; docs/ONLINE.md,
        # thirteenth pass). 1 kHz servers' polls carry one or two frames. Larger polls
        # read on until zmq.Again: asked after every frame, the question (1.5-2.5 us
        # warm) would cost a flood's polls more than one raise each.
        more = True
        for reads in range(options.max_drain):
            if not more or clock() > deadline:
                break
            try:
                if with_user_id:
                    parts = sock.recv_multipart(_NOBLOCK, copy=False)
                    extra = len(parts) - 2
                else:  # a ROUTER's identity part is never alone: the frame follows
                    identity = recv(_NOBLOCK)
                    # The frame as a zmq.Frame, whose ``more`` says whether parts follow:
                    # asking RCVMORE (or recv_multipart) goes through pyzmq's enum
                    # conversion (2.6 vs 3.5 us per frame here, with its bytes copied).
                    part = recv(_NOBLOCK, False)
                    extra = 0
                    while part.more:
                        part = recv(_NOBLOCK, False)
                        extra += 1
                # zmq_poll's answer: the sockets ready ([] when none is)
                more = reads >= _ASKED_READS or _ZMQ_POLL(asking, 0)
            except zmq.Again:
                break
            if extra:
                self._count(self.metrics.wire_errors, "malformed")
                continue
            if with_user_id:  # the CURVE key ZAP admitted the connection with
                frame = parts[1]
                peer = (parts[0].bytes, frame.get("User-Id") or "")
                frame = frame.bytes
            else:
                peer, frame = (identity, ""), part.bytes
            if frame[:3] in _HELLO_HEADERS:  # rare, and must not be shed
                hellos.append((peer, frame))
                continue
            frames = latest.get(peer)
            if frames is None:
                latest[peer] = [frame]
            else:
                frames.append(frame)
                if len(frames) > keep:  # its oldest frame is shed, unread
                    del frames[0]
                    shed += 1
        if shed:
            self.metrics.frames_shed.inc(shed)
        pending: dict[StreamKey, _Stream] = {}
        for peer, frame in hellos:
            self.handle_frame(peer, frame, pending, started)
        # every connection's frames in one loop (not a call per connection: a plugin's
        # connection carries one stream, so a flood's polls have a connection per frame)
        self._handle_connections(latest.items(), pending, started)
        return pending

    def handle_frame(self, peer: Peer, frame: bytes, pending: dict[StreamKey, _Stream],
                     received: float | None = None) -> None:
        """Decode one frame from ``peer`` and queue it on that peer's stream; never raises.

        A stream that sent telemetry is added to ``pending`` (answered by :meth:`decide`).
        ``received`` (``time.perf_counter()``, default now) starts the decision-latency clock.
        """
        self._handle_frames(peer, (frame,), pending,
                            time.perf_counter() if received is None else received)

    def _handle_frames(self, peer: Peer, frames: Iterable[bytes],
                       pending: dict[StreamKey, _Stream], received: float) -> None:
        """:meth:`handle_frame` for each of ``frames`` (from ``peer``, in order)."""
        self._handle_connections(((peer, frames),), pending, received)

    def _handle_connections(self, connections: Iterable[tuple[Peer, Iterable[bytes]]],
                            pending: dict[StreamKey, _Stream], received: float) -> None:
        """:meth:`handle_frame` for each frame of each ``(peer, frames)``, in order.

        The common frame, telemetry of a known stream continuing its run, is decoded and
        queued here in one loop over all of a poll's connections (without the
        ``handle_frame``, ``decode`` and ``_handle_message`` calls each: docs/ONLINE.md,
        sixteenth and twentieth passes). Telemetry of a new or restarted stream goes on to
        :meth:`_handle_message`; any other frame (or one the fast decoder refuses) to
        :meth:`_handle_frame`, which decodes it in full (naming a refused frame's error).
        """
        fast, headers = decode_telemetry_fast, TELEMETRY_HEADERS
        get = self.streams.get
        for peer, frames in connections:
            for frame in frames:
                record = fast(frame) if fast is not None and frame.startswith(headers) else None
                if record is None:  # not telemetry, or refused (decode names the error)
                    self._handle_frame(peer, frame, pending, received)
                    continue
                key = (peer, record.server, record.rank)
                try:
                    stream = get(key)
                    if stream is None or record.step_index <= stream.last_step:
                        self._handle_message(key, record, pending, received)  # new, restarted
                    else:
                        self._telemetry(stream, record, received, pending)
                except Exception:  # a bug: one frame must not stop the daemon serving all
                    self._frame_failed(key, pending)

    def _handle_frame(self, peer: Peer, frame: bytes, pending: dict[StreamKey, _Stream],
                      received: float) -> None:
        """:meth:`handle_frame` for one frame, decoded in full (any kind, any error)."""
        try:
            message = decode(frame)
        except WireError as exc:
            self._count(self.metrics.wire_errors, exc.kind)
            if exc.kind == "range":
                self._count(self.metrics.range_errors, exc.field)
            return
        if type(message) is Decision or type(message) is PolicyPush:
            self._count(self.metrics.wire_errors, "kind")  # controller -> server kinds
            return
        self._handle_message((peer, message.server, message.rank), message, pending, received)

    def _handle_message(self, key: StreamKey, message: StepRecord | Hello,
                        pending: dict[StreamKey, _Stream], received: float) -> None:
        """Queue a decoded TELEMETRY or HELLO on its stream (opened if new and allowed)."""
        try:
            stream = self.streams.get(key)
            if stream is None:  # a new stream (or one refused): the clock, evictions
                stream = self.streams.get_or_open(key, time.monotonic())
                self._count_evictions()
            if stream is None:
                self.metrics.streams_refused.inc()
            elif type(message) is StepRecord:
                self._telemetry(stream, message, received, pending)
            else:
                self._hello(stream, message)
        except Exception:  # a bug: one frame must not stop the daemon serving everyone
            self._frame_failed(key, pending)

    def _frame_failed(self, key: StreamKey, pending: dict[StreamKey, _Stream]) -> None:
        """A frame's handling raised: counted and logged, its stream afresh, unanswered."""
        self.metrics.internal_errors.inc()
        stream = self.streams.get(key)
        if stream is not None:
            stream.builder.reset()
        pending.pop(key, None)
        self._log_internal_error("specctl_internal_errors_total",
                                 "handling a frame of server %r", key[1])

    def _telemetry(self, stream: _Stream, record: StepRecord, received: float,
                   pending: dict[StreamKey, _Stream]) -> None:
        if record.step_index <= stream.last_step:
            stream.builder.reset()  # the server restarted: a new run
            stream.backlog.clear()
            self.counters["stream_restarts"] += 1
        stream.last_step = record.step_index
        stream.received = received
        pending[stream.key] = stream
        self._telemetry_folded += 1  # counted once per poll (decide): one inc, not one each
        if len(stream.backlog) == stream.backlog.maxlen:
            self.metrics.frames_shed.inc()
        stream.backlog.append(record)  # folded by decide()

    def _hello(self, stream: _Stream, hello: Hello) -> None:
        stream.last_seen = time.monotonic()
        if stream.candidates != hello.candidate_steps:
            stream.candidates = hello.candidate_steps
            stream.allowed = self._allowed(stream.candidates)
        stream.deciding = hello.policy_digest
        if self._wants_policy(stream):
            self._push_policy([stream])

    def _wants_policy(self, stream: _Stream) -> bool:
        """A server deciding locally with another policy than ours, not yet sent ours."""
        digest = self.holder.digest
        return (self.options.push_policies and stream.deciding != ""
                and stream.deciding != digest and stream.pushed != digest)

    def _push_policy(self, streams) -> None:
        """Send the served policy to these streams' connections (once per connection)."""
        holder = self.holder
        if not streams:
            return
        if len(holder.blob) > MAX_POLICY_BYTES:
            if self._too_big_logged != holder.digest:
                self._too_big_logged = holder.digest
                log.warning("policy %r is %d bytes, more than a POLICY message carries "
                            "(%d): not pushed to the servers", holder.policy.name,
                            len(holder.blob), MAX_POLICY_BYTES)
            return
        frame = None
        done: set[bytes] = set()
        for stream in streams:
            if stream.identity not in done:
                frame = frame or encode_policy(PolicyPush(holder.policy.name, holder.digest,
                                                          holder.blob))
                try:
                    self._sock.send(stream.identity, _SNDMORE_NOBLOCK)
                    self._sock.send(frame, _NOBLOCK)
                    self.metrics.policy_pushes.inc()
                except zmq.ZMQError:
                    self.counters["send_failed"] += 1
                    continue
                done.add(stream.identity)
            stream.pushed = holder.digest

    def _count_evictions(self) -> None:
        evicted = self.streams.evicted
        if evicted != self._evicted:
            self.metrics.stream_evictions.inc(evicted - self._evicted)
            self._evicted = evicted
            self.metrics.streams.set(len(self.streams))

    # -- decisions out --------------------------------------------------------------------

    def decide(self, pending: dict[StreamKey, _Stream]) -> list[tuple[_Stream, Decision]]:
        """The decisions for the streams in ``pending``: the latest
        ``answers_per_poll`` records of each answered, in order, all in one batched policy
        evaluation (an earlier record's answer from a copy of its stream's features as
        they were after it: the decision local mode makes on that record)."""
        if not pending:
            self.metrics.telemetry.inc(self._telemetry_folded)  # accepted, then its stream failed
            self._telemetry_folded = 0
            return []
        options = self.options
        answers = (1 if self._busy_s > options.overload_busy_s
                   else max(options.answers_per_poll, 1))
        out = self._answer(self._fold(list(pending.values()), answers))
        self.metrics.telemetry.inc(self._telemetry_folded)
        self._telemetry_folded = 0
        return out

    def _fold(self, streams: list[_Stream], answers: int) -> list[_Answer]:
        """Fold each stream's new records; one entry per record to answer (each stream's
        latest ``answers``): the features after it (the stream's own builder after its
        last record, a copy after an earlier one), or None where folding failed (that
        stream is reset and answered with a fallback)."""
        entries: list[_Answer] = []
        # _Answer(...) without its Python-level __new__ (the same tuple; a call less per answer)
        new, answer = tuple.__new__, _Answer
        for stream in streams:
            backlog, builder = stream.backlog, stream.builder
            unanswered = len(backlog) - answers  # the oldest are folded without an answer
            try:
                while backlog:
                    record = backlog.popleft()
                    if record.prefill_tokens == 0:
                        stream.batch_size = record.batch_size
                    builder.update(record)
                    unanswered -= 1
                    if unanswered < 0:
                        entries.append(new(answer, (stream, builder.copy() if backlog else builder,
                                                    record, stream.batch_size)))
            except Exception:  # a bug, or a record the estimators cannot take
                self._reset_failed(stream)
                entries.append(_Answer(stream, None, record, stream.batch_size))
        return entries

    def _answer(self, entries: list[_Answer]) -> list[tuple[_Stream, Decision]]:
        """One decision per entry (one batched policy evaluation), in order."""
        policy = self.holder.policy
        grid = policy.feature_spec.batch_grid
        grids = self._observation_grids(entries)
        probe = self._probe
        probing = probing_flags(probe, [e.builder for e in entries])
        index, ok, can = evaluate(policy, grids, [e.stream.allowed for e in entries],
                                  probing, probe, self._guard)
        if probing is not None and any(probing):
            self.metrics.probing.inc(sum(map(bool, probing)))
        if False in ok:
            entries, index, ok, can = self._after_nonfinite(entries, grids, index, ok, can)
        metrics, shadow = self.metrics, self.options.shadow
        now = time.monotonic()
        out = []
        chosen_counts: dict[int, int] = {}  # counted per poll: one inc per value
        # Each entry's chosen actions as bytes (8 per grid row): the key of its wire
        # form, made once per distinct decision (see _wire). A bytes slice hashes and
        # compares in one C call; a tuple of 20 ints element by element, and numpy's
        # ~2 us per call on arrays this small cost more than the work.
        # (evaluate's indices are intp: their bytes as they are, no narrowing copy, whose
        # numpy call cost a cold poll ~2.5 us more than the longer key costs to hash)
        codes = index.tobytes()
        width = len(codes) // len(entries) if entries else 0
        cache, wire_of = self._compressed, self._wire
        if len(cache) > _COMPRESSED_CACHE:
            cache.clear()
        name, make = policy.name, new_decision
        start = 0
        start_rule = bool(probe.start_off)  # the start rule's decisions are unheld
        if not shadow and False not in ok and False not in can:  # the common case, lean
            for entry in entries:
                key = codes[start:start + width]
                start += width
                wire = cache.get(key) or wire_of(key, grid)
                stream = entry.stream
                stream.last_seen = now
                seq = stream.seq = stream.seq + 1
                # the grid entry the answered step's batch falls in
                current = wire[2][max(bisect_right(grid, entry.batch_size) - 1, 0)]
                chosen_counts[current] = chosen_counts.get(current, 0) + 1
                out.append((stream, make(seq, entry.record.step_index + DECISION_LAG, name,
                                         wire[0], wire[1],
                                         start_rule and _unheld(entry, stream, current))))
        else:
            for i, entry in enumerate(entries):
                key = codes[start:start + width]
                start += width
                wire = cache.get(key) or wire_of(key, grid)
                steps = wire[2]
                stream = entry.stream
                stream.last_seen = now
                stream.seq += 1
                answering = entry.record.step_index
                apply_from = answering + DECISION_LAG
                current = steps[max(bisect_right(grid, entry.batch_size) - 1, 0)]
                if not ok[i]:
                    decision = Decision.fallback(stream.seq, apply_from, name)
                elif not can[i]:
                    self._count(metrics.fallbacks, "no_allowed_action")
                    decision = Decision.fallback(stream.seq, apply_from, name)
                elif shadow:
                    self._shadow_steps[current] += 1
                    self._count(metrics.fallbacks, "shadow")
                    log.debug("shadow: %r rank %d step %d: steps %s for grid %s",
                              stream.key[1], stream.key[2], answering, list(steps), grid)
                    decision = Decision.fallback(stream.seq, apply_from, name)
                else:
                    chosen_counts[current] = chosen_counts.get(current, 0) + 1
                    decision = make(stream.seq, apply_from, name, wire[0], wire[1],
                                    start_rule and _unheld(entry, stream, current))
                out.append((stream, decision))
        add = metrics.steps_chosen.add
        for steps, count in chosen_counts.items():
            add(steps, count)
        return out

    def _wire(self, key: bytes, grid) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """A decision's wire form (grid entries repeating the previous entry's steps
        dropped: :func:`controller.decider.compress`, as local mode) and its steps per
        grid row, from its actions' indices as bytes (see _answer). The same steps recur
        from step to step: each form is made once (emptied on reload)."""
        actions = self._action_list
        steps = tuple(actions[i] for i in np.frombuffer(key, np.intp).tolist())
        wire = self._compressed[key] = (*compress(grid, steps), steps)
        return wire

    def _after_nonfinite(self, entries: list[_Answer], grids, index: np.ndarray,
                         healthy: list[bool], runnable: list[bool]):
        """A non-finite observation (estimator overflow): its stream starts afresh, as local
        mode does, so that stream's later records in this poll are folded again into the
        fresh features and evaluated one by one (rare: the batch stays for the others)."""
        keep = [True] * len(entries)
        redo: list[_Answer] = []
        reset: set[int] = set()
        for i, ok in enumerate(healthy):
            if ok:
                continue
            stream = entries[i].stream
            if grids[i] is None or id(stream) in reset:
                continue  # folding failed (reset already), or dropped below
            reset.add(id(stream))
            stream.builder.reset()
            self._count(self.metrics.stream_resets, "nonfinite")
            for j in range(i + 1, len(entries)):
                if entries[j].stream is stream:
                    keep[j] = False
                    redo.append(entries[j])
        if not redo:
            return entries, index, healthy, runnable
        policy = self.holder.policy
        kept = [i for i, k in enumerate(keep) if k]
        entries = [entries[i] for i in kept]
        indexes = [index[kept]]
        healthy = [healthy[i] for i in kept]
        runnable = [runnable[i] for i in kept]
        for entry in redo:  # in order: each stream's later records, each after the last
            stream = entry.stream
            try:
                stream.builder.update(entry.record)
                grid = [stream.builder.observation_grid()]
            except Exception:
                self._reset_failed(stream)
                grid = [None]
            probing = None if grid[0] is None else probing_flags(self._probe, [stream.builder])
            chosen, ok, can = evaluate(policy, grid, [stream.allowed], probing, self._probe,
                                       self._guard)
            if not ok[0] and grid[0] is not None:
                stream.builder.reset()
                self._count(self.metrics.stream_resets, "nonfinite")
            entries.append(_Answer(stream, stream.builder, entry.record, entry.batch_size))
            indexes.append(chosen)
            healthy += ok
            runnable += can
        return entries, np.concatenate(indexes), healthy, runnable

    def _observation_grids(self, entries: list[_Answer]) -> np.ndarray | list:
        """The entries' observation grids in one batched computation, shape (entries, grid
        rows, size). Should a stream's estimators fail, it is reset and the others are
        computed one by one (a list with None for the failed ones): one stream must not
        cost the others their answer."""
        builders = [e.builder for e in entries]
        if None not in builders:
            try:
                return observation_grids(builders)
            except Exception:  # e.g. LinAlgError in one stream: find it below
                pass
        grids: list[np.ndarray | None] = []
        for entry, builder in zip(entries, builders, strict=True):
            try:
                grids.append(None if builder is None else builder.observation_grid())
            except Exception:
                self._reset_failed(entry.stream)
                grids.append(None)
        return grids

    def _reset_failed(self, stream: _Stream) -> None:
        stream.builder.reset()
        stream.backlog.clear()
        self._count(self.metrics.stream_resets, "error")
        self._log_internal_error("specctl_stream_resets_total",
                                 "computing the features of server %r", stream.key[1])

    def _send(self, decisions: list[tuple[_Stream, Decision]]) -> int:
        sock, metrics = self._sock, self.metrics
        send, clock = _BACKEND_SEND, time.perf_counter
        latencies = []
        for stream, decision in decisions:
            # Two sends with plain int flags: send_multipart's loop and enum flag
            # arithmetic cost more than the sends at this rate. A ROUTER drops (never
            # half-sends) a message to a peer that is gone or full; with ROUTER_MANDATORY
            # unset the first part cannot fail for that reason.
            try:
                send(sock, stream.identity, _SNDMORE_NOBLOCK)
                send(sock, encode_decision(decision), _NOBLOCK)
            except zmq.ZMQError:  # the peer is gone or its queue is full
                self.counters["send_failed"] += 1
                continue
            latencies.append(clock() - stream.received)
        if latencies:
            metrics.latency.observe_many(latencies)
            metrics.decisions.inc(len(latencies))
        return len(latencies)

    # -- internals ------------------------------------------------------------------------

    def _count(self, counter, label: object, amount: int = 1) -> None:
        """Increment a one-label counter; children are cached (``labels()`` takes a lock)."""
        child = self._children.get((counter, label))
        if child is None:
            child = self._children[(counter, label)] = counter.labels(str(label))
        child.inc(amount)

    def _log_internal_error(self, metric: str, what: str, *args: object) -> None:
        """Log with traceback, at most once a second (a flood must not flood the log too)."""
        now = time.monotonic()
        if now >= self._next_error_log:
            self._next_error_log = now + 1.0
            log.exception(f"internal error {what} (counted in {metric}; serving goes on)",
                          *args)

    def _new_stream(self, key: StreamKey) -> _Stream:
        stream = _Stream(key, FeatureBuilder(self.holder.policy.feature_spec, self.cost_prior,
                                             probe=self._probe),
                         max(self.options.max_records_per_poll, 1))
        stream.last_seen = time.monotonic()
        self.metrics.streams.set(len(self.streams) + 1)
        log.debug("new stream: server %r rank %d", key[1], key[2])
        return stream

    def _set_actions(self, policy: ExportedPolicy) -> None:
        self._policy_actions = np.asarray(policy.actions)
        self._action_list = list(policy.actions)
        self._probe, self._guard = (self._served_rule(policy, name) for name in RULES)

    def _served_rule(self, policy: ExportedPolicy, name: str):
        """The policy's rule ``name`` (probe, guard) with this daemon's overrides."""
        changes = getattr(self.options, name)
        try:
            return served_rule(policy, name, changes)
        except ValueError as exc:  # a reloaded file the override does not fit
            log.error("%s override %s does not fit policy %r (%s): its own %s serves",
                      name, changes, policy.name, exc, name)
            return getattr(policy, name)

    def _allowed(self, candidates: tuple[int, ...] | None) -> np.ndarray | None:
        return allowed_actions(self._policy_actions, candidates)

    def _on_reload(self, old: ExportedPolicy, new: ExportedPolicy) -> None:
        self.metrics.reloads.labels(result="ok").inc()
        self.metrics.set_policy(new.name, str(self.holder.path))
        probe = self._probe
        self._set_actions(new)
        self._compressed = {}  # the grid and the actions may differ
        same_spec = new.feature_spec == old.feature_spec
        if not same_spec:
            log.warning("the new policy uses another feature spec: streams start afresh")
        for stream in self.streams:
            if not same_spec:
                stream.builder = FeatureBuilder(new.feature_spec, self.cost_prior,
                                                probe=self._probe)
            elif self._probe != probe:  # e.g. the probe's A/B: a file with another probe
                stream.builder.set_probe(self._probe)
            stream.allowed = self._allowed(stream.candidates)
        # The fleet hub: every server deciding locally gets the new policy.
        self._push_policy([s for s in self.streams if self._wants_policy(s)])

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + 10.0
        limit = self.options.stream_idle_s
        dropped = self.streams.drop_idle(lambda s: now - s.last_seen > limit)
        self._freed += dropped + self.streams.evicted - self._evicted_at_sweep
        self._evicted_at_sweep = self.streams.evicted
        if self._freed >= _TRIM_AFTER_STREAMS:  # give a burst's memory back
            self._freed = 0
            trim_heap()
        self.metrics.streams.set(len(self.streams))

    def _log_summary(self, now: float) -> None:
        self._next_log = now + self.options.log_every_s
        if self.options.shadow and self._shadow_steps:
            log.info("shadow mode: the policy would have chosen steps %s (count per steps)",
                     dict(sorted(self._shadow_steps.items())))
            self._shadow_steps.clear()


"""The controller daemon's core: telemetry in, speculation decisions out.

One ROUTER socket serves any number of SGLang servers and ranks. Each
(server, rank) stream has its own :class:`env.features.FeatureBuilder` (the
policy file's feature spec), so observations are built exactly as in training.
Every poll drains all pending frames, folds each stream's records into its
builder, then evaluates the policy once for all streams that sent telemetry:
one batched MLP forward over every stream's ``observation_grid()`` (a row per
batch-size grid value). Each of those streams gets one DECISION, answering its
latest record (latest wins): steps per grid value, restricted to the steps the
server offers (its HELLO), ``apply_from_step = step_index + DECISION_LAG``.
In shadow mode the decision is computed and logged but the reply says "use
your fallback".
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import zmq

from controller.metrics import Metrics
from controller.policy_file import ExportedPolicy
from controller.reload import PolicyHolder
from controller.security import CurveConfig, apply_curve_server, check_endpoint
from controller.wire import (
    DECISION_LAG,
    Decision,
    Hello,
    WireError,
    apply_socket_limits,
    decode,
    encode_decision,
)
from env.features import FeatureBuilder
from env.schema import StepRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """How the daemon runs (``configs/serve.yaml`` documents each)."""

    endpoint: str = "ipc:///tmp/specctl-serve.sock"
    shadow: bool = False
    max_streams: int = 4096
    stream_idle_s: float = 600.0
    max_drain: int = 8192
    log_every_s: float = 60.0
    curve: CurveConfig | None = None


class _Stream:
    """One (server, rank): its feature builder and where to answer."""

    __slots__ = ("allowed", "batch_size", "builder", "candidates", "identity", "key",
                 "last_seen", "last_step", "received", "seq")

    def __init__(self, key: tuple[str, int], builder: FeatureBuilder) -> None:
        self.key = key
        self.builder = builder
        self.identity = b""
        self.seq = 0
        self.last_step = -1
        self.batch_size = 1
        self.candidates: tuple[int, ...] | None = None
        self.allowed: np.ndarray | None = None
        self.last_seen = 0.0
        self.received = 0.0


class ControllerServer:
    """Binds the ROUTER socket; :meth:`run` serves until the stop event is set.

    Args:
        holder: The policy being served (reloaded between polls).
        options: Endpoint, shadow mode, limits.
        metrics: Where to count (a private one if None).
        cost_prior: The servers' cost profile (fitted from their recorded traces),
            the prior of the features' latency model; None = telemetry only.
    """

    def __init__(self, holder: PolicyHolder, options: ServeOptions,
                 metrics: Metrics | None = None, cost_prior=None) -> None:
        check_endpoint(options.endpoint, options.curve)
        self.holder = holder
        # The servers' cost profile: the feature module's latency prior (see env.features).
        self.cost_prior = cost_prior
        self.options = options
        self.metrics = metrics or Metrics()
        self.counters: Counter[str] = Counter()
        self._streams: dict[tuple[str, int], _Stream] = {}
        self._shadow_steps: Counter[int] = Counter()
        self._children: dict[tuple, object] = {}
        self._policy_actions = np.asarray(holder.policy.actions)
        self._context = zmq.Context(io_threads=1)
        sock = self._context.socket(zmq.ROUTER)
        apply_socket_limits(sock)
        # A short queue per peer: telemetry that would wait longer is better dropped
        # (the server counts it) than answered late (the server ignores late answers).
        sock.setsockopt(zmq.RCVHWM, 256)
        sock.setsockopt(zmq.SNDHWM, 1024)
        self._auth = None
        if options.curve is not None:
            self._auth = apply_curve_server(sock, self._context, options.curve)
        sock.bind(options.endpoint)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._next_sweep = time.monotonic() + 10.0
        self._next_log = time.monotonic() + options.log_every_s
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
        return self._answer(self._drain())

    def close(self) -> None:
        """Close the socket (an ipc:// path is removed by ZeroMQ)."""
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    # -- internals ------------------------------------------------------------------------

    def _drain(self) -> dict[tuple[str, int], _Stream]:
        """Read every pending frame; returns the streams that sent telemetry."""
        sock, streams, errors = self._sock, self._streams, self.metrics.wire_errors
        pending: dict[tuple[str, int], _Stream] = {}
        records = 0
        for _ in range(self.options.max_drain):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            received = time.perf_counter()
            if len(parts) != 2:
                errors.labels(kind="malformed").inc()
                continue
            identity, frame = parts
            try:
                message = decode(frame)
            except WireError as exc:
                errors.labels(kind=exc.kind).inc()
                continue
            if type(message) is StepRecord:
                key = (message.server, message.rank)
                stream = streams.get(key) or self._new_stream(key)
                if message.step_index <= stream.last_step:
                    stream.builder.reset()  # the server restarted: a new run
                    self.counters["stream_restarts"] += 1
                stream.builder.update(message)
                stream.last_step = message.step_index
                if message.prefill_tokens == 0:
                    stream.batch_size = message.batch_size
                stream.identity = identity
                stream.received = received
                pending[key] = stream
                records += 1
            elif type(message) is Hello:
                key = (message.server, message.rank)
                stream = streams.get(key) or self._new_stream(key)
                stream.identity = identity
                if stream.candidates != message.candidate_steps:
                    stream.candidates = message.candidate_steps
                    stream.allowed = self._allowed(stream.candidates)
            else:
                errors.labels(kind="kind").inc()  # a DECISION sent to the controller
        if records:
            self.metrics.telemetry.inc(records)
        return pending

    def _answer(self, pending: dict[tuple[str, int], _Stream]) -> int:
        if not pending:
            return 0
        policy = self.holder.policy
        streams = list(pending.values())
        grid = policy.feature_spec.batch_grid
        rows = len(grid)
        observations = np.concatenate([s.builder.observation_grid() for s in streams])
        logits = policy.logits(observations)
        allowed = np.ones((len(streams), logits.shape[1]), dtype=bool)
        for i, stream in enumerate(streams):
            if stream.allowed is not None:
                allowed[i] = stream.allowed
        logits = np.where(np.repeat(allowed, rows, axis=0), logits, -np.inf)
        chosen = self._policy_actions[np.argmax(logits, axis=1)].reshape(len(streams), rows)
        sock, metrics, shadow = self._sock, self.metrics, self.options.shadow
        sent = 0
        now = time.monotonic()
        for i, stream in enumerate(streams):
            stream.last_seen = now
            stream.seq += 1
            apply_from = stream.last_step + DECISION_LAG
            steps = chosen[i].tolist()
            current = steps[max(bisect.bisect_right(grid, stream.batch_size) - 1, 0)]
            if not allowed[i].any():
                self._count(metrics.fallbacks, "no_allowed_action")
                decision = Decision.fallback(stream.seq, apply_from, policy.name)
            elif shadow:
                self._shadow_steps[current] += 1
                self._count(metrics.fallbacks, "shadow")
                log.debug("shadow: %s rank %d step %d: steps %s for grid %s", *stream.key,
                          stream.last_step, steps, grid)
                decision = Decision.fallback(stream.seq, apply_from, policy.name)
            else:
                self._count(metrics.steps_chosen, current)
                decision = Decision(stream.seq, apply_from, policy.name, *_compress(grid, steps))
            try:
                sock.send_multipart([stream.identity, encode_decision(decision)], zmq.NOBLOCK)
            except zmq.ZMQError:  # the peer is gone or its queue is full
                self.counters["send_failed"] += 1
                continue
            metrics.latency.observe(time.perf_counter() - stream.received)
            sent += 1
        metrics.decisions.inc(sent)
        return sent

    def _count(self, counter, label: object) -> None:
        """Increment a one-label counter; children are cached (``labels()`` takes a lock)."""
        child = self._children.get((counter, label))
        if child is None:
            child = self._children[(counter, label)] = counter.labels(str(label))
        child.inc()

    def _new_stream(self, key: tuple[str, int]) -> _Stream:
        if len(self._streams) >= self.options.max_streams:
            oldest = min(self._streams.values(), key=lambda s: s.last_seen)
            del self._streams[oldest.key]
        stream = _Stream(key, FeatureBuilder(self.holder.policy.feature_spec, self.cost_prior))
        stream.last_seen = time.monotonic()
        self._streams[key] = stream
        self.metrics.streams.set(len(self._streams))
        log.info("new stream: server %r rank %d", *key)
        return stream

    def _allowed(self, candidates: tuple[int, ...] | None) -> np.ndarray | None:
        if candidates is None:
            return None
        return np.isin(self._policy_actions, np.asarray(candidates, dtype=np.int64))

    def _on_reload(self, old: ExportedPolicy, new: ExportedPolicy) -> None:
        self.metrics.reloads.labels(result="ok").inc()
        self.metrics.set_policy(new.name, str(self.holder.path))
        self._policy_actions = np.asarray(new.actions)
        same_spec = new.feature_spec == old.feature_spec
        if not same_spec:
            log.warning("the new policy uses another feature spec: streams start afresh")
        for stream in self._streams.values():
            if not same_spec:
                stream.builder = FeatureBuilder(new.feature_spec, self.cost_prior)
            stream.allowed = self._allowed(stream.candidates)

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + 10.0
        limit = self.options.stream_idle_s
        idle = [k for k, s in self._streams.items() if now - s.last_seen > limit]
        for key in idle:
            del self._streams[key]
        self.metrics.streams.set(len(self._streams))

    def _log_summary(self, now: float) -> None:
        self._next_log = now + self.options.log_every_s
        if self.options.shadow and self._shadow_steps:
            log.info("shadow mode: the policy would have chosen steps %s (count per steps)",
                     dict(sorted(self._shadow_steps.items())))
            self._shadow_steps.clear()


def _compress(grid: tuple[int, ...], steps: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Drop grid entries that repeat the previous entry's steps (same meaning, fewer bytes)."""
    out_grid, out_steps = [grid[0]], [steps[0]]
    for size, step in zip(grid[1:], steps[1:], strict=True):
        if step != out_steps[-1]:
            out_grid.append(size)
            out_steps.append(step)
    return tuple(out_grid), tuple(out_steps)

"""Prometheus metrics of the controller daemon (its own registry, served over HTTP).

==========================================  =========  ====================================
metric                                      type       meaning
==========================================  =========  ====================================
specctl_decisions_total                     counter    decisions sent (rate = decisions/s)
specctl_decision_latency_seconds            histogram  telemetry received -> decision sent
specctl_telemetry_records_total             counter    telemetry messages accepted
specctl_wire_errors_total{kind}             counter    rejected frames (see controller.wire)
specctl_frames_shed_total                  counter    frames skipped unread: more than
                                                       max_records_per_poll from one
                                                       connection waited (an overloaded
                                                       daemon or a flooding client)
specctl_wire_range_errors_total{field}      counter    values outside physical ranges, by field
specctl_streams_refused_total               counter    frames refused: their peer opens
                                                       streams too fast
specctl_stream_evictions_total              counter    streams evicted (table or peer full)
specctl_stream_resets_total{reason}         counter    streams reset: non-finite features
                                                       (nonfinite) or an estimator error
                                                       (error)
specctl_internal_errors_total               counter    frames whose handling failed (a bug:
                                                       logged, the daemon goes on)
specctl_steps_chosen_total{steps}           counter    steps chosen for each stream's
                                                       current batch size
specctl_fallback_replies_total{reason}      counter    "use your fallback" replies
                                                       (shadow, no_allowed_action)
specctl_policy_reloads_total{result}        counter    policy reloads (ok, error)
specctl_policy_pushes_total                 counter    POLICY messages sent to servers
                                                       (fleet hub: on reload, on connect)
specctl_streams                             gauge      (server, rank) streams being served
specctl_policy_info{name,path}              gauge      1 for the policy being served
==========================================  =========  ====================================
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: Observations per call up to which a Python loop is cheaper than numpy.
_FEW = 16
_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3)


class BatchHistogram(Collector):
    """A Prometheus histogram observed a poll's values at a time (one lock per poll, and
    one numpy call for a large poll, instead of ``Histogram.observe`` per decision, whose
    lock and bucket loop cost more than a tenth of a decision); exposed through the
    registry like any histogram."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc = name, documentation
        self._bounds = np.asarray(buckets, dtype=float)
        self._bound_list = self._bounds.tolist()
        self._counts = [0] * (len(buckets) + 1)  # the last: above all
        self._sum = 0.0
        self._lock = threading.Lock()  # observe (the serving thread) vs collect (HTTP)
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        """Count every value (seconds) of ``values``."""
        counts = self._counts
        if len(values) <= _FEW:  # a poll of few streams: bisect beats numpy's call costs
            # bisect_left: a value equal to a bound belongs to that bound's bucket (le).
            index = [bisect_left(self._bound_list, v) for v in values]
            total = sum(values)
            with self._lock:
                for i in index:
                    counts[i] += 1
                self._sum += total
            return
        values = np.asarray(values, dtype=float)
        index = np.searchsorted(self._bounds, values, side="left")
        added = np.bincount(index, minlength=len(counts)).tolist()
        total = float(values.sum())
        with self._lock:
            for i, count in enumerate(added):
                counts[i] += count
            self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            cumulative = list(accumulate(self._counts))
            total = self._sum
        buckets = [(floatToGoString(b), c) for b, c in zip(self._bounds.tolist(), cumulative,
                                                        strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        yield HistogramMetricFamily(self._name, self._doc, buckets=buckets, sum_value=total)


class Metrics:
    """The daemon's metrics; :meth:`serve` exposes them on ``http://host:port/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("specctl_decisions", "Decisions sent", registry=r)
        self.latency = BatchHistogram("specctl_decision_latency_seconds",
                                      "Telemetry received to decision sent",
                                      _LATENCY_BUCKETS, r)
        self.telemetry = Counter("specctl_telemetry_records", "Telemetry messages accepted",
                                 registry=r)
        self.wire_errors = Counter("specctl_wire_errors", "Rejected frames", ["kind"],
                                   registry=r)
        self.frames_shed = Counter("specctl_frames_shed", "Frames shed unread under overload",
                                   registry=r)
        self.range_errors = Counter("specctl_wire_range_errors", "Out-of-range values",
                                    ["field"], registry=r)
        self.streams_refused = Counter("specctl_streams_refused",
                                       "Frames refused: peer opens streams too fast", registry=r)
        self.stream_evictions = Counter("specctl_stream_evictions", "Streams evicted",
                                        registry=r)
        self.stream_resets = Counter("specctl_stream_resets", "Streams reset", ["reason"],
                                     registry=r)
        self.internal_errors = Counter("specctl_internal_errors", "Frames whose handling failed",
                                       registry=r)
        self.steps_chosen = Counter("specctl_steps_chosen", "Steps chosen", ["steps"],
                                    registry=r)
        self.fallbacks = Counter("specctl_fallback_replies", "Use-your-fallback replies",
                                 ["reason"], registry=r)
        self.reloads = Counter("specctl_policy_reloads", "Policy reloads", ["result"],
                               registry=r)
        self.policy_pushes = Counter("specctl_policy_pushes", "Policies pushed to servers",
                                     registry=r)
        self.probing = Counter("specctl_probing_decisions",
                               "Decisions made while a stream's acceptance probe (rows the "
                               "policy left off run the probe's depth) or off probe (rows "
                               "that speculate run off) was due (env/probe.py)",
                               registry=r)
        self.streams = Gauge("specctl_streams", "Streams being served", registry=r)
        self.policy_info = Gauge("specctl_policy_info", "Policy being served",
                                 ["name", "path"], registry=r)
        self._server = None

    def set_policy(self, name: str, path: str) -> None:
        """Mark ``name`` as the policy being served."""
        self.policy_info.clear()
        self.policy_info.labels(name=name, path=path).set(1)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Start the HTTP endpoint (a daemon thread)."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)

    @property
    def port(self) -> int | None:
        """The port actually bound (None: not serving)."""
        return self._server.server_port if self._server is not None else None

    def close(self) -> None:
        """Stop the HTTP endpoint."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

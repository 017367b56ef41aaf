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

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: Observations per call up to which a Python loop is cheaper than numpy.
_FEW = 16
_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3)


class BatchHistogram(Collector):
    """A Prometheus histogram observed a poll's values at a time (one numpy call for a
    large poll, instead of ``Histogram.observe`` per decision, whose lock and bucket loop
    cost more than a tenth of a decision); exposed through the registry like any
    histogram.

    One writer only (the serving thread), and no lock: a scrape copies the counts (one C
    call, whole under the GIL) and may see a poll's counts before its sum (the next
    scrape has both); the lock it had cost a cold one-stream poll a few us
    (docs/ONLINE.md, twenty-fourth pass).
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc = name, documentation
        self._bounds = np.asarray(buckets, dtype=float)
        self._bound_list = self._bounds.tolist()
        self._counts = [0] * (len(buckets) + 1)  # the last: above all
        self._sum = 0.0
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        """Count every value (seconds) of ``values``."""
        counts = self._counts
        if len(values) <= _FEW:  # a poll of few streams: bisect beats numpy's call costs
            bounds = self._bound_list
            for value in values:
                # bisect_left: a value equal to a bound belongs to that bound's bucket (le).
                counts[bisect_left(bounds, value)] += 1
            self._sum += sum(values)
            return
        values = np.asarray(values, dtype=float)
        index = np.searchsorted(self._bounds, values, side="left")
        added = np.bincount(index, minlength=len(counts)).tolist()
        for i, count in enumerate(added):
            counts[i] += count
        self._sum += float(values.sum())

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = list(accumulate(list(self._counts)))
        total = self._sum
        buckets = [(floatToGoString(b), c) for b, c in zip(self._bounds.tolist(), cumulative,
                                                        strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        yield HistogramMetricFamily(self._name, self._doc, buckets=buckets, sum_value=total)


class PollCounter(Collector):
    """A Prometheus counter the serving thread adds to every poll, with a plain integer
    addition: ``Counter.inc`` is three Python calls and a lock, ~1 us warm and several
    times that in a 1-kHz server's poll, run with the caches cold (three a poll cost
    6-13% of a one-stream poll: docs/ONLINE.md, twenty-fourth pass).

    One writer only (the serving thread): a scrape reads ints, whole under the GIL.
    ``label``: the one label's name; then count with :meth:`add` (by label value), else
    with :meth:`inc`. Exposed through the registry like any counter.
    """

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry,
                 label: str | None = None) -> None:
        self._name, self._doc, self._label = name, documentation, label
        self._created = time.time()
        #: The count (a counter without a label).
        self.value = 0
        #: The counts by label value (a counter with a label; ``str()`` at a scrape).
        self.by_label: dict[object, int] = {}
        registry.register(self)

    def inc(self, amount: int = 1) -> None:
        """Add ``amount`` (a counter without a label)."""
        self.value += amount

    def add(self, value: object, amount: int = 1) -> None:
        """Add ``amount`` to the count labelled ``value`` (exposed as ``str(value)``)."""
        self.by_label[value] = self.by_label.get(value, 0) + amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        if self._label is None:
            yield CounterMetricFamily(self._name, self._doc, value=self.value,
                                      created=self._created)
            return
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, count in list(self.by_label.items()):  # one C call: whole under the GIL
            family.add_metric([str(value)], count, created=self._created)
        yield family


class Metrics:
    """The daemon's metrics; :meth:`serve` exposes them on ``http://host:port/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The three counted every poll: PollCounter (the others are rare: Counter)
        self.decisions = PollCounter("specctl_decisions", "Decisions sent", r)
        self.latency = BatchHistogram("specctl_decision_latency_seconds",
                                      "Telemetry received to decision sent",
                                      _LATENCY_BUCKETS, r)
        self.telemetry = PollCounter("specctl_telemetry_records",
                                     "Telemetry messages accepted", r)
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
        self.steps_chosen = PollCounter("specctl_steps_chosen", "Steps chosen", r,
                                        label="steps")
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

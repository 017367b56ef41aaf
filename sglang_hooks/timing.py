"""Measuring the plugin's own time on the scheduler thread (``SPECCTL_HOOK_TIMING=<file>``).

Off by default. When on, every hook (and the policy's two methods) adds the time
spent in its own body, excluding the SGLang code it wraps, to the current
scheduler step; a step ends when the next one is launched. The wrappers' own cost
(their ``perf_counter_ns`` calls, the closure an AROUND wrapper builds: about
0.1-0.5 us per hook) is measured once at start-up, on do-nothing hooks, and
subtracted from every call, so the numbers are the plugin's time, not the
instrument's. SGLang's own adaptive rule, which the policy's methods call
(:meth:`HookClock.outside`), is SGLang's time and is taken out too: SGLang runs
it without the plugin as well. (Measured warm: on a cold cache the wrappers cost more, so the
subtraction errs on the side of reporting too much.)

Ending a step costs O(1) on the scheduler thread: the step's total goes into a
fixed log-linear histogram (16 sub-buckets per power of two, so a percentile is
within 1/16 = 6.25% of the true value; max and mean are exact). A daemon thread
writes the percentiles to the file as JSON every few seconds, because SGLang
ends scheduler processes with SIGKILL (so there is no "at exit"). Nothing here
raises into SGLang: a file that cannot be written is logged once and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_WRITE_EVERY_S = 5.0
#: Sub-buckets per power of two (2**_SUB_BITS).
_SUB_BITS = 4
_SUB = 1 << _SUB_BITS
#: Buckets: values below _SUB exactly, then _SUB per octave up to 2**63 ns.
_BUCKETS = _SUB * (64 - _SUB_BITS + 1)


def bucket_of(ns: int) -> int:
    """Histogram bucket of a non-negative duration in ns (log-linear, O(1))."""
    if ns < _SUB:
        return max(ns, 0)
    shift = ns.bit_length() - _SUB_BITS - 1
    # The top _SUB_BITS + 1 bits: a leading 1 and the sub-bucket within the octave.
    return (shift + 1) * _SUB + ((ns >> shift) - _SUB)


def bucket_low(index: int) -> int:
    """Smallest duration (ns) that falls in bucket ``index``."""
    if index < _SUB:
        return index
    octave, sub = divmod(index, _SUB)
    return (_SUB + sub) << (octave - 1)


class HookClock:
    """Per-step totals of the plugin's time on the scheduler thread.

    Args:
        path: JSON file the summary is written to.
        write_every_s: Seconds between two writes by the background thread
            (0: no thread; call :meth:`write` yourself).
    """

    def __init__(self, path: str, write_every_s: float = _WRITE_EVERY_S) -> None:
        self.path = path
        self.current_ns = 0
        self.counts = [0] * _BUCKETS
        self.total_steps = 0
        self.total_ns = 0
        self.max_ns = 0
        self._write_failed = False
        self._write_every_s = write_every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: What one call of a wrapper adds by itself (ns), subtracted from every call.
        self.plain_overhead_ns = 0
        self.around_overhead_ns = 0
        self.outside_overhead_ns = 0
        self.plain_overhead_ns, self.around_overhead_ns, outside = self._calibrate()
        self.outside_overhead_ns = max(outside - self.plain_overhead_ns, 0)

    def _calibrate(self, calls: int = 2000) -> tuple[int, int, int]:
        """Median time a wrapper records around a do-nothing hook (plain, AROUND, and
        plain around a call of a do-nothing :meth:`outside`)."""
        def nothing(*args: Any) -> None:
            return None

        def around_nothing(original: Callable, *args: Any) -> Any:
            return original(*args)

        untimed = self.outside(nothing)
        medians = []
        for wrapped, args in ((self.plain(nothing), ()), (self.around(around_nothing),
                                                           (nothing,)),
                              (self.plain(lambda: untimed()), ())):
            recorded = []
            for _ in range(calls):
                self.current_ns = 0
                wrapped(*args)
                recorded.append(self.current_ns)
            recorded.sort()
            medians.append(max(recorded[calls // 2], 0))
        self.current_ns = 0
        return medians[0], medians[1], medians[2]

    def _start_writer(self) -> None:
        # Started by the first step, in the scheduler process itself (not a parent
        # that might fork it away).
        self._thread = threading.Thread(target=self._write_loop, name="specctl-hook-timing",
                                        daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # no threads left: keep counting, write on close only
            log.warning("specctl: hook timing writer thread not started: %s", exc)

    def end_step(self) -> None:
        """Close the running step (called when the next one is launched); O(1)."""
        ns = max(self.current_ns, 0)  # the subtracted overhead can exceed a tiny step
        self.current_ns = 0
        self.counts[bucket_of(ns)] += 1
        self.total_steps += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns
        if self._thread is None and self._write_every_s > 0:
            self._start_writer()

    def summary(self) -> dict[str, float]:
        """Percentiles (microseconds) of the per-step totals so far.

        A percentile is the lower edge of its histogram bucket (at most 6.25% below
        the true value); ``max_us`` and ``mean_us`` are exact.
        """
        # A copy first: the scheduler thread keeps adding while this runs elsewhere.
        counts = np.array(self.counts, dtype=np.int64)
        steps = int(counts.sum())
        if not steps:
            return {"steps": 0}
        cumulative = np.cumsum(counts)

        def pct(q: float) -> float:
            rank = min(steps - 1, int(q * steps))
            index = int(np.searchsorted(cumulative, rank, side="right"))
            return bucket_low(index) / 1e3

        return {"steps": steps, "p50_us": pct(0.5), "p90_us": pct(0.9),
                "p99_us": pct(0.99), "max_us": self.max_ns / 1e3,
                "mean_us": self.total_ns / max(self.total_steps, 1) / 1e3,
                "subtracted_per_call_us": {"plain": self.plain_overhead_ns / 1e3,
                                           "around": self.around_overhead_ns / 1e3,
                                           "outside": self.outside_overhead_ns / 1e3}}

    def write(self) -> bool:
        """Write the summary atomically; False (logged once) if the file cannot be written."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.summary(), f)
            os.replace(tmp, self.path)
        except Exception as exc:  # never into SGLang, never a crash of the writer thread
            if not self._write_failed:
                log.warning("specctl: SPECCTL_HOOK_TIMING file %s cannot be written (%s); "
                            "hook timing goes on but is not saved", self.path, exc)
            self._write_failed = True
            return False
        self._write_failed = False
        return True

    def close(self) -> None:
        """Stop the writer thread after one last write."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(5.0)
        else:
            self.write()

    def _write_loop(self) -> None:
        while not self._stop.wait(self._write_every_s):
            self.write()
        self.write()

    # -- wrappers -------------------------------------------------------------------------

    def around(self, hook: Callable) -> Callable:
        """Time an AROUND hook, minus the wrapped original."""
        def timed(original: Callable, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            inner = 0

            def timed_original(*a: Any, **k: Any) -> Any:
                nonlocal inner
                s = time.perf_counter_ns()
                try:
                    return original(*a, **k)
                finally:
                    inner += time.perf_counter_ns() - s

            try:
                return hook(timed_original, *args, **kwargs)
            finally:
                self.current_ns += (time.perf_counter_ns() - start - inner
                                    - self.around_overhead_ns)
        return timed

    def outside(self, sglang: Callable) -> Callable:
        """Wrap SGLang code that a timed plugin method calls (SGLang's own adaptive rule):
        its time, and this wrapper's, is taken out of the step's total."""
        def untimed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return sglang(*args, **kwargs)
            finally:
                self.current_ns -= (time.perf_counter_ns() - start
                                    + self.outside_overhead_ns)
        return untimed

    def plain(self, hook: Callable) -> Callable:
        """Time a BEFORE/AFTER hook (or a policy method) entirely."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return hook(*args, **kwargs)
            finally:
                self.current_ns += time.perf_counter_ns() - start - self.plain_overhead_ns
        return timed

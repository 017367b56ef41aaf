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

A step is one scheduler-loop iteration that launched a batch. Iterations that
launched nothing (the server idle between requests spins its loop, calling the
input hooks each time) are counted apart (``idle_iterations``), not added to the next
step: a second of idle polling would otherwise read as one step of tens of ms. Each
hook's own time per call is kept too (``per_hook``), and so are the garbage
collections that ran while a plugin hook was on the scheduler thread (``gc``), so that
a slow step says where its time went.

Ending a step costs O(1) on the scheduler thread: the step's total goes into a
fixed log-linear histogram (16 sub-buckets per power of two, so a percentile is
within 1/16 = 6.25% of the true value; max and mean are exact). A daemon thread
writes the percentiles to the file as JSON every few seconds, because SGLang
ends scheduler processes with SIGKILL (so there is no "at exit"). Nothing here
raises into SGLang: a file that cannot be written is logged once and skipped.

With ``cpu=True`` (``SPECCTL_HOOK_TIMING_CPU=1``) every wrapper also reads the thread's
CPU clock at the same points, so each step's hook time splits into time on the CPU and
time off it (preempted by the OS, waiting for the GIL, page faults served by sleeping):
a tail that is CPU is the hooks' work, one that is off the CPU is the host's. The
thread's CPU clock is a system call (0.2-0.6 us a reading), so this mode is a
diagnosis, not the default; its cost is in the calibration and subtracted like the rest.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import threading
import time
import weakref
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
#: Every this many loop iterations the wrappers' in-situ cost is probed.
_PROBE_EVERY = 8
#: Step totals left unbinned before the scheduler thread bins them itself (the writer
#: thread, every few seconds, normally does).
_MAX_PENDING = 50_000
#: Durations the writer thread bins between two yields of the GIL.
_FOLD_CHUNK = 1024
#: The hooks timed as AROUND hooks (the others are plain).
_AROUND = ("run_batch", "process_batch_result")
#: Off-CPU time per step above this counts as an interrupted step (``cpu.steps_off_cpu``).
_OFF_CPU_STEP_NS = 10_000


def _no_cpu_clock() -> int:
    """The CPU clock when the CPU split is off: one cheap call, always 0."""
    return 0


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


class Histogram:
    """Durations (ns) in log-linear buckets: O(1) to add, percentiles within 6.25%.

    The scheduler thread only appends to :attr:`pending` (one C call, no Python frame);
    :meth:`fold` bins what is pending, on the writer's thread (or when a reader asks).
    """

    __slots__ = ("counts", "max_ns", "n", "pending", "total_ns")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.n = 0
        self.total_ns = 0
        self.max_ns = 0
        #: Durations appended by the timed code, not binned yet.
        self.pending: list[int] = []

    def fold(self, limit: int | None = None) -> None:
        """Bin the pending durations, at most ``limit`` of them (from any thread: the list
        is never replaced, and what is appended while this runs stays after the part taken
        and deleted here)."""
        pending = self.pending
        taken = pending[:len(pending) if limit is None else limit]
        del pending[:len(taken)]
        for ns in taken:
            self.add(ns)

    def add(self, ns: int) -> None:
        """Count one duration (negative ones, an over-subtracted tiny call, as 0)."""
        # bucket_of(ns), inlined: this runs after every hook call on the scheduler thread
        # (a test requires the same bucket for every duration).
        if ns < _SUB:
            if ns < 0:
                ns = 0
            index = ns
        else:
            shift = ns.bit_length() - _SUB_BITS - 1
            index = (shift + 1) * _SUB + ((ns >> shift) - _SUB)
        self.counts[index] += 1
        self.n += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def summary(self) -> dict[str, float]:
        """``n``, p50/p90/p99 (lower bucket edges, us), exact max and mean (us)."""
        self.fold()
        counts = np.array(self.counts, dtype=np.int64)
        n = int(counts.sum())
        if not n:
            return {"n": 0}
        cumulative = np.cumsum(counts)

        def pct(q: float) -> float:
            rank = min(n - 1, int(q * n))
            return bucket_low(int(np.searchsorted(cumulative, rank, side="right"))) / 1e3

        return {"n": n, "p50_us": pct(0.5), "p90_us": pct(0.9), "p99_us": pct(0.99),
                "max_us": self.max_ns / 1e3, "mean_us": self.total_ns / max(self.n, 1) / 1e3}


class HookClock:
    """Per-step totals of the plugin's time on the scheduler thread.

    Args:
        path: JSON file the summary is written to.
        write_every_s: Seconds between two writes by the background thread
            (0: no thread; call :meth:`write` yourself).
        cpu: Split each step's time into time on the CPU and off it (the thread's CPU
            clock read by every wrapper; see the module's docstring).
    """

    def __init__(self, path: str, write_every_s: float = _WRITE_EVERY_S,
                 cpu: bool = False) -> None:
        self.path = path
        self.current_ns = 0
        self.cpu = cpu
        #: The thread's CPU clock, or a stand-in that reads 0 (``cpu`` off).
        self._cpu_clock: Callable[[], int] = time.thread_time_ns if cpu else _no_cpu_clock
        #: The running step's CPU time inside the hooks (0 with ``cpu`` off).
        self.current_cpu_ns = 0
        self._mark_cpu_ns = 0
        self.steps_cpu = Histogram()
        #: Per step, wall less CPU inside the hooks: time the thread was off the CPU.
        self.steps_off_cpu = Histogram()
        #: Hook name -> its off-CPU time per call.
        self.hooks_off_cpu: dict[str, Histogram] = {}
        self.steps = Histogram()
        #: Hook name -> its own time per call (the wrappers' cost subtracted).
        self.hooks: dict[str, Histogram] = {}
        #: Loop iterations that launched no batch, and their hook time (not in any step).
        self.idle_iterations = 0
        self.idle_ns = 0
        self.idle_max_ns = 0
        self._launched = True  # a batch was launched since the current iteration began
        #: The clock's own time inside the running AROUND hook (end_step's), left out.
        self._excluded_ns = 0
        self._mark_ns = 0  # current_ns when the current iteration began
        #: SGLang's own rule (taken out of the plugin's time): calls and their time.
        self.rule_calls = 0
        self.rule_ns = 0
        #: Nesting of plugin code on the scheduler thread now (> 0: inside a hook's own
        #: part), read by the garbage collector's callback.
        self.depth = 0
        self.gc_all = Histogram()
        self.gc_in_hooks = Histogram()
        self._gc_start = 0
        self._gc_callback: Callable | None = None
        self._write_failed = False
        self._write_every_s = write_every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        #: What one call of a wrapper adds by itself (ns), subtracted from every call.
        self.plain_overhead_ns = 0
        self.around_overhead_ns = 0
        self.outside_overhead_ns = 0
        #: The same on the CPU clock (its window is narrower than the wall clock's).
        self.plain_cpu_overhead_ns = 0
        self.around_cpu_overhead_ns = 0
        self.outside_cpu_overhead_ns = 0
        (self.plain_overhead_ns, self.around_overhead_ns, outside), cpu_medians = (
            self._calibrate())
        self.outside_overhead_ns = max(outside - self.plain_overhead_ns, 0)
        self.plain_cpu_overhead_ns, self.around_cpu_overhead_ns, outside = cpu_medians
        self.outside_cpu_overhead_ns = max(outside - self.plain_cpu_overhead_ns, 0)
        # Probes: the same wrappers around do-nothing hooks, called in situ (at the top of
        # every _PROBE_EVERY-th loop iteration, outside any hook): what they record is
        # the wrappers' cost there beyond the warm calibration subtracted from every call.
        def nothing(*args: Any) -> None:
            return None

        untimed = self.outside(nothing)
        self._probes = ((self.plain(nothing, "_probe"), (), Histogram()),
                        (self.around(lambda original: original(), "_probe"), (nothing,),
                         Histogram()),
                        (self.plain(lambda: untimed(), "_probe"), (), Histogram()))
        self._probe_count = 0
        # The probe wrappers' own per-hook histogram: emptied after every probe.
        self._probe_scratch = self.hooks["_probe"]
        self._probe_off_cpu_scratch = self.hooks_off_cpu["_probe"]
        self.hooks.clear()  # the calibration's and the probes' calls are not the plugin's
        self.hooks_off_cpu.clear()
        self.rule_calls = self.rule_ns = 0
        self.current_cpu_ns = 0

    # Kept for readers of the step totals (tests, benchmarks).
    @property
    def counts(self) -> list[int]:
        self.steps.fold()
        return self.steps.counts

    @property
    def total_steps(self) -> int:
        self.steps.fold()
        return self.steps.n

    @property
    def total_ns(self) -> int:
        self.steps.fold()
        return self.steps.total_ns

    @property
    def max_ns(self) -> int:
        self.steps.fold()
        return self.steps.max_ns

    def _calibrate(self, calls: int = 2000) -> tuple[tuple[int, int, int],
                                                      tuple[int, int, int]]:
        """Median time a wrapper records around a do-nothing hook (plain, AROUND, and
        plain around a call of a do-nothing :meth:`outside`), on the wall clock and on
        the CPU clock (zeros with ``cpu`` off)."""
        def nothing(*args: Any) -> None:
            return None

        def around_nothing(original: Callable, *args: Any) -> Any:
            return original(*args)

        untimed = self.outside(nothing)
        medians = []
        for wrapped, args in ((self.plain(nothing), ()), (self.around(around_nothing),
                                                           (nothing,)),
                              (self.plain(lambda: untimed()), ())):
            recorded, recorded_cpu = [], []
            for _ in range(calls):
                self.current_ns = self.current_cpu_ns = 0
                wrapped(*args)
                recorded.append(self.current_ns)
                recorded_cpu.append(self.current_cpu_ns)
            recorded.sort()
            recorded_cpu.sort()
            medians.append((max(recorded[calls // 2], 0), max(recorded_cpu[calls // 2], 0)))
        self.current_ns = self.current_cpu_ns = 0
        wall, cpu = zip(*medians, strict=True)
        return (wall[0], wall[1], wall[2]), (cpu[0], cpu[1], cpu[2])

    def _start(self) -> None:
        # Started by the first step, in the scheduler process itself (not a parent
        # that might fork it away).
        self._started = True
        ref = weakref.ref(self)

        def on_gc(phase: str, info: dict) -> None:
            clock = ref()
            if clock is not None:
                clock._on_gc(phase)

        self._gc_callback = on_gc
        gc.callbacks.append(on_gc)
        if self._write_every_s <= 0:
            return
        self._thread = threading.Thread(target=self._write_loop, name="specctl-hook-timing",
                                        daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # no threads left: keep counting, write on close only
            log.warning("specctl: hook timing writer thread not started: %s", exc)

    def _on_gc(self, phase: str) -> None:
        """A collection starts or stops (on whichever thread triggered it)."""
        if phase == "start":
            self._gc_start = time.perf_counter_ns()
            return
        spent = time.perf_counter_ns() - self._gc_start
        self.gc_all.add(spent)
        if self.depth > 0:  # the scheduler thread was inside a plugin hook: ours to count
            self.gc_in_hooks.add(spent)

    def begin_iteration(self) -> None:
        """A scheduler-loop iteration begins (its input hook): if the previous one launched
        nothing, its hook time moves from the running step to the idle count."""
        if not self._launched:
            idle = self.current_ns - self._mark_ns
            self.current_ns = self._mark_ns
            self.current_cpu_ns = self._mark_cpu_ns
            self.idle_iterations += 1
            self.idle_ns += idle
            if idle > self.idle_max_ns:
                self.idle_max_ns = idle
        self._launched = False
        self._mark_ns = self.current_ns
        self._mark_cpu_ns = self.current_cpu_ns
        self._probe_count += 1
        if self._probe_count % _PROBE_EVERY == 0:
            self._probe()

    def _probe(self) -> None:
        """Run the three probes (their time is in no step and no hook's count)."""
        saved, rule = (self.current_ns, self.current_cpu_ns), (self.rule_calls, self.rule_ns)
        for wrapped, args, hist in self._probes:
            self.current_ns = 0
            wrapped(*args)
            hist.add(self.current_ns)
        self._probe_scratch.pending.clear()
        self._probe_off_cpu_scratch.pending.clear()
        self.current_ns, self.current_cpu_ns = saved
        self.rule_calls, self.rule_ns = rule

    def end_step(self) -> None:
        """Close the running step (called when the next one is launched); O(1).

        It runs inside the launch hook's timed window: its own time is taken out of that
        hook's (``_excluded_ns``), it is the instrument's."""
        start = time.perf_counter_ns()
        ns = self.current_ns
        self.current_ns = 0
        self._launched = True
        steps = self.steps.pending
        steps.append(ns)  # the subtracted overhead can exceed a tiny step: 0 when binned
        if self.cpu:
            self.steps_cpu.pending.append(self.current_cpu_ns)
            self.steps_off_cpu.pending.append(ns - self.current_cpu_ns)
        self.current_cpu_ns = 0
        if len(steps) > _MAX_PENDING:  # no writer thread folds them: do it here, rarely
            self._fold_all()
        if not self._started:
            self._start()
        self._excluded_ns += time.perf_counter_ns() - start

    def _fold_all(self) -> None:
        for hist in self._histograms():
            hist.fold()

    def _histograms(self) -> list[Histogram]:
        return [self.steps, self.steps_cpu, self.steps_off_cpu, *list(self.hooks.values()),
                *list(self.hooks_off_cpu.values())]

    def summary(self) -> dict:
        """Percentiles (microseconds) of the per-step totals so far, and where they went.

        A percentile is the lower edge of its histogram bucket (at most 6.25% below
        the true value); ``max_us`` and ``mean_us`` are exact. ``per_hook``: each hook's
        own time per call; ``idle_iterations``: loop iterations without a launch (their
        time is in no step); ``sglang_rule``: SGLang's own rule, taken out; ``gc``:
        collections while a plugin hook ran (``in_hooks``) and in all;
        ``instrument_in_situ``: what the wrappers cost where the hooks run beyond the
        warm calibration subtracted from every call (probes of do-nothing hooks), per
        call and per step, and the step percentiles less that.
        """
        steps = self.steps.summary()
        if not steps["n"]:
            return {"steps": 0}
        out: dict = {"steps": steps.pop("n"), **steps}
        out["subtracted_per_call_us"] = {"plain": self.plain_overhead_ns / 1e3,
                                         "around": self.around_overhead_ns / 1e3,
                                         "outside": self.outside_overhead_ns / 1e3}
        out["per_hook"] = {name: hist.summary() for name, hist in list(self.hooks.items())}
        out["idle_iterations"] = {"n": self.idle_iterations, "total_us": self.idle_ns / 1e3,
                                  "max_us": self.idle_max_ns / 1e3}
        out["sglang_rule"] = {"calls": self.rule_calls,
                              "mean_us": self.rule_ns / max(self.rule_calls, 1) / 1e3}
        out["gc"] = {"in_hooks": self.gc_in_hooks.summary(), "all": self.gc_all.summary(),
                     "threshold": list(gc.get_threshold()), "frozen": gc.get_freeze_count()}
        probes = [hist.summary() for _, _, hist in self._probes]
        if probes[0]["n"]:
            # The calls per step of each wrapper kind, from the hooks' own counts.
            steps_n = max(out["steps"], 1)
            plain = sum(h["n"] for k, h in out["per_hook"].items() if k not in _AROUND) / steps_n
            around = sum(out["per_hook"].get(k, {"n": 0})["n"] for k in _AROUND) / steps_n
            outside = self.rule_calls / steps_n
            excess = [p["p50_us"] for p in probes]
            # The outside probe is a plain wrapper around an outside one: its own part is
            # what it records beyond the plain probe (as in the calibration).
            excess[2] = max(excess[2] - excess[0], 0.0)
            out["instrument_in_situ"] = {
                "excess_per_call_p50_us": dict(zip(("plain", "around", "outside"), excess,
                                                   strict=True)),
                "probes": probes[0]["n"],
                "excess_per_step_us": (plain * excess[0] + around * excess[1]
                                       + outside * excess[2])}
            # An estimate (a percentile of a sum is not a sum of medians): the step
            # percentiles less the wrappers' typical in-situ excess.
            per_step = out["instrument_in_situ"]["excess_per_step_us"]
            out["instrument_in_situ"]["step_us_less_excess"] = {
                key: max(out[f"{key}_us"] - per_step, 0.0) for key in ("p50", "p90", "p99")}
        if self.cpu:
            out["cpu"] = self._cpu_summary()
        out["process"] = {"python": sys.version.split()[0], "threads": threading.active_count(),
                          "switch_interval_s": sys.getswitchinterval()}
        return out

    def _cpu_summary(self) -> dict:
        """Each step's hook time on the CPU and off it, the steps off it for more than
        ``_OFF_CPU_STEP_NS``, and each hook's off-CPU time per call."""
        off = self.steps_off_cpu.summary()
        interrupted = (sum(self.steps_off_cpu.counts[bucket_of(_OFF_CPU_STEP_NS):])
                       if off["n"] else 0)
        return {"subtracted_per_call_us": {"plain": self.plain_cpu_overhead_ns / 1e3,
                                           "around": self.around_cpu_overhead_ns / 1e3,
                                           "outside": self.outside_cpu_overhead_ns / 1e3},
                "step_cpu": self.steps_cpu.summary(), "step_off_cpu": off,
                "steps_off_cpu_over_us": {"threshold_us": _OFF_CPU_STEP_NS / 1e3,
                                          "n": int(interrupted)},
                "per_hook_off_cpu": {name: hist.summary()
                                     for name, hist in list(self.hooks_off_cpu.items())}}

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
        if self._gc_callback is not None:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._gc_callback)
            self._gc_callback = None
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(5.0)
        else:
            self.write()

    def _write_loop(self) -> None:
        while not self._stop.wait(self._write_every_s):
            self._fold_in_chunks()
            self.write()
        self.write()

    def _fold_in_chunks(self) -> None:
        """Bin the backlog a chunk at a time, letting go of the GIL in between: a few
        seconds of a busy server are tens of thousands of durations."""
        for hist in self._histograms():
            while len(hist.pending) > _FOLD_CHUNK:
                hist.fold(_FOLD_CHUNK)
                time.sleep(0)

    # -- wrappers -------------------------------------------------------------------------
    # Each keeps two (AROUND: four) clock readings around the timed code, as the
    # calibration measured them; the bookkeeping after the last reading is outside the
    # window (and, for a method nested in an AROUND hook's original, inside that
    # hook's excluded time).

    def _histogram(self, hook: Callable, name: str | None) -> tuple[Histogram, Histogram]:
        """The hook's histograms: own time per call, and off-CPU time per call."""
        key = name or getattr(hook, "__name__", "hook")
        return (self.hooks.setdefault(key, Histogram()),
                self.hooks_off_cpu.setdefault(key, Histogram()))

    def around(self, hook: Callable, name: str | None = None) -> Callable:
        """Time an AROUND hook, minus the wrapped original."""
        hist, off_hist = self._histogram(hook, name)
        cpu_clock = self._cpu_clock

        def timed(original: Callable, *args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            self._excluded_ns = 0
            start = time.perf_counter_ns()
            cpu_start = cpu_clock()
            inner = cpu_inner = 0

            def timed_original(*a: Any, **k: Any) -> Any:
                nonlocal inner, cpu_inner
                self.depth -= 1
                s = time.perf_counter_ns()
                cs = cpu_clock()
                try:
                    return original(*a, **k)
                finally:
                    cpu_inner += cpu_clock() - cs
                    inner += time.perf_counter_ns() - s
                    self.depth += 1

            try:
                return hook(timed_original, *args, **kwargs)
            finally:
                cpu_spent = cpu_clock() - cpu_start - cpu_inner
                spent = (time.perf_counter_ns() - start - inner - self.around_overhead_ns
                         - self._excluded_ns)
                self.depth -= 1
                self.current_ns += spent
                hist.pending.append(spent)
                if self.cpu:  # end_step's part (excluded) is CPU work: out of both
                    cpu_spent -= self.around_cpu_overhead_ns + self._excluded_ns
                    self.current_cpu_ns += cpu_spent
                    off_hist.pending.append(spent - cpu_spent)
        return timed

    def outside(self, sglang: Callable) -> Callable:
        """Wrap SGLang code that a timed plugin method calls (SGLang's own adaptive rule):
        its time, and this wrapper's, is taken out of the step's total."""
        cpu_clock = self._cpu_clock

        def untimed(*args: Any, **kwargs: Any) -> Any:
            self.depth -= 1
            start = time.perf_counter_ns()
            cpu_start = cpu_clock()
            try:
                return sglang(*args, **kwargs)
            finally:
                cpu_spent = cpu_clock() - cpu_start
                spent = time.perf_counter_ns() - start
                self.current_ns -= spent + self.outside_overhead_ns
                self.current_cpu_ns -= cpu_spent + self.outside_cpu_overhead_ns
                self.depth += 1
                self.rule_calls += 1
                self.rule_ns += spent
        return untimed

    def plain(self, hook: Callable, name: str | None = None,
              starts_iteration: bool = False) -> Callable:
        """Time a BEFORE/AFTER hook (or a policy method) entirely. ``starts_iteration``:
        the hook runs once at the start of every scheduler-loop iteration (the input
        hook), which is how idle iterations are told apart."""
        hist, off_hist = self._histogram(hook, name)
        cpu_clock = self._cpu_clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            if starts_iteration:
                self.begin_iteration()
            self.depth += 1
            # What the hook's SGLang calls (:meth:`outside`) take out of the step comes off
            # these two between here and the end: the hook's own time is what is left.
            base, cpu_base = self.current_ns, self.current_cpu_ns
            start = time.perf_counter_ns()
            cpu_start = cpu_clock()
            try:
                return hook(*args, **kwargs)
            finally:
                cpu_spent = cpu_clock() - cpu_start
                spent = (time.perf_counter_ns() - start - self.plain_overhead_ns
                         + self.current_ns - base)
                self.depth -= 1
                self.current_ns = base + spent
                hist.pending.append(spent)
                if self.cpu:
                    cpu_spent += self.current_cpu_ns - cpu_base - self.plain_cpu_overhead_ns
                    self.current_cpu_ns = cpu_base + cpu_spent
                    off_hist.pending.append(spent - cpu_spent)
        return timed

"""Measuring the plugin's own time on the scheduler thread (``SPECCTL_HOOK_TIMING=<file>``).

Off by default. When on, every hook (and the policy's two methods) adds the time
spent in its own body, excluding the SGLang code it wraps, to the current
scheduler step; a step ends when the next one is launched. Every few seconds
the per-step totals' percentiles are written to the file as JSON, because SGLang
ends scheduler processes with SIGKILL (so there is no "at exit"). The wrappers'
own ``perf_counter_ns`` calls (about 0.1 us per hook) are not included.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

_WRITE_EVERY_S = 5.0


class HookClock:
    """Per-step totals of the plugin's time on the scheduler thread."""

    def __init__(self, path: str, keep: int = 200_000) -> None:
        self.path = path
        self.current_ns = 0
        self.steps: deque[int] = deque(maxlen=keep)
        self._next_write = time.monotonic() + _WRITE_EVERY_S

    def end_step(self) -> None:
        """Close the running step (called when the next one is launched)."""
        self.steps.append(self.current_ns)
        self.current_ns = 0
        now = time.monotonic()
        if now >= self._next_write:
            self._next_write = now + _WRITE_EVERY_S
            self.write()

    def summary(self) -> dict[str, float]:
        """Percentiles (microseconds) of the per-step totals so far."""
        values = sorted(self.steps)
        if not values:
            return {"steps": 0}

        def pct(q: float) -> float:
            return values[min(len(values) - 1, int(q * len(values)))] / 1e3

        return {"steps": len(values), "p50_us": pct(0.5), "p90_us": pct(0.9),
                "p99_us": pct(0.99), "max_us": values[-1] / 1e3,
                "mean_us": sum(values) / len(values) / 1e3}

    def write(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.summary(), f)
        os.replace(tmp, self.path)

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
                self.current_ns += time.perf_counter_ns() - start - inner
        return timed

    def plain(self, hook: Callable) -> Callable:
        """Time a BEFORE/AFTER hook (or a policy method) entirely."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return hook(*args, **kwargs)
            finally:
                self.current_ns += time.perf_counter_ns() - start
        return timed

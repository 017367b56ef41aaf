#!/usr/bin/env python
"""Stalled decode steps of a recorded server, and the JIT compiles that ran during them.

    python scripts/h200/first_use_stalls.py TRACE COMPILES [--over-ms 50] [--first-s 60]

``TRACE``: a recorded trace (a folder, a Parquet file or the ``.tar.gz`` the H200 scripts
pack); ``COMPILES``: the server's compile log (``COMPILE_LOG=1``, ``compile_log.py``). A
stall is a decode step (no prefill tokens) more than ``--over-ms`` above the median of its
(depth, batch size); each is printed with the compiles whose start falls within it, from
the trace's first decode step to ``--first-s`` seconds later. The fifteenth session's
diagnosis of a fresh server's stalls (``docs/OFFSWITCH.md``, runs 40-43) is this output
for runs 41 and 42.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from env.traces.trace_format import read_packed_trace


def read_steps(path: Path) -> tuple[dict[str, np.ndarray], float]:
    """The trace's step columns and its start on the Unix clock (``t0_unix``)."""
    trace = read_packed_trace(path)
    if "t0_unix" not in trace.meta:
        raise SystemExit(f"{path}: the trace's metadata has no t0_unix (recorded before it)")
    columns = trace.step_columns()
    return ({name: np.asarray(getattr(columns, name)) for name in
             ("time_s", "batch_size", "steps_used", "step_latency_s", "prefill_tokens")},
            float(trace.meta["t0_unix"]))


def read_compiles(path: Path) -> list[dict]:
    """The compile log's lines (errors left out), by start time; a bad line names itself."""
    compiles = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            entry = json.loads(line)
            if entry["kind"] != "error":
                compiles.append({"name": str(entry["name"]), "start": float(entry["start"]),
                                 "seconds": float(entry["seconds"])})
        except (ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"{path}, line {number}: not a compile record ({error!r})") from None
    return sorted(compiles, key=lambda entry: entry["start"])


def stalls(steps: dict[str, np.ndarray], over_s: float) -> np.ndarray:
    """Indices of decode steps more than ``over_s`` above their (depth, batch) median."""
    decode = np.flatnonzero(steps["prefill_tokens"] == 0)
    latencies: dict[tuple[int, int], list[float]] = defaultdict(list)
    for i in decode:
        latencies[int(steps["steps_used"][i]), int(steps["batch_size"][i])].append(
            float(steps["step_latency_s"][i]))
    median = {key: float(np.median(values)) for key, values in latencies.items()}
    excess = np.array([steps["step_latency_s"][i]
                       - median[int(steps["steps_used"][i]), int(steps["batch_size"][i])]
                       for i in decode])
    return decode[excess > over_s] if len(decode) else decode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("compiles", type=Path)
    parser.add_argument("--over-ms", type=float, default=50.0)
    parser.add_argument("--first-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    steps, t0_unix = read_steps(args.trace)
    compiles = read_compiles(args.compiles)
    decode_times = steps["time_s"][steps["prefill_tokens"] == 0]
    if not len(decode_times):
        raise SystemExit(f"{args.trace}: no decode steps")
    end = decode_times.min() + args.first_s
    found = [i for i in stalls(steps, args.over_ms / 1e3) if steps["time_s"][i] < end]
    explained = 0.0
    for i in found:
        latency = float(steps["step_latency_s"][i])
        at = t0_unix + float(steps["time_s"][i])
        # time_s is the step's launch on the recorder's clock; allow a step either side
        during = [c for c in compiles if at - latency - 0.05 <= c["start"] <= at + latency + 0.05]
        explained += min(latency, sum(c["seconds"] for c in during))
        names = ", ".join(f"{c['name'].rsplit('.', 1)[-1]} {c['seconds'] * 1e3:.0f} ms"
                          for c in during)
        print(f"{time.strftime('%H:%M:%S', time.gmtime(at))} depth {int(steps['steps_used'][i])}"
              f" batch {int(steps['batch_size'][i])}: {latency * 1e3:.0f} ms; compiles: "
              f"{names or 'none'}")
    total = sum(float(steps["step_latency_s"][i]) for i in found)
    print(f"{len(found)} stalled decode steps in the first {args.first_s:g} s ({total:.2f} s); "
          f"compiles during them: {explained:.2f} s")


if __name__ == "__main__":
    main()

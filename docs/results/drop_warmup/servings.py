"""Per serving of an H200 plugin run: the decode steps' depth shares per batch band, the
re-entry warm-ups (a depth-0 step the next decode step follows speculating) and the
measured step latency per depth at batch >= 24.

    PYTHONPATH=$PWD python docs/results/drop_warmup/servings.py \
        > docs/results/drop_warmup/servings.txt

Servings are cut at the controller's reloads (its log, UTC, against the trace's
``t0_unix``); the names of each run's servings, in order, are below (the load generator's
ramp, ``WARMUP_RAMP=1``, reloads static_0/1/3/5 first).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path

import numpy as np

from env.traces.trace_format import read_packed_trace

OFFSWITCH = Path(__file__).resolve().parents[1] / "h200/offswitch"
RAMP = ["ramp_0", "ramp_1", "ramp_3", "ramp_5"]
#: run -> (profile handed, servings in order after the first reload)
RUNS = {
    46: ("h100_llama31_8b", [*RAMP, "static_3 r8", "dw r8", "ppo r8",
                                "static_3 r6", "dw r6", "ppo r6"]),
    48: ("h200_qwen3_30b_a3b", ["dw r8", "ppo r8", "dw r6", "ppo r6"]),
    49: ("h200_qwen3_30b_a3b", [*RAMP, "ppo r8", "dw r8", "ppo r6", "dw r6"]),
    50: ("h100_llama31_8b", [*RAMP, "ppo r8", "dw r8", "ppo r6", "dw r6"]),
    # Eighteenth session: c585 = the retrain policy_58513820.npz (run 53: no speculation)
    51: ("h200_qwen3_30b_a3b", [*RAMP, "ppo r8", "c585 r8", "ppo r6", "c585 r6"]),
    52: ("h100_llama31_8b", [*RAMP, "c585 r8", "ppo r8", "c585 r6", "ppo r6"]),
    54: ("h200_qwen3_30b_a3b", [*RAMP, "c585 r8", "ppo r8", "static_3 r8",
                                   "c585 r6", "ppo r6", "static_3 r6"]),
    55: ("h100_llama31_8b", ["ppo r8", "c585 r8"]),
}
BANDS = (("<8", 0, 8), ("8-23", 8, 24), (">=24", 24, 10**9))
RELOAD = re.compile(r"^(\S+ \S+) INFO controller.reload: policy reloaded")


def reload_times(log: Path) -> list[float]:
    """Unix times of the controller's policy reloads."""
    out = []
    for line in log.read_text().splitlines():
        match = RELOAD.match(line)
        if match:
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            out.append(stamp.replace(tzinfo=timezone.utc).timestamp())
    return out


def serving_rows(steps: list) -> dict:
    """Depth shares per band, warm-ups per 1,000 decode steps, latency per depth >= 24."""
    decode = [r for r in steps if r.is_decode]
    warmups = sum(1 for a, b in pairwise(decode)
                  if a.steps_used == 0 and b.steps_used > 0)
    row = {"decode_steps": len(decode),
           "warmups_per_1000": round(1000 * warmups / max(len(decode), 1), 1)}
    for band, lo, hi in BANDS:
        sel = [r for r in decode if lo <= r.batch_size < hi]
        counts = Counter(r.steps_used for r in sel)
        row[band] = {d: round(c / max(len(sel), 1), 3) for d, c in sorted(counts.items())}
    high = [r for r in decode if r.batch_size >= 24]
    row["ms_at_24_plus"] = {
        d: round(float(np.median([1e3 * r.step_latency_s for r in high
                                  if r.steps_used == d])), 2)
        for d in sorted({r.steps_used for r in high})}
    return row


def cut_servings(trace_path: Path, controller_log: Path, names: list[str]):
    """``(serving name, its records)`` for each of ``names``, the run's servings in order,
    cut at the controller's reloads. The controller's log on one machine runs on across
    runs: this run's reloads are those after its trace began."""
    trace = read_packed_trace(trace_path)
    t0 = trace.meta["t0_unix"]
    times = [t for t in reload_times(controller_log) if t >= t0]
    if len(times) != len(names):
        raise SystemExit(f"{trace_path.name}: {len(times)} reloads, {len(names)} names")
    bounds = [t - t0 for t in times] + [float("inf")]
    for i, name in enumerate(names):
        yield name, [r for r in trace.steps if bounds[i] <= r.time_s < bounds[i + 1]]


def main() -> None:
    for run, (profile, names) in RUNS.items():
        replays = {rate: json.loads(path.read_text()) for rate in ("r8", "r6")
                   if (path := OFFSWITCH / f"moe_acc2.5_replay_{rate}_run{run}.json").exists()}
        for name, steps in cut_servings(OFFSWITCH / f"moe_acc2.5_trace_r8r6_run{run}.tar.gz",
                                        OFFSWITCH / f"moe_acc2.5_controller_run{run}.log",
                                        names):
            if name.startswith("ramp"):
                continue
            policy, rate = name.split()
            tpot = replays[rate][f"headline_{policy}"]["mean_tpot_ms"]
            print(json.dumps({"run": run, "profile": profile, "serving": name,
                              "mean_tpot_ms": round(tpot, 2), **serving_rows(steps)}))

if __name__ == "__main__":
    main()


def headline_servings(model: str, run: int, tag: str, names: list[str]):
    """``(policy, its records, row)`` for each serving of ``run`` but the warm-up ramp's:
    the row holds the run, the serving's name, its replay's mean TPOT and TTFT (from
    ``{model}_replay_{rate}_run{run}.json``) and :func:`serving_rows`."""
    replays: dict[str, dict] = {}
    for name, steps in cut_servings(OFFSWITCH / f"{model}_trace_{tag}_run{run}.tar.gz",
                                    OFFSWITCH / f"{model}_controller_run{run}.log", names):
        if name.startswith("ramp"):
            continue
        policy, rate = name.split()
        if rate not in replays:
            path = OFFSWITCH / f"{model}_replay_{rate}_run{run}.json"
            replays[rate] = json.loads(path.read_text())
        headline = replays[rate][f"headline_{policy}"]
        yield policy, steps, {"run": run, "serving": name,
                              "mean_tpot_ms": round(headline["mean_tpot_ms"], 2),
                              "mean_ttft_ms": round(headline["mean_ttft_ms"], 1),
                              **serving_rows(steps)}

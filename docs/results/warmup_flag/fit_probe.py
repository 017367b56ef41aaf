"""Usage: PYTHONPATH=$PWD python docs/results/warmup_flag/fit_probe.py [PROFILE]

How specctl-fit-profile reads a trace the plugin recorded with its off path: a simulated
plugin trace (the MoE profile, the warm-up on, a policy switching off and on), fitted with
the true profile as template and its default free coefficients zeroed; per-point errors of
the fitted profile against the simulator's own latencies, by step kind."""
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from env.sim.acceptance import ParametricAcceptance
from env.sim.cost_model import DEFAULT_FREE, fit_profile_from_trace, load_profile
from env.sim.simulator import WARMUP_LATENCY_FLAGS, SchedulerConfig, Simulator
from env.traces.trace_format import read_trace, write_trace
from env.traces.workloads import ClosedLoop


def plugin_trace(profile, seed=0, steps=1500):
    """Closed loops of 4 to 48 clients (one simulated server each); the policy cycles off
    for 3 steps and a depth (1, 3 or 5) for 5 (each off period then ends in the warm-up),
    and now and then asks for off right after the warm-up."""
    rng = np.random.default_rng(seed)
    records = []
    for n, clients in enumerate((4, 8, 16, 24, 32, 48)):
        cfg = SchedulerConfig.from_profile(profile, reentry_warmup=True, finish_lag_steps=1)
        sim = Simulator(profile, ParametricAcceptance([0.7] * 7),
                        ClosedLoop(clients, prompt_tokens=512, output_tokens=200), cfg,
                        seed=seed + n, server=f"sim{clients}")
        i = 0
        while not sim.done and i < steps:
            records.extend(sim.advance())
            if sim.done:
                break
            phase = i % 8
            depth = 0 if phase < 3 else (1, 3, 5)[(i // 8) % 3]
            if phase == 4 and rng.random() < 0.3:
                depth = 0  # off right after the warm-up
            records.append(sim.decode(depth))
            i += 1
    return records


def errors(fitted, records):
    """Median |relative error| of the fitted profile against each decode step's latency,
    by kind, each kind priced as the simulator ran it."""
    out = {}
    for kind in ("off", "warm-up", "speculative"):
        rs = [r for r in records if r.prefill_tokens == 0 and r.batch_size > 0 and (
            (kind == "off" and r.steps_used == 0 and not r.warmup)
            or (kind == "warm-up" and r.warmup)
            or (kind == "speculative" and r.steps_used > 0))]
        flags = [WARMUP_LATENCY_FLAGS if r.warmup else
                 {"draft_extend": r.steps_used > 0, "speculative_path": r.steps_used > 0}
                 for r in rs]
        pred = np.array([fitted.step_latency_s(r.batch_size, r.steps_used, r.kv_used_tokens,
                                               0, **f) for r, f in zip(rs, flags, strict=True)])
        meas = np.array([r.step_latency_s for r in rs])
        out[kind] = (len(rs), float(np.median(np.abs(pred / meas - 1))))
    return out


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "h200_qwen3_30b_a3b"
    truth = load_profile(name)
    records = plugin_trace(truth)
    template = truth.replace(**{k: 0.0 for k in DEFAULT_FREE})
    for label, recs in (("flags", records), ("no flags (an older trace)",
                                              [replace(r, warmup=None) for r in records])):
        path = write_trace(Path(tempfile.mkdtemp()) / "trace.parquet", [], recs)
        fitted, report = fit_profile_from_trace(read_trace(path), template)
        print(f"{name}, {label}: {len(report.points)} points, median |error| "
              f"{report.median_abs_error:.4f}; free: " + ", ".join(
                  f"{k} {getattr(fitted, k) * 1e3:.4g} ms (truth {getattr(truth, k) * 1e3:.4g})"
                  for k in DEFAULT_FREE))
        print("   per kind (n, median |error| of the fitted profile):", errors(fitted, records))

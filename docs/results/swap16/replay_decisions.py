#!/usr/bin/env python
"""One-off (sixteenth session): replay run 44's two ``ppo`` servings open loop through
the decision code ``specctl-serve`` runs, with the profile it was handed
(``h100_llama31_8b``), the right one (``h200_qwen3_30b_a3b``), and the never-pays
candidate ``policy_c1.npz`` (guard.max_profile_error 1.0).

Decisions are made by :class:`controller.decider.StreamDecider` (the daemon's decision
for one stream: FeatureBuilder, the policy, env.guard, env.probe, as the daemon applies
them), one record at a time; a decision on record ``k`` applies from step
``k + DECISION_LAG`` until the next one (as the plugin applies it). The builder starts
afresh at each ``ppo`` reload (the log says "streams start afresh"). Per decode step of a
serving it notes the steps the replayed decision gives that step's batch, and, from the
observation row of that batch, the features' price of depth 3 against off, the profile
error, the cost confidences, and whether the off probe was due. Usage::

    PYTHONPATH=$PWD python docs/results/swap16/replay_decisions.py > docs/results/swap16/out.txt
"""

from __future__ import annotations

import bisect
import json
import math
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from controller.decider import StreamDecider, evaluate
from controller.policy_file import ExportedPolicy
from controller.wire import DECISION_LAG
from env.guard import NO_GUARD
from env.probe import PROBE_OFF, off_bucket
from env.sim.cost_model import load_profile
from env.traces.trace_format import read_packed_trace

ROOT = Path(__file__).resolve().parents[3]
OFFSWITCH = ROOT / "docs/results/h200/offswitch"
TRACE = OFFSWITCH / "moe_acc2.5_trace_r8r6_run44.tar.gz"
SHIPPED = ROOT / "controller/data/default_policy.npz"
C1 = ROOT / "docs/results/never_pays16/policy_c1.npz"
#: The ppo reloads and the static_3 reloads after them (moe_acc2.5_controller_run44.log, UTC).
SERVINGS = {"r8": ("2026-12-03 13:02:27.277", "2026-12-03 13:03:09.566"),
            "r6": ("2026-12-03 13:04:33.829", "2026-12-03 13:05:15.754")}
BANDS = (("<8", 0, 8), ("8-23", 8, 24), (">=24", 24, 10**9))
DEPTHS = (0, 1, 3, 5)


def unix(stamp: str) -> float:
    """A log time stamp (UTC) as unix seconds."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").replace(
        tzinfo=timezone.utc).timestamp()


def replay(records, policy: ExportedPolicy, prior) -> list[dict]:
    """Open-loop decisions on ``records`` (one serving); one entry per decode step."""
    decider = StreamDecider(policy, [0, 1, 3, 5], cost_prior=prior)
    spec = policy.feature_spec
    names = spec.names()
    col = {n: names.index(n) for n in ("relative_goodput_1", "relative_goodput_3",
                                       "relative_goodput_5", "cost_confidence_0",
                                       "cost_confidence_3", "cost_confidence_1",
                                       "cost_profile_error")}
    grid = list(spec.batch_grid)
    guard, probe = decider.guard, decider.probe
    pending: list[tuple[int, object, np.ndarray, int, str]] = []  # (apply_from, ...)
    current = None
    out = []
    for rec in records:
        # The decision in charge at this step: the latest whose apply_from has come.
        while pending and pending[0][0] <= rec.step_index:
            current = pending.pop(0)
        if rec.prefill_tokens == 0 and current is not None:
            _, decision, obs, raw_steps, probing, label, pred = current
            at = max(bisect.bisect_right(grid, rec.batch_size) - 1, 0)
            row = obs[at]
            steps = _steps(decision, rec.batch_size)
            raw = int(raw_steps[at])
            out.append({
                "batch": rec.batch_size, "recorded": rec.steps_used, "replayed": steps,
                "raw": raw, "probing": probing, "probe_label": label,
                "g3": 3.0 * float(row[col["relative_goodput_3"]]),
                "g1": 3.0 * float(row[col["relative_goodput_1"]]),
                "conf0": float(row[col["cost_confidence_0"]]),
                "conf1": float(row[col["cost_confidence_1"]]),
                "conf3": float(row[col["cost_confidence_3"]]),
                "err": float(row[col["cost_profile_error"]]),
                "guard": _gate(guard, row, raw, col),
                # the features' predicted latency (ms) at depth 0 and 3, this step's batch
                "pred0_ms": 1e3 * float(pred[0]), "pred3_ms": 1e3 * float(pred[3]),
                "latency_ms": 1e3 * rec.step_latency_s,
            })
        decision = decider.decide(rec)
        builder = decider.builder
        obs = builder.observation_grid().copy()
        # The policy's own choice per row (the server's allowed depths, no guard, no probe).
        raw_index = evaluate(policy, [obs], [decider.allowed], None, None, NO_GUARD)[0][0]
        pending.append((rec.step_index + DECISION_LAG, decision, obs,
                        policy.action_array[raw_index], builder.probing,
                        _probe_label(builder, probe, rec.batch_size, prior),
                        builder.latency_predictions_s(max(rec.batch_size, 1))))
    return out


def _steps(decision, batch: int) -> int:
    """The steps ``decision`` gives a batch of ``batch`` (fallback: SGLang's, noted -1)."""
    if decision.is_fallback:
        return -1
    grid, steps = decision.batch_grid, decision.steps
    return steps[max(bisect.bisect_right(grid, batch) - 1, 0)]


def _gate(guard, row, raw: int, col) -> str:
    """For a speculative raw choice: why the guard let it stand (as env.guard judges);
    the depth-3 and depth-1 columns only (the others are not chosen here)."""
    if raw == 0:
        return "raw_off"
    if not guard.enabled:
        return "guard_off"
    priced = 3.0 * float(row[col[f"relative_goodput_{raw}"]]) if raw in (1, 3, 5) else 0.0
    if priced >= math.log1p(-guard.margin):
        return "margin"
    if abs(row[col["cost_profile_error"]]) > guard.max_profile_error:
        return "profile_error"
    if row[col["cost_confidence_0"]] < guard.confidence:
        return "off_unmeasured"
    if raw in (1, 3) and row[col[f"cost_confidence_{raw}"]] < guard.confidence:
        return "depth_unmeasured"
    return "guard_acts"


def _probe_label(builder, spec, batch: int, prior) -> str:
    """Why the off probe was or was not due (as never_pays16/diagnose.py labels it)."""
    tracker = builder.probe_tracker
    if tracker is None or not spec.off_share:
        return "none"
    if builder.probing == PROBE_OFF:
        return "due"
    batch = max(batch, 1)
    if tracker.off_confirmed[off_bucket(batch)]:
        return "confirmed"
    if tracker.off_coverage(batch, builder.spec.latency_forgetting) >= spec.off_samples:
        return "covered"
    if spec.off_trust and prior is not None and abs(builder.profile_log_error) <= spec.off_trust:
        return "trusted"
    return "budget"


def summarise(rows: list[dict]) -> dict:
    """Per band: shares of the replayed steps, agreement with the recorded ones; at >=24
    the prices, profile error, guard gates and off-probe labels."""
    out = {}
    for band, lo, hi in BANDS:
        sel = [r for r in rows if lo <= r["batch"] < hi]
        n = len(sel) or 1
        rep = Counter(r["replayed"] for r in sel)
        rec = Counter(r["recorded"] for r in sel)
        entry = {"steps": len(sel),
                 "replayed": {d: round(rep[d] / n, 3) for d in sorted(rep)},
                 "recorded": {d: round(rec[d] / n, 3) for d in sorted(rec)},
                 "agree": round(sum(r["replayed"] == r["recorded"] for r in sel) / n, 3)}
        if band == ">=24" and sel:
            g3 = np.array([r["g3"] for r in sel])
            err = np.array([r["err"] for r in sel])
            entry.update({
                "depth3_over_off_goodput_median": round(float(np.exp(np.median(g3))), 3),
                "depth3_over_off_goodput_p10_p90": [round(float(np.exp(q)), 3)
                                                    for q in np.percentile(g3, [10, 90])],
                "depth1_over_off_goodput_median": round(float(np.exp(np.median(
                    [r["g1"] for r in sel]))), 3),
                "profile_error_median": round(float(np.median(err)), 3),
                "profile_error_abs_gt_0.5": round(float(np.mean(np.abs(err) > 0.5)), 3),
                "conf0_median": round(float(np.median([r["conf0"] for r in sel])), 3),
                "predicted_ms_depth0_depth3_median": [
                    round(float(np.median([r[k] for r in sel])), 2)
                    for k in ("pred0_ms", "pred3_ms")],
                "measured_ms_depth0_depth3_median": [
                    round(float(np.median([r["latency_ms"] for r in sel
                                           if r["recorded"] == d])), 2)
                    if any(r["recorded"] == d for r in sel) else None for d in (0, 3)],
                "conf3_median": round(float(np.median([r["conf3"] for r in sel])), 3),
                "raw_choice": {d: round(c / n, 3) for d, c in
                               sorted(Counter(r["raw"] for r in sel).items())},
                "guard_gate": dict(Counter(r["guard"] for r in sel).most_common()),
                "off_probe": dict(Counter(r["probe_label"] for r in sel).most_common()),
            })
        out[band] = entry
    return out


def main() -> None:
    """Replay both servings under each (policy, profile) case and print the summaries."""
    trace = read_packed_trace(TRACE)
    t0 = trace.meta["t0_unix"]
    cases = {"shipped+h100_llama31_8b (as served)": (SHIPPED, "h100_llama31_8b"),
             "shipped+h200_qwen3_30b_a3b": (SHIPPED, "h200_qwen3_30b_a3b"),
             "c1+h100_llama31_8b": (C1, "h100_llama31_8b"),
             "c1+h200_qwen3_30b_a3b": (C1, "h200_qwen3_30b_a3b")}
    results = {}
    for case, (path, profile) in cases.items():
        policy = ExportedPolicy.load(path)
        prior = load_profile(profile)
        for serving, (start, end) in SERVINGS.items():
            lo, hi = unix(start) - t0, unix(end) - t0
            records = [r for r in trace.steps if lo <= r.time_s < hi]
            rows = replay(records, policy, prior)
            results[f"{case} {serving}"] = summarise(rows)
            print(f"## {case}, {serving} ({len(records)} records, trace t "
                  f"{lo:.1f}-{hi:.1f} s)")
            print(json.dumps(results[f"{case} {serving}"], indent=1), flush=True)
    (Path(__file__).parent / "replay_decisions.json").write_text(
        json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""One-off (eighteenth session, issue 9): the shipped file's stream at 6 req/s on the
H200 (runs 48 and 49, the MoE @ 2.5 with its own profile ``h200_qwen3_30b_a3b``) against
the simulated stream of the same cell (``compare.simulate``'s set-up, the same arrivals),
with and without the re-entry warm-up.

For each stream: decode steps per depth, off periods (runs of depth-0 decode steps, the
warm-up apart), warm-ups, the measured (or simulated) cost of off steps, warm-ups and
depth-3 steps over the handed profile's price, and the features the decisions read
(predicted off and depth-3 latency, depth 3's price against off, the acceptance estimate)
at the moments the policy went off. The GPU stream is replayed open loop through the
daemon's decision code (``controller.decider.StreamDecider``, as swap16's
``replay_decisions``), a decision on record k applying from step k + lag.

    PYTHONPATH=$PWD python docs/results/fid18/streams.py > docs/results/fid18/streams.txt
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts/h200"))
sys.path.insert(0, str(ROOT / "docs/results/drop_warmup"))

import compare  # noqa: E402
import servings  # noqa: E402
from measured_runs import Cell  # noqa: E402

from agents.policies import make_policy  # noqa: E402
from controller.decider import StreamDecider  # noqa: E402
from controller.policy_file import ExportedPolicy  # noqa: E402
from env.rollout import DecisionLoop  # noqa: E402
from env.sim.acceptance import SGLangSimulatedAcceptance  # noqa: E402
from env.sim.cost_model import load_profile  # noqa: E402
from env.sim.simulator import WARMUP_LATENCY_FLAGS, SchedulerConfig, Simulator  # noqa: E402

OFFSWITCH = ROOT / "docs/results/h200/offswitch"
P = ROOT / "docs/results/h200/fidelity"
SHIPPED = ROOT / "controller/data/default_policy.npz"
PRIOR = "h200_qwen3_30b_a3b"
CANDIDATES = [0, 1, 3, 5]


def gpu_serving(run: int, name: str = "ppo r6") -> list:
    """The records of one serving of run ``run`` (servings.py's cut at the reloads)."""
    _profile, names = servings.RUNS[run]
    cut = servings.cut_servings(OFFSWITCH / f"moe_acc2.5_trace_r8r6_run{run}.tar.gz",
                                OFFSWITCH / f"moe_acc2.5_controller_run{run}.log", names)
    return next(records for serving, records in cut if serving == name)


def headline_cell(rate: float = 6.0) -> Cell:
    """The runs 48/49 ppo cell (the MoE @ 2.5, real tokens, the plugin's off path)."""
    return Cell(model="moe", server="spec_off", acceptance=2.5, workload="headline",
                concurrency=None, seconds=40.0, policy="ppo", radix_cache=False,
                max_running=48, source="", throughput_tok_s=0.0, mean_tpot_ms=0.0,
                prior=PRIOR, tokens="real", rate=rate)


def sim_stream(reentry_warmup: bool, rate: float = 6.0, seed: int = 0,
               sim_overrides: dict | None = None, feedback_lag: int = 3,
               candidates: list[int] | None = CANDIDATES, hold: int = 0):
    """The closed-loop simulated stream of the cell: (records, per-decision rows);
    ``candidates``: the steps the policy may choose (None: every depth, as before);
    ``hold``: the plugin's hold between depth switches (0: none, as before)."""
    cell = headline_cell(rate)
    profile = load_profile(P / "moe_real_spec.yaml")
    prior = load_profile(PRIOR)
    workload, horizon = compare.workload_of(cell, None)
    config = SchedulerConfig.from_profile(profile, max_running_requests=48, zero_step="off",
                                          finish_lag_steps=1, prefix_cache=False,
                                          reentry_warmup=reentry_warmup,
                                          min_switch_steps=hold, **(sim_overrides or {}))
    sim = Simulator(profile, SGLangSimulatedAcceptance(2.5, batch_wide=True), workload,
                    config, seed=seed)
    policy = make_policy("ppo", profile=profile, sim_config=config, policy_path=str(SHIPPED),
                         probe=None, guard=compare.served_guard(cell_with_guard(cell)),
                         candidates=candidates)
    loop = DecisionLoop(sim, policy.feature_spec(None), feedback_lag, horizon,
                        cost_prior=prior)
    records: list = []
    rows: list = []
    decode, advance = sim.decode, sim.advance

    def logged_decode(depth):
        rec = decode(depth)
        records.append(rec)
        return rec

    def logged_advance():
        out = advance()
        records.extend(out)
        return out

    sim.decode, sim.advance = logged_decode, logged_advance
    probe = getattr(policy, "probe", None)
    if probe is not None:
        loop.features.set_probe(probe)
    obs = loop.reset(seed)
    policy.reset(sim)
    builder = loop.features
    while obs is not None:
        depth = policy.act(obs)
        batch = obs.batch_size
        pred = obs.latency_pred_s
        rows.append({"step": sim.step_index, "batch": batch, "asked": int(depth),
                     "warmup_due": sim.warmup_due,
                     "pred0_ms": 1e3 * float(pred[0]), "pred3_ms": 1e3 * float(pred[3]),
                     "g3": 3.0 * float(obs.vector[COL["relative_goodput_3"]]),
                     "rates": np.asarray(obs.accept_rate[:3], float).round(3).tolist(),
                     "err": float(builder.profile_log_error),
                     "probing": obs.probing})
        obs, _ = loop.step(depth)
    return records, rows


def cell_with_guard(cell: Cell) -> Cell:
    """The cell with the guard its runs served (runs 48/49's file records it)."""
    import dataclasses
    import json
    served = json.loads((OFFSWITCH / "moe_acc2.5_replay_r6_run48.json").read_text())["guard"]
    return dataclasses.replace(cell, guard=served)


_SPEC = ExportedPolicy.load(SHIPPED).feature_spec
COL = {n: i for i, n in enumerate(_SPEC.names())}


def open_loop(records: list, lag: int = 2, prior_name: str = PRIOR,
              candidates: list[int] | None = CANDIDATES) -> list[dict]:
    """Decisions on ``records`` replayed open loop (a decision on record k applies from step
    k + ``lag``); one row per decode step with the decision in charge and its features
    (``candidates``: the server's steps, None: every depth of the policy)."""
    policy = ExportedPolicy.load(SHIPPED)
    prior = load_profile(prior_name)
    decider = StreamDecider(policy, candidates, cost_prior=prior)
    grid = list(policy.feature_spec.batch_grid)
    pending: list = []
    current = None
    out = []
    for rec in records:
        while pending and pending[0][0] <= rec.step_index:
            current = pending.pop(0)
        if rec.is_decode and current is not None:
            _, decision, obs, pred, rates, err, probing = current
            at = max(bisect.bisect_right(grid, rec.batch_size) - 1, 0)
            steps = (-1 if decision.is_fallback else
                     decision.steps[max(bisect.bisect_right(decision.batch_grid,
                                                            rec.batch_size) - 1, 0)])
            p = pred.get(rec.batch_size, None)
            out.append({"step": rec.step_index, "batch": rec.batch_size,
                        "recorded": rec.steps_used, "replayed": steps,
                        "g3": 3.0 * float(obs[at][COL["relative_goodput_3"]]),
                        "pred0_ms": p[0] if p else float("nan"),
                        "pred3_ms": p[1] if p else float("nan"),
                        "rates": rates, "err": err, "probing": probing,
                        "latency_ms": 1e3 * rec.step_latency_s})
        decision = decider.decide(rec)
        b = decider.builder
        obs = b.observation_grid().copy()
        lat = b.latency_predictions_s(np.arange(1, 49))
        pred = {n: (1e3 * lat[n - 1, 0], 1e3 * lat[n - 1, 3]) for n in range(1, 49)}
        pending.append((rec.step_index + lag, decision, obs, pred,
                        np.asarray(b.accept_rates()[:3], float).round(3).tolist(),
                        float(b.profile_log_error), b.probing))
    return out


def off_periods(decode: list) -> tuple[list[int], int]:
    """Lengths of the runs of depth-0 decode steps that are not the warm-up (the depth-0
    step directly followed by a speculative one), and the warm-ups."""
    depth = [r.steps_used for r in decode]
    lengths, run, warmups = [], 0, 0
    for i, d in enumerate(depth):
        warm = d == 0 and i + 1 < len(depth) and depth[i + 1] > 0
        if d == 0 and not warm:
            run += 1
            continue
        if warm:
            warmups += 1
        if run:
            lengths.append(run)
        run = 0
    if run:
        lengths.append(run)
    return lengths, warmups


def cost_ratios(decode: list, prior) -> dict:
    """Median measured / handed-profile latency of off steps, warm-ups and depth-3 steps
    (batch >= 24 and all), the warm-up priced as the simulator does (steps0 + extend)."""
    depth = np.array([r.steps_used for r in decode])
    warm = np.zeros(len(decode), bool)
    warm[:-1] = (depth[:-1] == 0) & (depth[1:] > 0)
    out = {}
    for name, sel in (("off", (depth == 0) & ~warm), ("warmup", warm), ("depth3", depth == 3),
                      ("depth1", depth == 1)):
        ratios, big = [], []
        for i in np.flatnonzero(sel):
            r = decode[i]
            flags = (WARMUP_LATENCY_FLAGS if name == "warmup" else
                     {"draft_extend": r.steps_used > 0, "speculative_path": r.steps_used > 0})
            q = prior.step_latency_s(r.batch_size, r.steps_used, r.kv_used_tokens, 0, **flags)
            ratios.append(r.step_latency_s / q)
            if r.batch_size >= 24:
                big.append(r.step_latency_s / q)
        out[name] = {"n": len(ratios),
                     "median_all": round(float(np.median(ratios)), 3) if ratios else None,
                     "median_b24": round(float(np.median(big)), 3) if big else None}
    return out


def summary(label: str, records: list, prior) -> None:
    """Print one stream's depth shares, off periods, warm-ups, cost ratios, acceptance."""
    decode = [r for r in records if r.is_decode]
    bands = {"<8": (0, 8), "8-23": (8, 24), ">=24": (24, 10**9)}
    print(f"### {label}: {len(decode)} decode steps")
    for band, (lo, hi) in bands.items():
        sel = [r.steps_used for r in decode if lo <= r.batch_size < hi]
        c = Counter(sel)
        print(f"  {band}: {len(sel)} steps, " + ", ".join(
            f"{d}: {c[d] / max(len(sel), 1):.2f}" for d in sorted(c)))
    lengths, warmups = off_periods(decode)
    hist = Counter(min(n, 20) for n in lengths)
    print(f"  off periods {len(lengths)}, warm-ups {warmups}; lengths (20 = 20+): "
          + ", ".join(f"{k}: {hist[k]}" for k in sorted(hist)))
    print(f"  cost / {PRIOR} price (median): {cost_ratios(decode, prior)}")
    acc3 = [r.accepted_drafts.mean() for r in decode if r.steps_used == 3
            and r.accepted_drafts.size]
    print(f"  mean accepted per request at depth 3: {np.mean(acc3):.3f} ({len(acc3)} steps)")


def at_off_entries(rows: list[dict], key: str) -> list[dict]:
    """Rows where the stream (key: 'recorded' or 'asked') goes from speculating to off."""
    out = []
    for a, b in itertools.pairwise(rows):
        if a[key] > 0 and b[key] == 0:
            out.append(b)
    return out


def fmt(rows: list[dict], n: int = 12) -> str:
    lines = []
    for r in rows[:n]:
        lines.append(f"    step {r['step']} batch {r['batch']}: off {r['pred0_ms']:.1f} ms, "
                     f"depth 3 {r['pred3_ms']:.1f} ms, depth 3 / off goodput "
                     f"{np.exp(r['g3']):.3f}, rates {r['rates']}, err {r['err']:+.3f}")
    return "\n".join(lines)


def band_prices(rows: list[dict], depth_key: str, lo: int = 24, hi: int = 10**9) -> str:
    """Medians of the prices at batch ``lo``..``hi - 1``, split by the depth in charge."""
    out = []
    for label, pick in (("off", lambda r: r[depth_key] == 0),
                        ("speculating", lambda r: r[depth_key] > 0)):
        sel = [r for r in rows if lo <= r["batch"] < hi and pick(r)]
        if not sel:
            continue
        out.append(f"{label} ({len(sel)}): off {np.median([r['pred0_ms'] for r in sel]):.1f} "
                   f"ms, depth 3 {np.median([r['pred3_ms'] for r in sel]):.1f} ms, "
                   f"price {np.exp(np.median([r['g3'] for r in sel])):.3f}, "
                   f"rate1 {np.median([r['rates'][0] for r in sel]):.3f}, "
                   f"rate2 {np.median([r['rates'][1] for r in sel]):.3f}, "
                   f"err {np.median([r['err'] for r in sel]):+.3f}")
    return "; ".join(out)


def main() -> None:
    prior = load_profile(PRIOR)
    for run in (48, 49):
        records = gpu_serving(run)
        summary(f"GPU run {run}, ppo r6", records, prior)
        for lag in (2, 3):
            rows = open_loop(records, lag)
            agree = np.mean([r["replayed"] == r["recorded"] for r in rows])
            print(f"  open loop, lag {lag}: agrees with the recorded steps on {agree:.3f} "
                  f"of decode steps")
        rows = open_loop(records, 3)
        for band, lo, hi in (("8-23", 8, 24), (">=24", 24, 10**9)):
            print(f"  prices at {band} (open loop, lag 3): " + band_prices(rows, "recorded",
                                                                            lo, hi))
        entries = at_off_entries(rows, "recorded")
        print(f"  off entries ({len(entries)}):\n" + fmt(entries, 20))
        for cands in (None,):
            un = open_loop(records, 3, candidates=cands)
            for band, lo, hi in (("<8", 0, 8), ("8-23", 8, 24), (">=24", 24, 10**9)):
                c = Counter(r["replayed"] for r in un if lo <= r["batch"] < hi)
                n = max(sum(c.values()), 1)
                print(f"  open loop with every depth allowed, {band}: "
                      + ", ".join(f"{d}: {c[d] / n:.2f}" for d in sorted(c)))
    variants = ((None, 0), (CANDIDATES, 0), (CANDIDATES, compare.PLUGIN_MIN_SWITCH_STEPS))
    for cands, hold in variants:
        for warm in (False, True):
            records, rows = sim_stream(warm, candidates=cands, hold=hold)
            summary(f"simulated (seed 0), candidates {cands}, hold {hold}, "
                    f"reentry_warmup={warm}", records, prior)
            for band, lo, hi in (("8-23", 8, 24), (">=24", 24, 10**9)):
                print(f"  prices at {band} (closed loop): " + band_prices(rows, "asked",
                                                                           lo, hi))
            entries = at_off_entries(rows, "asked")
            print(f"  off entries ({len(entries)}):\n" + fmt(entries, 20))
            orow = open_loop(records, 3, candidates=cands)
            print(f"  the simulated stream open loop (lag 3) gives the depth run on "
                  f"{np.mean([r['replayed'] == r['recorded'] for r in orow]):.3f} of its "
                  f"decode steps (warm-ups and held steps count as misses)")
    print("### off share of decode steps per batch band (< 8 / 8-23 / >= 24), seeds 0-7")
    for cands, hold in variants:
        for warm in (False, True):
            shares = []
            for seed in range(8):
                records, _ = sim_stream(warm, seed=seed, candidates=cands, hold=hold)
                decode = [r for r in records if r.is_decode]
                shares.append([round(float(np.mean([r.steps_used == 0 for r in decode
                                                    if lo <= r.batch_size < hi])), 2)
                               for lo, hi in ((0, 8), (8, 24), (24, 10**9))])
            print(f"  candidates {cands}, hold {hold}, warm-up {warm}: mean "
                  f"{np.mean(shares, axis=0).round(2).tolist()}; per seed {shares}")

if __name__ == "__main__":
    main()

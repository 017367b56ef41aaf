"""The decode step before a prefill on the H200 (runs 46-69): what it carries, and a model.

Under SGLang's overlap scheduler the next batch is launched before a step's result is
processed, and the plugin times a step from the previous result to its own, so a decode
step whose next record is a prefill carries (some of) the prefill's launch. For every
decode record of the plugin's traces (ramp servings left out, as
``adm21_moe/before_prefill.py`` reads them: MoE runs 46-55 and 69, dense runs 61-68), its
*extra* is its latency less its *own* cost: the median latency of the plain decode steps
(previous and next record decode steps, not a warm-up) of the same run, depth and batch
size (cells of >= 5 steps; others left out).

* table 1: the extra by the records around the step (previous / next a prefill; the
  step answering a request or not): is it the next prefill, and only that?
* table 2: the extra of the steps before a prefill by what might drive it: the prefill's
  prompt tokens, its requests, requests waiting, the running batch, the step's own cost;
* table 3: models fitted by least squares on the steps before a prefill (extras over
  ``OUTLIER_MS`` left out: stalls, counted): a constant; ``max(0, L - h * own)`` (a fixed
  launch, hidden behind a share ``h`` of the step's own latency); L per run at the pooled
  h; measured against predicted means per depth and per own-cost bin;
* table 4: where the profiles put that time: each prefill record's measured latency, plus
  the extra of the decode step before it, against the prefill cost the H200 profiles give
  it (the simulator moves the booking out of the prefill: right if the profile's prefill
  already holds it).

    R=docs/results
    PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu20:$R/gpu21:$R/adm21_moe \\
        python docs/results/gpu22/prefill_launch.py > docs/results/gpu22/prefill_launch.txt
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import before_prefill as bp
import numpy as np
from servings import OFFSWITCH, RAMP, cut_servings

from env.sim.cost_model import load_profile

FIDELITY = Path(__file__).resolve().parents[1] / "h200/fidelity"
OUTLIER_MS = 50.0
#: Profiles whose prefill cost table 4 reads, per model.
PROFILES = {"dense": ["h200_llama31_8b_recorded", "h200_llama31_8b",
                      str(FIDELITY / "dense_spec.yaml")],
            "moe": ["h200_qwen3_30b_a3b", str(FIDELITY / "moe_real_spec.yaml")]}


@dataclass
class Step:
    """One decode record with its neighbours."""

    model: str
    run: int
    depth: int
    batch: int
    waiting: int
    ms: float
    warmup: bool
    prev_prefill: bool
    next_prefill: bool
    answers: bool  # a request of its batch is gone from the next decode step's batch
    next_tokens: int
    next_requests: int
    own: float = float("nan")
    flag: bool | None = None  # the plugin's ``before_prefill`` (runs 70 on; None before)

    @property
    def extra(self) -> float:
        return self.ms - self.own


@dataclass
class Prefill:
    """One prefill record: the model, what it computed, its latency, the step before."""

    model: str
    tokens: int
    pairs: float
    kv: int
    after_off: bool
    ms: float
    before: Step | None


def read(sources=None) -> tuple[list[Step], list[Prefill]]:
    """The decode steps with their own cost (warm-ups left out) and the prefill records of
    ``sources`` (``(model, run, trace tag, file prefix, serving names)``; default: the runs
    fitted here, ``before_prefill.sources``)."""
    steps: list[Step] = []
    prefills: list[Prefill] = []
    for model, run, tag, prefix, names in (bp.sources() if sources is None else sources):
        cut = cut_servings(OFFSWITCH / f"{prefix}_trace_{tag}_run{run}.tar.gz",
                           OFFSWITCH / f"{prefix}_controller_run{run}.log", names)
        for name, recs in cut:
            if name in RAMP:
                continue
            next_decode = [None] * len(recs)
            later = None
            for i in range(len(recs) - 1, -1, -1):
                next_decode[i] = later
                if recs[i].is_decode:
                    later = recs[i]
            made: dict[int, Step] = {}
            for i in range(1, len(recs) - 1):
                r, p, n = recs[i], recs[i - 1], recs[i + 1]
                if not r.is_decode:
                    continue
                following = next_decode[i]
                answers = (following is not None
                           and bool(set(r.request_ids) - set(following.request_ids)))
                made[i] = Step(model, run, r.steps_used, r.batch_size, r.waiting_requests,
                               1e3 * r.step_latency_s, bool(r.warmup), not p.is_decode,
                               not n.is_decode, answers, n.prefill_tokens,
                               0 if n.is_decode else n.batch_size, flag=r.before_prefill)
                steps.append(made[i])
            for i in range(1, len(recs)):
                r, p = recs[i], recs[i - 1]
                if r.is_decode:
                    continue
                prefills.append(Prefill(model, r.prefill_tokens, float(r.prefill_pairs or 0.0),
                                        r.kv_used_tokens, p.is_decode and p.steps_used == 0,
                                        1e3 * r.step_latency_s, made.get(i - 1)))
    cells: dict[tuple, list[float]] = defaultdict(list)
    for s in steps:
        if not (s.prev_prefill or s.next_prefill or s.warmup):
            cells[s.run, s.depth, s.batch].append(s.ms)
    own = {k: float(np.median(v)) for k, v in cells.items() if len(v) >= 5}
    for s in steps:
        s.own = own.get((s.run, s.depth, s.batch), float("nan"))
    return [s for s in steps if np.isfinite(s.own) and not s.warmup], prefills


def stats(values) -> str:
    v = np.asarray(list(values), dtype=float)
    if not v.size:
        return "0 | | | |"
    return (f"{v.size} | {v.mean():.2f} | {np.median(v):.2f} "
            f"| {np.percentile(v, 25):.2f} / {np.percentile(v, 75):.2f} |")


HEAD = "| n | mean extra ms | median | p25 / p75 |"


def table_neighbours(steps: list[Step]) -> None:
    print("## Table 1: extra ms of a decode step by its neighbours (warm-ups left out)\n")
    print(f"| model | depth | previous | next | answers a request {HEAD}")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in ("dense", "moe"):
        for depth in (0, 3):
            for prev in (False, True):
                for nxt in (False, True):
                    for ans in (False, True):
                        sel = [s.extra for s in steps if s.model == model and s.depth == depth
                               and s.prev_prefill == prev and s.next_prefill == nxt
                               and s.answers == ans]
                        print(f"| {model} | {depth} | {'prefill' if prev else 'decode'} "
                              f"| {'prefill' if nxt else 'decode'} | {'yes' if ans else 'no'} "
                              f"| {stats(sel)}")
    print()


def before(steps: list[Step], model: str) -> list[Step]:
    return [s for s in steps if s.model == model and s.next_prefill and s.extra < OUTLIER_MS]


def table_drivers(steps: list[Step]) -> None:
    print("## Table 2: extra ms of the decode steps before a prefill, by candidate driver\n")
    print(f"| model | depth | driver | bin {HEAD}")
    print("|---|---|---|---|---|---|---|---|")
    drivers = {
        "prefill tokens": (lambda s: s.next_tokens,
                           [(0, 400), (400, 900), (900, 1100), (1100, 2100), (2100, 4200),
                            (4200, 10**9)]),
        "prefill requests": (lambda s: s.next_requests, [(1, 2), (2, 3), (3, 4), (4, 10**9)]),
        "waiting requests": (lambda s: s.waiting, [(0, 1), (1, 3), (3, 10**9)]),
        "running batch": (lambda s: s.batch, [(0, 8), (8, 24), (24, 40), (40, 10**9)]),
        "own ms": (lambda s: s.own, [(0, 6), (6, 8), (8, 10), (10, 13), (13, 17), (17, 22),
                                     (22, 30), (30, 40), (40, 10**9)]),
    }
    for model in ("dense", "moe"):
        rows = before(steps, model)
        for depth in (0, 3, "all"):
            at = rows if depth == "all" else [s for s in rows if s.depth == depth]
            for driver, (key, bins) in drivers.items():
                for lo, hi in bins:
                    sel = [s.extra for s in at if lo <= key(s) < hi]
                    if sel:
                        top = "" if hi >= 10**9 else f"{hi})"
                        print(f"| {model} | {depth} | {driver} | [{lo}, {top or 'up'} "
                              f"| {stats(sel)}")
    print()


def fit_hidden(extra: np.ndarray, own: np.ndarray, h_fixed: float | None = None
               ) -> tuple[float, float, float]:
    """``(L, h, rmse)`` of ``extra ~ max(0, L - h * own)``, least squares on a grid
    (L in 0.1 ms, h in 0.01)."""
    best = (np.inf, 0.0, 0.0)
    hs = [h_fixed] if h_fixed is not None else np.arange(0.0, 1.501, 0.01)
    for h in hs:
        for launch in np.arange(0.0, 30.0, 0.1):
            sse = float(((extra - np.maximum(0.0, launch - h * own)) ** 2).sum())
            if sse < best[0]:
                best = (sse, launch, h)
    sse, launch, h = best
    return round(float(launch), 1), round(float(h), 2), float(np.sqrt(sse / len(extra)))


def table_models(steps: list[Step]) -> dict[str, tuple[float, float]]:
    print(f"## Table 3: models of the extra (steps before a prefill, extra < {OUTLIER_MS} ms)"
          "\n")
    fitted = {}
    for model in ("dense", "moe"):
        rows = before(steps, model)
        stalls = sum(1 for s in steps if s.model == model and s.next_prefill
                     and s.extra >= OUTLIER_MS)
        extra = np.array([s.extra for s in rows])
        own = np.array([s.own for s in rows])
        launch, h, rmse = fit_hidden(extra, own)
        fitted[model] = (launch, h)
        print(f"**{model}**: {len(rows)} steps ({stalls} over {OUTLIER_MS:.0f} ms left out). "
              f"Constant: {extra.mean():.2f} ms, rmse {extra.std():.2f}. "
              f"max(0, L - h * own): **L = {launch} ms, h = {h}**, rmse {rmse:.2f} "
              f"(zero from own = {launch / h if h else float('inf'):.1f} ms). "
              f"h = 1 (booked step = max(own, L)): L = {fit_hidden(extra, own, 1.0)[0]} ms, "
              f"rmse {fit_hidden(extra, own, 1.0)[2]:.2f}.\n")
        pred = np.maximum(0.0, launch - h * own)
        print("| group | n | measured mean extra ms | predicted | constant |")
        print("|---|---|---|---|---|")
        depth = np.array([s.depth for s in rows])
        for d in sorted(set(depth.tolist())):
            m = depth == d
            print(f"| depth {d} | {m.sum()} | {extra[m].mean():.2f} | {pred[m].mean():.2f} "
                  f"| {extra.mean():.2f} |")
        for lo, hi in [(0, 6), (6, 8), (8, 10), (10, 13), (13, 17), (17, 22), (22, 30),
                       (30, 40), (40, 10**9)]:
            m = (own >= lo) & (own < hi)
            if m.any():
                print(f"| own [{lo}, {hi if hi < 10**9 else 'up'}) ms | {m.sum()} "
                      f"| {extra[m].mean():.2f} | {pred[m].mean():.2f} | {extra.mean():.2f} |")
        print(f"\nL per run at h = {h:.2f}:\n")
        print("| run | n | L ms | measured mean extra | predicted |")
        print("|---|---|---|---|---|")
        runs = np.array([s.run for s in rows])
        for run in sorted(set(runs.tolist())):
            m = runs == run
            run_launch = fit_hidden(extra[m], own[m], h)[0]
            print(f"| {run} | {m.sum()} | {run_launch} | {extra[m].mean():.2f} "
                  f"| {np.maximum(0.0, run_launch - h * own[m]).mean():.2f} |")
        print()
    return fitted


def table_prefills(prefills: list[Prefill], fitted: dict[str, tuple[float, float]]) -> None:
    print("## Table 4: a prefill record, and the extra of the decode step before it, against "
          "the profiles' prefill cost (ms, means)\n")
    print("Extra: the step's measured extra where it has one (a decode step before the "
          "prefill, its own cost known), else 0. Profiles' cost as the simulator charges it "
          "(the draft extend skipped after an off step).\n")
    for model in ("dense", "moe"):
        profiles = {Path(p).stem: load_profile(p) for p in PROFILES[model]}
        print("| model | prompt tokens | n | record | record + extra | "
              + " | ".join(profiles) + " |")
        print("|---" * (5 + len(profiles)) + "|")
        rows = [p for p in prefills if p.model == model]
        for lo, hi in [(0, 400), (400, 900), (900, 1100), (1100, 2100), (2100, 4200),
                       (4200, 10**9)]:
            sel = [p for p in rows if lo <= p.tokens < hi]
            if not sel:
                continue
            record = np.mean([p.ms for p in sel])
            extra = np.mean([p.before.extra if p.before is not None
                             and p.before.extra < OUTLIER_MS else 0.0 for p in sel])
            costs = [np.mean([1e3 * prof.step_latency_s(0, 0, p.kv, p.tokens,
                                                        draft_extend=not p.after_off,
                                                        prefill_pairs=p.pairs)
                              for p in sel]) for prof in profiles.values()]
            print(f"| {model} | [{lo}, {hi if hi < 10**9 else 'up'}) | {len(sel)} "
                  f"| {record:.2f} | {record + extra:.2f} | "
                  + " | ".join(f"{c:.2f}" for c in costs) + " |")
        print()


def main() -> None:
    steps, prefills = read()
    table_neighbours(steps)
    table_drivers(steps)
    fitted = table_models(steps)
    table_prefills(prefills, fitted)


if __name__ == "__main__":
    main()

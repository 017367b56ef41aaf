"""The decode step before a prefill on the MoE against the dense model.

For every decode record of the H200 plugin traces, whether the next record of the same
serving is a prefill (the sample ``FeatureSpec.latency_drop_before_prefill`` leaves out of
the cost estimates), and its measured step latency, grouped by model, draft depth
(``steps_used``), batch band (<8, 8-23, 24-39, 40-48) and whether requests were waiting at
its launch (``waiting_requests > 0``):

* table 1: per cell, the count, mean and median ms of the decode steps followed by a
  decode step (``next=decode``) and of those followed by a prefill (``next=prefill``),
  and the ratio of the two means and medians;
* table 2: per model, depth and band (waiting or not pooled), the share of decode steps
  that precede a prefill and the mean ms with them and without them (what the rule moves);
* table 3: per run, depth 0 and 3, and band (waiting or not pooled), the share before a
  prefill, the mean ms of next=decode against next=prefill and the difference of the means
  and of the medians, to see whether the pooled effect holds run by run.

Rows pooling bands (``all`` in table 2) mix the bands' latencies: the steps before a
prefill sit at larger batches than the rest, so their change there is mostly the bands'
composition; the per-band rows are the effect.

The MoE (Qwen3-30B-A3B shape, acceptance 2.5): runs 46-55 (``servings.RUNS``) and run 69
(``servings_65_69.RUNS``); the dense model (Llama-3.1-8B shape, acceptance 3.0): runs 61,
63, 64 (``servings_61_64.RUNS``) and 65, 67, 68 (``servings_65_69.RUNS``). Every serving
is kept except the warm-up ramp's (``servings.RAMP``), the dense run 61's probes included.
Servings are cut at the controller's reloads (``servings.cut_servings``); the last record
of a serving has no known next record and is left out.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu20:$R/gpu21 \\
        python docs/results/adm21_moe/before_prefill.py > docs/results/adm21_moe/before_prefill.txt

(``servings_65_69`` imports ``replay_decisions`` and ``band_prices``, hence swap16 and
gpu18 on the path.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import servings_61_64
import servings_65_69
from servings import OFFSWITCH, RAMP, cut_servings
from servings import RUNS as MOE_RUNS_46_55

BANDS: tuple[tuple[str, int, int], ...] = (("<8", 0, 8), ("8-23", 8, 24), ("24-39", 24, 40),
                                           ("40-48", 40, 49))


@dataclass(frozen=True)
class Sample:
    """One decode record: its run, depth, band, queue at launch, next record, latency."""

    run: int
    depth: int
    band: str
    waiting: bool
    before_prefill: bool
    ms: float


def sources() -> Iterator[tuple[str, int, str, str, list[str]]]:
    """``(model, run, trace tag, file prefix, serving names)`` for each run analysed."""
    for run, (_profile, names) in MOE_RUNS_46_55.items():
        yield "moe", run, "r8r6", "moe_acc2.5", names
    for run, (tag, names) in servings_61_64.RUNS.items():
        yield "dense", run, tag, "dense_acc3.0", names
    for run, (prefix, _profile, tag, names) in servings_65_69.RUNS.items():
        yield "moe" if prefix.startswith("moe") else "dense", run, tag, prefix, names


def band_of(batch: int) -> str:
    """The band a decode step's batch size falls in."""
    for band, lo, hi in BANDS:
        if lo <= batch < hi:
            return band
    raise ValueError(f"batch {batch} outside the bands")


def samples() -> dict[str, list[Sample]]:
    """Every decode record with a known next record, per model, ramp servings left out."""
    out: dict[str, list[Sample]] = defaultdict(list)
    for model, run, tag, prefix, names in sources():
        cut = cut_servings(OFFSWITCH / f"{prefix}_trace_{tag}_run{run}.tar.gz",
                           OFFSWITCH / f"{prefix}_controller_run{run}.log", names)
        for name, records in cut:
            if name in RAMP:
                continue
            for record, following in pairwise(records):
                if not record.is_decode:
                    continue
                out[model].append(Sample(run, record.steps_used, band_of(record.batch_size),
                                         record.waiting_requests > 0, not following.is_decode,
                                         1e3 * record.step_latency_s))
    return out


def stats(values: list[float]) -> str:
    """``n mean median`` cells of a markdown row (blank cells when empty)."""
    if not values:
        return "0 | | "
    return f"{len(values)} | {np.mean(values):.1f} | {np.median(values):.1f}"


def ratio(num: list[float], den: list[float], how: str) -> str:
    """``num`` over ``den`` by mean or median, blank when either is empty."""
    if not num or not den:
        return ""
    func = np.mean if how == "mean" else np.median
    return f"{func(num) / func(den):.2f}"


def diff(num: list[float], den: list[float], func: Callable = np.mean) -> str:
    """``func`` (the mean) of ``num`` less that of ``den`` (ms, signed), blank when either
    is empty."""
    if not num or not den:
        return ""
    return f"{func(num) - func(den):+.1f}"


def table_cells(by_model: dict[str, list[Sample]]) -> None:
    """Table 1: per model, depth, band and queue, next=decode against next=prefill."""
    print("## Table 1: decode step latency (ms) by its next record\n")
    print("| model | depth | band | waiting | next=decode n | mean | median "
          "| next=prefill n | mean | median | mean diff | mean ratio | median ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, rows in by_model.items():
        cells: dict[tuple, list[float]] = defaultdict(list)
        for s in rows:
            cells[s.depth, s.band, s.waiting, s.before_prefill].append(s.ms)
        for depth in sorted({s.depth for s in rows}):
            for band, _lo, _hi in BANDS:
                for waiting in (False, True):
                    after = cells[depth, band, waiting, False]
                    before = cells[depth, band, waiting, True]
                    if not after and not before:
                        continue
                    print(f"| {model} | {depth} | {band} | {'yes' if waiting else 'no'} "
                          f"| {stats(after)} | {stats(before)} | {diff(before, after)} "
                          f"| {ratio(before, after, 'mean')} "
                          f"| {ratio(before, after, 'median')} |")
    print()


def share_row(label: str, rows: list[Sample]) -> str:
    """Share of ``rows`` before a prefill, mean ms with and without them, the change."""
    every = [s.ms for s in rows]
    kept = [s.ms for s in rows if not s.before_prefill]
    dropped = len(every) - len(kept)
    with_ = float(np.mean(every))
    if not kept:
        return (f"| {label} | {len(every)} | {dropped} | {100 * dropped / len(every):.1f} "
                f"| {with_:.2f} | | |")
    without = float(np.mean(kept))
    return (f"| {label} | {len(every)} | {dropped} | {100 * dropped / len(every):.1f} "
            f"| {with_:.2f} | {without:.2f} | {100 * (without / with_ - 1):+.1f} |")


def table_shares(by_model: dict[str, list[Sample]]) -> None:
    """Table 2: per model, depth and band, the share dropped and the mean it moves."""
    print("## Table 2: share of decode steps before a prefill and the mean with / without "
          "them\n")
    print("| model, depth, band | decode steps | before a prefill | share % | mean ms, all "
          "| mean ms, without | change % |")
    print("|---|---|---|---|---|---|---|")
    for model, rows in by_model.items():
        for depth in sorted({s.depth for s in rows}):
            at_depth = [s for s in rows if s.depth == depth]
            print(share_row(f"{model} d{depth} all", at_depth))
            for band, _lo, _hi in BANDS:
                in_band = [s for s in at_depth if s.band == band]
                if in_band:
                    print(share_row(f"{model} d{depth} {band}", in_band))
    print()


def table_runs(by_model: dict[str, list[Sample]]) -> None:
    """Table 3: per run, depth 0 and 3, and band, next=decode against next=prefill."""
    print("## Table 3: per run, depth 0 and 3, and band (queue pooled)\n")
    print("| model | run | depth | band | decode steps | share before a prefill % "
          "| mean ms, next=decode | mean ms, next=prefill | mean diff | median diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, rows in by_model.items():
        for run in sorted({s.run for s in rows}):
            for depth in (0, 3):
                for band, _lo, _hi in BANDS:
                    cell = [s for s in rows
                            if s.run == run and s.depth == depth and s.band == band]
                    if not cell:
                        continue
                    after = [s.ms for s in cell if not s.before_prefill]
                    before = [s.ms for s in cell if s.before_prefill]
                    mean_after = f"{np.mean(after):.1f}" if after else ""
                    mean_before = f"{np.mean(before):.1f}" if before else ""
                    print(f"| {model} | {run} | {depth} | {band} | {len(cell)} "
                          f"| {100 * len(before) / len(cell):.1f} | {mean_after} "
                          f"| {mean_before} | {diff(before, after)} "
                          f"| {diff(before, after, np.median)} |")
    print()


def main() -> None:
    by_model = samples()
    table_cells(by_model)
    table_shares(by_model)
    table_runs(by_model)


if __name__ == "__main__":
    main()

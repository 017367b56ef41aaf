"""The prefill-launch booking refitted on the plugin's own ``before_prefill`` flag.

Runs 71-74, 76-77 and 79 (the plugin flags the decode step after which it launched a
prefill; runs 75 and 78 served without speculation, no plugin): ``prefill_launch.read``
gives every decode step its extra over its own cost (the median of the plain steps of the
same run, depth and batch). Per model:

* the flagged fit: ``max(0, L - h * own)`` by least squares on the flagged steps (extras
  over ``OUTLIER_MS`` left out), as ``prefill_launch.fit_hidden``;
* the inferred fit on the same runs: the same on the steps whose next record is a prefill
  (what ``prefill_launch.py`` fitted on runs 46-69, which had no flag);
* both per run, and L per run at the shipped h and at the flagged h;
* measured against predicted mean extra per depth and own-cost bin for the shipped
  (runs 46-69) and the flagged fits;
* every run together: runs 46-69 inferred (no flag) and runs 71-79 flagged, pooled per
  step, and the median of the per-run L at the shipped h (one vote per server).

    R=docs/results; P=$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu20:$R/gpu21:$R/adm21_moe
    PYTHONPATH=$PWD:$P:$R/gpu22:$R/gpu23 \\
        python docs/results/sim23/refit_flagged.py > docs/results/sim23/refit_flagged.txt
"""

from __future__ import annotations

import numpy as np
import prefill_launch as pl
import servings_70_74
import servings_75_79

from env.sim.calibration.prefill_launch import H200_DENSE, H200_MOE

#: The fit shipped from runs 46-69 (``prefill_launch.py``), per model: (L ms, h).
SHIPPED = {"dense": (H200_DENSE[0] * 1e3, H200_DENSE[1]),
           "moe": (H200_MOE[0] * 1e3, H200_MOE[1])}
OWN_BINS = ((0, 10), (10, 17), (17, 25), (25, 10**9))


def sources():
    """``prefill_launch.read`` sources: every flagged run (71-74, 76-77, 79)."""
    for runs in (servings_70_74.RUNS, servings_75_79.RUNS, servings_75_79.RUN_79):
        for run, (prefix, _profile, tag, names) in runs.items():
            yield "moe" if prefix.startswith("moe") else "dense", run, tag, prefix, names


def arrays(rows) -> tuple[np.ndarray, np.ndarray]:
    return np.array([s.extra for s in rows]), np.array([s.own for s in rows])


def fit_line(label: str, rows, h_fixed: float | None = None) -> tuple[float, float]:
    extra, own = arrays(rows)
    launch, h, rmse = pl.fit_hidden(extra, own, h_fixed)
    print(f"| {label} | {len(rows)} | {extra.mean():.2f} | {launch} | {h} | {rmse:.2f} "
          f"| {extra.std():.2f} |")
    return launch, h


def predicted(rows, launch: float, h: float) -> float:
    _extra, own = arrays(rows)
    return float(np.maximum(0.0, launch - h * own).mean())


def main() -> None:
    steps, _prefills = pl.read(sources())
    fits = {}
    for model in ("dense", "moe"):
        mine = [s for s in steps if s.model == model and s.extra < pl.OUTLIER_MS]
        flagged = [s for s in mine if s.flag]
        inferred = [s for s in mine if s.next_prefill]
        runs = sorted({s.run for s in mine})
        stalls = sum(1 for s in steps if s.model == model and s.flag
                     and s.extra >= pl.OUTLIER_MS)
        print(f"## {model}: runs {runs} ({stalls} flagged stalls over "
              f"{pl.OUTLIER_MS:.0f} ms left out)\n")
        print(f"Steps whose next record is a prefill: {len(inferred)}, of them flagged "
              f"{sum(1 for s in inferred if s.flag)}; flagged, next not a prefill: "
              f"{sum(1 for s in flagged if not s.next_prefill)}. Not flagged, next a "
              "prefill: mean extra "
              f"{np.mean([s.extra for s in inferred if not s.flag] or [np.nan]):.2f} ms.\n")
        print("| steps | n | mean extra ms | L ms | h | rmse | rmse of a constant |")
        print("|---|---|---|---|---|---|---|")
        fits[model] = fit_line("flagged, pooled", flagged)
        fit_line("inferred (next a prefill), pooled", inferred)
        for run in runs:
            fit_line(f"flagged, run {run}", [s for s in flagged if s.run == run])
            fit_line(f"inferred, run {run}", [s for s in inferred if s.run == run])
        for label, h in (("runs 46-69", SHIPPED[model][1]), ("flagged", fits[model][1])):
            for run in runs:
                fit_line(f"flagged, run {run}, at the {label} h", [s for s in flagged
                                                                  if s.run == run], h)
        launch, h = fits[model]
        old_launch, old_h = SHIPPED[model]
        print(f"\nMean extra of the flagged steps, measured against predicted by the runs "
              f"46-69 fit (L {old_launch:.1f}, h {old_h}) and the flagged fit (L {launch}, "
              f"h {h}):\n")
        print("| depth | own ms | n | measured | runs 46-69 fit | flagged fit |")
        print("|---|---|---|---|---|---|")
        for depth in sorted({s.depth for s in flagged}):
            for lo, hi in (*OWN_BINS, (0, 10**9)):
                sel = [s for s in flagged if s.depth == depth and lo <= s.own < hi]
                if len(sel) < 10:
                    continue
                span = "all" if (lo, hi) == (0, 10**9) else (
                    f"[{lo}, {hi if hi < 10**9 else 'up'})")
                print(f"| {depth} | {span} | {len(sel)} | {arrays(sel)[0].mean():.2f} "
                      f"| {predicted(sel, old_launch, old_h):.2f} "
                      f"| {predicted(sel, launch, h):.2f} |")
        print()
    print("## Every run: 46-69 inferred, 71-79 flagged\n")
    old, _ = pl.read()
    print("| model | steps | n | mean extra ms | L ms | h | rmse | rmse of a constant |")
    print("|---|---|---|---|---|---|---|---|")
    for model in ("dense", "moe"):
        rows = ([s for s in old if s.model == model and s.next_prefill]
                + [s for s in steps if s.model == model and s.flag])
        rows = [s for s in rows if s.extra < pl.OUTLIER_MS]
        print(f"| {model} ", end="")
        fit_line("pooled per step", rows)
        h = SHIPPED[model][1]
        per_run = [pl.fit_hidden(*arrays([s for s in rows if s.run == run]), h)[0]
                   for run in sorted({s.run for s in rows})]
        print(f"\n{model}: L per run at h {h}: {per_run}; median {np.median(per_run):.1f} ms\n")
    print("Flagged fits (L ms, h):", {m: f for m, f in fits.items()})


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Two ``specctl-eval`` result sets against the start probe's held-out rule
(``heldout_rule.md``), per seed and summed: cells met, by target (held-out exact,
in-distribution, perturbed, no profile), never-pays windows off on >= 90% of steps, the
geometric mean over every cell of AFTER's ppo throughput over BEFORE's, and per window the
change of the ppo oracle fraction: pooled over the windows where speculation never pays
(no speculation >= 0.99 of the oracle in BEFORE's run), and the worst windows of any kind.

    python docs/results/startprobe28/compare.py '/tmp/s28/base_s{seed}' \\
        '/tmp/s28/cand_s{seed}' --seeds 24-31 [--worst 10]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

#: Target classes of ``checks.cells`` (the start of their ``target`` text), in print order.
TARGETS = (("held-out", "held-out"), ("in-dist", "in-distribution"),
           ("perturbed", "perturbed profile"), ("none", "none profile"))


def load(pattern: str, seed: int) -> dict:
    """One seed's ``results.json``."""
    return json.loads((Path(pattern.format(seed=seed)) / "results.json").read_text())


def counts(results: dict) -> list[int]:
    """Cells met, then met per target class, then never-pays windows >= 90% off."""
    checks = results["checks"]
    by_target = [sum(bool(c["met"]) for c in checks["cells"].values()
                     if c["met"] is not None and c["target"].startswith(prefix))
                 for _, prefix in TARGETS]
    return [checks["cells_met"], *by_target, checks["never_pays"]["at_least_90pct_off"]]


def windows(results: dict) -> dict[str, tuple[float, float, str]]:
    """Window label -> (ppo / oracle, no speculation / oracle, prior mode); windows with no
    oracle throughput (empty) left out."""
    out = {}
    for scenario in results["scenarios"]:
        runs = scenario["runs"]
        best = runs["oracle"]["throughput_tok_s"]
        if best:
            out[scenario["scenario"]] = (runs["ppo"]["throughput_tok_s"] / best,
                                         runs["no_spec"]["throughput_tok_s"] / best,
                                         scenario["prior_mode"])
    return out


def cell_log_ratios(before: dict, after: dict) -> list[float]:
    """log(after / before) of every cell's ppo throughput where both are positive."""
    out = []
    for name, runs in before["cells"].items():
        old = (runs.get("ppo") or {}).get("throughput_tok_s")
        new = (after["cells"].get(name, {}).get("ppo") or {}).get("throughput_tok_s")
        if old and new:
            out.append(math.log(new / old))
    return out


def seed_range(text: str) -> list[int]:
    """``"24-31"`` -> [24, ..., 31]; ``"3"`` -> [3]."""
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--worst", type=int, default=10)
    args = parser.parse_args()
    names = ["cells", *(short for short, _ in TARGETS), "never-pays"]
    print("| seed | " + " | ".join(names) + " | geo mean | never-pays windows: mean change |")
    print("|---" * (len(names) + 3) + "|")
    totals = [[0] * len(names), [0] * len(names)]
    all_logs, all_never, moved = [], [], []
    for seed in seed_range(args.seeds):
        before, after = load(args.before, seed), load(args.after, seed)
        pair = counts(before), counts(after)
        for total, row in zip(totals, pair, strict=True):
            total[:] = [t + v for t, v in zip(total, row, strict=True)]
        logs = cell_log_ratios(before, after)
        all_logs += logs
        old, new = windows(before), windows(after)
        never = [new[w][0] - old[w][0] for w in old if w in new and old[w][1] >= 0.99]
        all_never += never
        moved += [(new[w][0] - old[w][0], seed, w, old[w][2]) for w in old if w in new]
        cells = " | ".join(f"{a} / {b}" for a, b in zip(*pair, strict=True))
        mean = sum(never) / len(never) if never else 0.0
        print(f"| {seed} | {cells} | {math.exp(sum(logs) / len(logs)):.4f} | "
              f"{mean:+.4f} ({len(never)}) |")
    cells = " | ".join(f"{a} / {b}" for a, b in zip(*totals, strict=True))
    mean = sum(all_never) / len(all_never) if all_never else 0.0
    print(f"| all | {cells} | {math.exp(sum(all_logs) / len(all_logs)):.4f} | "
          f"{mean:+.4f} ({len(all_never)}) |")
    print(f"\n(before / after; {len(moved)} windows, "
          f"{sum(1 for d, *_ in moved if abs(d) > 1e-9)} moved)\n")
    print("| profile handed | windows | moved | mean change | worst | best |")
    print("|---|---|---|---|---|---|")
    for prior in sorted({m[3] for m in moved}):
        deltas = [d for d, _, _, mode in moved if mode == prior]
        print(f"| {prior} | {len(deltas)} | {sum(abs(d) > 1e-9 for d in deltas)} | "
              f"{sum(deltas) / len(deltas):+.4f} | {min(deltas):+.4f} | {max(deltas):+.4f} |")
    print("\nworst windows:")
    for delta, seed, window, _ in sorted(moved)[:args.worst]:
        print(f"  {delta:+.4f}  seed {seed}  {window}")
    print("best windows:")
    for delta, seed, window, _ in sorted(moved, reverse=True)[:args.worst]:
        print(f"  {delta:+.4f}  seed {seed}  {window}")


if __name__ == "__main__":
    main()

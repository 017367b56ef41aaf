#!/usr/bin/env python
"""Two ``specctl-eval`` result sets compared window by window (the start rule's check,
``heldout_rule.md``): per seed the ppo oracle fraction of every no-profile window, split into
windows where speculation pays (no speculation <= 0.99 of the oracle in BEFORE's run) and
the rest; the pooled mean change and the worst windows; the geometric mean over the
no-profile cells of AFTER's ppo throughput over BEFORE's; and whether any cell with a
handed profile moved at all.

    python docs/results/start27/windows.py '/tmp/n26/c_s{seed}' '/tmp/s27/cand_s{seed}' \\
        [--seeds 0-7] [--worst 12]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load(pattern: str, seed: int) -> dict:
    return json.loads((Path(pattern.format(seed=seed)) / "results.json").read_text())


def fractions(results: dict) -> dict[str, tuple[float, float, str]]:
    """window label -> (ppo / oracle, no_spec / oracle, prior mode)."""
    out = {}
    for s in results["scenarios"]:
        runs = s["runs"]
        best = runs["oracle"]["throughput_tok_s"]
        if not best:
            continue
        out[s["scenario"]] = (runs["ppo"]["throughput_tok_s"] / best,
                              runs["no_spec"]["throughput_tok_s"] / best, s["prior_mode"])
    return out


def ppo_cells(results: dict) -> dict[str, float]:
    return {name: p["ppo"]["throughput_tok_s"] for name, p in results["cells"].items()
            if isinstance(p.get("ppo"), dict) and "throughput_tok_s" in p["ppo"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--worst", type=int, default=12)
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.seeds.split("-"))
    pays_moves, other_moves, logs, profiled_moved = [], [], [], []
    rows = []
    print("| seed | no-profile windows | pays: n, mean change, worst | rest: n, mean change, "
          "worst | no-profile cells: geo mean ratio |")
    print("|---|---|---|---|---|")
    for seed in range(lo, hi + 1):
        before, after = load(args.before, seed), load(args.after, seed)
        fb, fa = fractions(before), fractions(after)
        pays, rest = [], []
        for label, (x, nospec, mode) in fb.items():
            if label not in fa:
                continue
            y = fa[label][0]
            if mode != "none":
                if abs(y - x) > 1e-12:
                    profiled_moved.append((seed, label, x, y))
                continue
            (pays if nospec <= 0.99 else rest).append(y - x)
            rows.append((y - x, seed, label, x, y, nospec <= 0.99))
        cb, ca = ppo_cells(before), ppo_cells(after)
        seed_logs = [math.log(ca[n] / cb[n]) for n in cb
                     if n.endswith("/none") and n in ca and cb[n] > 0 and ca[n] > 0]
        for n in cb:
            if not n.endswith("/none") and n in ca and abs(ca[n] - cb[n]) > 1e-9 * cb[n]:
                profiled_moved.append((seed, n, cb[n], ca[n]))
        logs += seed_logs
        pays_moves += pays
        other_moves += rest

        def summary(moves: list[float]) -> str:
            if not moves:
                return "0"
            return f"{len(moves)}, {sum(moves) / len(moves):+.4f}, {min(moves):+.3f}"

        print(f"| {seed} | {len(pays) + len(rest)} | {summary(pays)} | {summary(rest)} | "
              f"{math.exp(sum(seed_logs) / max(len(seed_logs), 1)):.4f} |")
    print()
    n = len(pays_moves)
    print(f"Pooled, windows where speculation pays: {n}, mean change "
          f"{sum(pays_moves) / max(n, 1):+.4f}, worst {min(pays_moves, default=0):+.3f}, "
          f"best {max(pays_moves, default=0):+.3f}, below -0.05: "
          f"{sum(m < -0.05 for m in pays_moves)}, below -0.10: "
          f"{sum(m < -0.10 for m in pays_moves)}")
    m = len(other_moves)
    print(f"Pooled, other no-profile windows: {m}, mean change "
          f"{sum(other_moves) / max(m, 1):+.4f}, worst {min(other_moves, default=0):+.3f}, "
          f"best {max(other_moves, default=0):+.3f}")
    print(f"No-profile cells: geometric mean ratio {math.exp(sum(logs) / max(len(logs), 1)):.4f}"
          f" over {len(logs)} cell-seeds, worst {math.exp(min(logs, default=0)):.3f}, "
          f"best {math.exp(max(logs, default=0)):.3f}")
    print(f"Cells or windows with a handed profile that moved: {len(profiled_moved)}")
    for item in profiled_moved[:10]:
        print("  ", item)
    print()
    print(f"Worst {args.worst} and best 5 no-profile windows (change, seed, window, before, "
          "after, speculation pays):")
    rows.sort()
    for r in rows[:args.worst] + rows[-5:]:
        print(f"  {r[0]:+.3f} s{r[1]} {r[2]} {r[3]:.3f} -> {r[4]:.3f} "
              f"{'pays' if r[5] else 'never/little'}")


if __name__ == "__main__":
    main()

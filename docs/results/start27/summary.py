#!/usr/bin/env python
"""Per seed, two ``specctl-eval`` result sets against the held-out rule's counts
(``heldout_rule.md``): cells met, no-profile cells met, never-pays windows (>= 90% off),
the no-profile cells' geometric mean ppo ratio, and the no-profile windows where
speculation pays (no speculation <= 0.99 of the oracle in BEFORE): mean and worst change
of the oracle fraction. Last row: the sums, the pooled geometric mean and changes.

    python docs/results/start27/summary.py '/tmp/h26/cand_s{seed}' '/tmp/s27/cand_s{seed}' \\
        --seeds 8-15
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load(pattern: str, seed: int) -> dict:
    return json.loads((Path(pattern.format(seed=seed)) / "results.json").read_text())


def counts(results: dict) -> tuple[int, int, int]:
    checks = results["checks"]
    none = sum(bool(c["met"]) for c in checks["cells"].values()
               if c["met"] is not None and c["target"].startswith("none profile"))
    return checks["cells_met"], none, checks["never_pays"]["at_least_90pct_off"]


def pays_moves(before: dict, after: dict) -> list[float]:
    fa = {s["scenario"]: s["runs"] for s in after["scenarios"]}
    out = []
    for s in before["scenarios"]:
        runs = s["runs"]
        best = runs["oracle"]["throughput_tok_s"]
        if s["prior_mode"] != "none" or not best or s["scenario"] not in fa:
            continue
        if runs["no_spec"]["throughput_tok_s"] / best <= 0.99:
            out.append((fa[s["scenario"]]["ppo"]["throughput_tok_s"]
                        - runs["ppo"]["throughput_tok_s"]) / best)
    return out


def none_logs(before: dict, after: dict) -> list[float]:
    out = []
    for name, p in before["cells"].items():
        q = after["cells"].get(name, {})
        if name.endswith("/none") and isinstance(p.get("ppo"), dict) and isinstance(
                q.get("ppo"), dict):
            x, y = p["ppo"]["throughput_tok_s"], q["ppo"]["throughput_tok_s"]
            if x > 0 and y > 0:
                out.append(math.log(y / x))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--seeds", default="0-7")
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.seeds.split("-"))
    print("| seed | cells met | no-profile cells met | never-pays windows | no-profile geo "
          "mean ratio | pays windows: n, mean change, worst |")
    print("|---|---|---|---|---|---|")
    total_b, total_a, all_logs, all_moves = [0, 0, 0], [0, 0, 0], [], []
    for seed in range(lo, hi + 1):
        before, after = load(args.before, seed), load(args.after, seed)
        cb, ca = counts(before), counts(after)
        logs, moves = none_logs(before, after), pays_moves(before, after)
        total_b = [x + y for x, y in zip(total_b, cb, strict=True)]
        total_a = [x + y for x, y in zip(total_a, ca, strict=True)]
        all_logs += logs
        all_moves += moves
        print(f"| {seed} | " + " | ".join(f"{x} -> {y}" for x, y in zip(cb, ca, strict=True))
              + f" | {math.exp(sum(logs) / len(logs)):.4f} | {len(moves)}, "
              f"{sum(moves) / len(moves):+.4f}, {min(moves):+.3f} |")
    print("| all | " + " | ".join(f"{x} -> {y}" for x, y in zip(total_b, total_a, strict=True))
          + f" | {math.exp(sum(all_logs) / len(all_logs)):.4f} | {len(all_moves)}, "
          f"{sum(all_moves) / len(all_moves):+.4f}, {min(all_moves):+.3f} |")


if __name__ == "__main__":
    main()

"""The PPO file's throughput per cell of several ``specctl-eval`` results at the same seeds,
as ratios to the first, summarised per handed-profile mode (the cell name's last part:
exact, perturbed, swapped, none): cells, geometric mean, worst and best ratio, and the
cells beyond 2% either way.

    python docs/results/offceil24/cells_summary.py BASE=DIR_PATTERN LABEL=DIR_PATTERN ...

each ``DIR_PATTERN`` a results folder with ``{seed}`` in it (seeds 0-7), e.g.
``5c3d9060=/tmp/retrain22_eval/shipped_s{seed}``.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

SEEDS = range(8)


def ppo_throughputs(pattern: str) -> dict[tuple[int, str], float]:
    """(seed, cell) -> the PPO file's throughput, tok/s."""
    out = {}
    for seed in SEEDS:
        cells = json.loads(Path(pattern.format(seed=seed), "results.json").read_text())["cells"]
        for name, policies in cells.items():
            result = policies.get("ppo")
            if isinstance(result, dict) and "throughput_tok_s" in result:
                out[(seed, name)] = result["throughput_tok_s"]
    return out


def main(args: list[str]) -> None:
    runs = [arg.partition("=")[::2] for arg in args]
    (base_label, base_pattern), others = runs[0], runs[1:]
    base = ppo_throughputs(base_pattern)
    print(f"Ratios to {base_label}, seeds {SEEDS.start}-{SEEDS.stop - 1}, per handed profile\n")
    print("| file | profile | cells | geometric mean | worst | best | < 0.98 | > 1.02 |")
    print("|---|---|---|---|---|---|---|---|")
    for label, pattern in others:
        other = ppo_throughputs(pattern)
        by_mode: dict[str, list[float]] = defaultdict(list)
        for key, value in other.items():
            if key in base and base[key] > 0:
                by_mode[key[1].rsplit("/", 1)[-1]].append(value / base[key])
        for mode, ratios in sorted(by_mode.items()):
            mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            print(f"| {label} | {mode} | {len(ratios)} | {mean:.4f} | {min(ratios):.3f} | "
                  f"{max(ratios):.3f} | {sum(r < 0.98 for r in ratios)} | "
                  f"{sum(r > 1.02 for r in ratios)} |")


if __name__ == "__main__":
    main(sys.argv[1:])

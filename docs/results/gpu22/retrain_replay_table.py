"""``retrain_replay.txt`` as markdown: per serving, the replayed off share at batch 8-23 /
>= 24 and (in brackets) the features' median off price at >= 24 and priced depth 3 / off
goodput at 8-23, per file; then ranges per group (static and cap24 servings and run 73
"ppo r6" left out of the groups) with the change against the shipped file.

    python docs/results/gpu22/retrain_replay_table.py docs/results/gpu22/retrain_replay.txt
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

LABELS = ("shipped", "shipped_warmup", "rt22")


def fmt(summary: dict, key: str) -> str:
    return "-" if not summary else str(summary[key])


def main(path: str) -> None:
    rows: dict[tuple, dict] = defaultdict(dict)
    for line in Path(path).read_text().splitlines():
        item = json.loads(line)
        rows[(item["run"], item["serving"], item["model"])][item["through"]] = item
    print("| run | serving | model | measured off ms 8-23 / >=24 | "
          + " | ".join(LABELS) + " |")
    print("|---|---|---|---|" + "---|" * len(LABELS))
    groups: dict[str, list] = defaultdict(list)
    for (run, serving, model), by in rows.items():
        ref = by["shipped"]
        meas = [(ref[b].get("meas_ms_off_d3") or [None])[0] for b in ("8-23", ">=24")]
        cells = []
        for label in LABELS:
            lo, hi = by[label]["8-23"], by[label][">=24"]
            price = hi["pred_ms_off_d3"][0] if hi else "-"
            ratio = lo["priced_d3_over_off"] if lo else "-"
            cells.append(f"{fmt(lo, 'replayed_off')} / {fmt(hi, 'replayed_off')} "
                         f"({price}; {ratio})")
        bold = run == 73 and serving == "ppo r6"
        name = f"**{serving}**" if bold else serving
        print(f"| {run} | {name} | {model} | "
              + " / ".join("-" if m is None else str(m) for m in meas) + " | "
              + " | ".join(cells) + " |")
        if bold or serving.split()[0] in ("static_0", "static_3", "cap24"):
            continue
        rate = serving.split()[1].split("_")[0]
        group = "MoE" if model == "MoE" else f"dense, {rate[1:]} requests/s"
        groups[group].append(by)
    print("\n| group (servings) | file | 8-23 off share (change) | >= 24 off share (change) |")
    print("|---|---|---|---|")
    for group, items in sorted(groups.items()):
        for label in LABELS:
            parts = []
            for band in ("8-23", ">=24"):
                vals = [(b[label][band]["replayed_off"], b["shipped"][band]["replayed_off"])
                        for b in items if b[label][band]]
                if not vals:
                    parts.append("-")
                    continue
                shares = [v for v, _ in vals]
                text = f"{min(shares):.3f}-{max(shares):.3f}"
                if label != "shipped":
                    moves = [v - s for v, s in vals]
                    text += f" ({min(moves):+.3f}..{max(moves):+.3f})"
                parts.append(text)
            head = f"{group} ({len(items)})" if label == LABELS[0] else ""
            print(f"| {head} | {label} | {parts[0]} | {parts[1]} |")


if __name__ == "__main__":
    main(sys.argv[1])

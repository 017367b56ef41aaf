#!/usr/bin/env python
"""One-off: the markdown tables of ``diagnose.py``'s outputs, per seed.

    python docs/results/never_pays16/tabulate.py diag_s1.json diag_s2.json ...

(the seed is read from the file name's ``_s<N>``).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

TIE = 0.001
MECHANISMS = ("margin", "profile_error", "off_unmeasured", "depth_unmeasured", "acc_probe")


def cost_band(vs: float) -> str:
    """How much a window's policy lost to no speculation."""
    if vs >= 1.0 - TIE:
        return ">=0.999x"
    return "0.1-1%" if vs >= 0.99 else ">1%"


def main(paths: list[str]) -> None:
    """Print the tables."""
    print("| seed | missed | policy >= 0.999x no spec | static 3 >= 0.999x | "
          + " | ".join(MECHANISMS) + " | off probe at spec. steps (covered/confirmed/"
          "trusted/budget) | worst |")
    print("|---" * (7 + len(MECHANISMS)) + "|")
    groups: dict[int, Counter] = {}
    costly: list[tuple[int, dict]] = []
    for path in paths:
        seed = int(re.search(r"_s(\d+)", Path(path).name).group(1))
        rows = json.loads(Path(path).read_text())
        mech = Counter(r["mechanism"] for r in rows)
        probe: Counter = Counter()
        for r in rows:
            probe.update(r["off_probe_labels"])
        ties = sum(cost_band(r["vs_no_spec"]) == ">=0.999x" for r in rows)
        static_ties = sum((r["static3_vs_no_spec"] or 0) >= 1.0 - TIE for r in rows)
        worst = min(r["vs_no_spec"] for r in rows)
        print(f"| {seed} | {len(rows)} | {ties} | {static_ties} | "
              + " | ".join(str(mech.get(m, 0)) for m in MECHANISMS)
              + f" | {probe['covered']}/{probe['confirmed']}/{probe['trusted']}/"
              f"{probe['budget']} | {worst:.3f} |")
        groups[seed] = Counter((r["family"], r["workload"], r["prior_mode"], r["mechanism"],
                                cost_band(r["vs_no_spec"])) for r in rows)
        costly += [(seed, r) for r in rows if cost_band(r["vs_no_spec"]) != ">=0.999x"]
    print()
    print("| seed | family | workload | profile | mechanism | vs no spec | windows |")
    print("|---|---|---|---|---|---|---|")
    for seed, counter in groups.items():
        for key, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"| {seed} | " + " | ".join(key) + f" | {n} |")
    print()
    print("Windows losing more than 0.1% to no speculation:")
    print()
    print("| seed | window | off share | vs no spec | static 3 | mechanism (spec. steps) | "
          "off probe | priced (median log) |")
    print("|---|---|---|---|---|---|---|---|")
    for seed, r in sorted(costly, key=lambda sr: (sr[0], sr[1]["vs_no_spec"])):
        print(f"| {seed} | `{r['scenario'].split(' @')[0]}` | {r['off_share']:.3f} | "
              f"{r['vs_no_spec']:.4f} | {r['static3_vs_no_spec']} | "
              + ", ".join(f"{k} {v}" for k, v in sorted(r["guard_labels"].items(),
                                                        key=lambda kv: -kv[1]))
              + " | " + ", ".join(f"{k} {v}" for k, v in sorted(
                  r["off_probe_labels"].items(), key=lambda kv: -kv[1]))
              + f" | {r['margin_priced_median']} |")


if __name__ == "__main__":
    main(sys.argv[1:])

"""``specctl-eval`` results side by side: issue 9's targets (``plugin_sim/targets.py``) and,
per H200 cell with the exact profile handed, ppo's throughput, mean TPOT and off share
against no speculation's and static 3's.

    python docs/results/gpu22/eval_cells.py LABEL=RESULTS.json [LABEL=RESULTS.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin_sim"))
import targets

PREFIXES = ("h200_llama31_8b/", "moe_h200_acc2.5/", "moe_h200_acc1.1/")


def main(items: list[str]) -> None:
    targets.main(items)
    print("\n| run | cell | ppo tok/s | ppo TPOT ms | ppo off share | no_spec tok/s "
          "| no_spec TPOT | static_3 tok/s | static_3 TPOT | ppo / best baseline tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for item in items:
        label, _, path = item.partition("=")
        cells = json.loads(Path(path).read_text())["cells"]
        for name, cell in sorted(cells.items()):
            if not (name.startswith(PREFIXES) and name.endswith("/exact")):
                continue
            ppo, nos, st3 = cell["ppo"], cell["no_spec"], cell["static_3"]
            best = max(nos["throughput_tok_s"], st3["throughput_tok_s"])
            print(f"| {label} | {name} | {ppo['throughput_tok_s']:,.1f} "
                  f"| {ppo['mean_tpot_ms']:.2f} | {ppo['off_share']:.2f} "
                  f"| {nos['throughput_tok_s']:,.1f} | {nos['mean_tpot_ms']:.2f} "
                  f"| {st3['throughput_tok_s']:,.1f} | {st3['mean_tpot_ms']:.2f} "
                  f"| {ppo['throughput_tok_s'] / best:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])

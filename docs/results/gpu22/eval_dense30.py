"""``specctl-eval`` on the GPU's dense server at acceptance 3.0, without and with the launch
booking: per load, ``ppo``'s mean TPOT against no speculation's and static 3's, over the
windows of every seed given.

The evaluations (``eval_dense30.sh`` here: the fidelity server profile ``dense_spec.yaml``
before, ``dense_spec_launch.yaml`` after, as one family at simulated acceptance 3.0, its
own profile handed; azure_conv at loads 0.5 / 1 / 1.5, unmodulated and modulated, two
windows each; closed loops of 1, 16, 48, 64 clients), then

    python docs/results/gpu22/eval_dense30.py /tmp/g22 0 1 2 > docs/results/gpu22/eval_dense30.txt

reads ``/tmp/g22/d30_{before,after}_{shipped,old}_s{SEED}/results.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

RUNS = (("before", "shipped"), ("before", "old"), ("after", "shipped"), ("after", "old"))
FILES = {"shipped": "shipped file (5c3d9060)", "old": "file before (3dd256a8)"}


def group(scenario: str) -> str:
    name = scenario.split(" h200")[0]
    return name.split(" mod=")[0] if name.startswith("azure_conv") else name


def main(folder: str, seeds: list[str]) -> None:
    rows: dict[tuple, list] = {}
    for sim, file in RUNS:
        for seed in seeds:
            path = Path(folder) / f"d30_{sim}_{file}_s{seed}" / "results.json"
            for scenario in json.loads(path.read_text())["scenarios"]:
                runs = scenario["runs"]
                rows.setdefault((group(scenario["scenario"]), sim, file), []).append(
                    (runs["ppo"]["mean_tpot_ms"], runs["no_spec"]["mean_tpot_ms"],
                     runs["static_3"]["mean_tpot_ms"], runs["ppo"]["off_share"]))
    print(f"seeds {', '.join(seeds)}; ppo's mean TPOT over no speculation's per window "
          "(mean, worst), over static 3's (mean), ppo's off share\n")
    print("| windows | simulator | policy file | n | ppo / no_spec TPOT | worst | "
          "ppo / static_3 | off share | ppo ms | no_spec ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in dict.fromkeys(k[0] for k in rows):
        for sim, file in RUNS:
            a = np.array(rows[key, sim, file])
            ratio = a[:, 0] / a[:, 1]
            print(f"| {key} | {sim} | {FILES[file]} | {len(a)} | {ratio.mean():.3f} "
                  f"| {ratio.max():.3f} | {np.mean(a[:, 0] / a[:, 2]):.3f} "
                  f"| {a[:, 3].mean():.2f} | {a[:, 0].mean():.2f} | {a[:, 1].mean():.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

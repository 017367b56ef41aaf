"""Runs 61-74 (the servings ``gpu22/retrain_replay.py`` replays: ``lockin_eval.RUNS`` and run
74's four) open loop through ``5c3d9060`` (shipped before the twenty-third session), the
shipped ``65d4fb99`` (``ceil``: ``latency_off_ceiling`` 0.1) and this session's candidate
file (``latency_off_ceiling_batch`` 24 on top), with ``lockin_eval.replay_servings``. Writes
one JSON line per serving and file, then a markdown table per serving: replayed off share at
batch 8-23 / >= 24 and the features' median off price at >= 24 (ms).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/feat23/feat23_replay.py > docs/results/feat23/feat23_replay.txt
"""

from __future__ import annotations

import json
from pathlib import Path

from lockin_eval import SHIPPED, replay_servings
from retrain_replay import RUNS

from controller.policy_file import ExportedPolicy

HERE = Path(__file__).resolve().parent
FILES = {"5c3d9060": SHIPPED, "ceil": HERE.parent / "gpu22/policy_65d4fb99.npz",
         "feat23": HERE / "policy_e3ae0086.npz"}


def cell(band: dict, price: bool) -> str:
    """``off share`` (and `` (priced off ms)``) of one band_summary, or ``-``."""
    if not band.get("steps"):
        return "-"
    text = f"{band['replayed_off']:.3f}"
    return f"{text} ({band['pred_ms_off_d3'][0]})" if price else text


def main(files: dict[str, Path] = FILES) -> None:
    """Replay every serving through ``files`` (label -> policy file; the first one's
    measured prices head the table) and print the lines and the table."""
    policies = {label: ExportedPolicy.load(path) for label, path in files.items()}
    lines = []
    for line in replay_servings(RUNS, policies):
        lines.append(line)
        print(json.dumps(line), flush=True)
    print("\n| run | serving | model | measured off ms 8-23 / >=24 | "
          + " | ".join(f"{label} 8-23 / >=24 (priced off)" for label in files) + " |")
    print("|---|---|---|---|" + "---|" * len(files))
    by_serving: dict[tuple, dict] = {}
    for line in lines:
        by_serving.setdefault((line["run"], line["serving"], line["model"]), {})[
            line["through"]] = line
    for (run, serving, model), row in by_serving.items():
        first = row[next(iter(files))]
        measured = " / ".join(str(first[b]["meas_ms_off_d3"][0] or "-")
                              if first[b].get("steps") else "-" for b in ("8-23", ">=24"))
        cells = [f"{cell(row[label]['8-23'], False)} / {cell(row[label]['>=24'], True)}"
                 for label in files]
        print(f"| {run} | {serving} | {model} | {measured} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

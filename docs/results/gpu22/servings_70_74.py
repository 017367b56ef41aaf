"""Runs 70-74 (twenty-second session): per serving, the mean TPOT and TTFT, the decode
steps' depth shares per batch band, re-entry warm-ups per 1,000 decode steps, the measured
step latency per depth at batch >= 24 (``servings.serving_rows``), the telemetry replayed
open loop through the file that served it at batch 8-23 and >= 24 (``band_summary``), and
what the plugin's new ``before_prefill`` flag says: how often it agrees with "the next
record is a prefill" and the median latency of flagged and unflagged decode steps per
depth and band of running requests.

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18 \\
        python docs/results/gpu22/servings_70_74.py > docs/results/gpu22/servings_70_74.txt
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import replay_decisions as rd
from band_prices import band_summary
from servings import OFFSWITCH, RAMP, headline_servings

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile
from env.traces.trace_format import read_packed_trace

RESULTS = Path(__file__).resolve().parents[1]
FILES = {"ppo": RESULTS / "gpu21/policy_5c3d9060.npz",  # shipped in runs 65-77
         "old": RESULTS / "off_probe/policy_3dd256a8.npz",
         "ceil": RESULTS / "gpu22/policy_65d4fb99.npz"}  # the shipped file, off ceiling 0.1
#: run -> (model tag, profile, trace file's rate tag, servings in order after the first reload)
RUNS = {
    71: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6",
         [*RAMP, "ppo r6", "old r6", "ppo r6_2", "old r6_2"]),
    72: ("dense_acc3.0", "h200_llama31_8b_recorded", "r12r12", [*RAMP, "ppo r12", "ppo r12_2"]),
    73: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6",
         [*RAMP, "old r6", "ppo r6", "old r6_2", "ppo r6_2"]),
    74: ("moe_acc2.5", "h200_qwen3_30b_a3b", "r6r6",
         [*RAMP, "ceil r6", "ppo r6", "ceil r6_2", "ppo r6_2"]),
}
FLAG_BANDS = ((1, 8), (8, 24), (24, 49))


def flag_rows(trace_path: Path) -> dict:
    """The flag against the next record's kind, and flagged / unflagged latency medians."""
    columns = read_packed_trace(trace_path).step_columns()
    decode = columns.prefill_tokens == 0
    next_prefill = np.append(columns.prefill_tokens[1:] > 0, False)
    flag = columns.before_prefill
    row = {"decode_steps": int(decode.sum()),
           "flagged": int((decode & (flag == 1)).sum()),
           "flagged_next_not_prefill": int((decode & (flag == 1) & ~next_prefill).sum()),
           "unflagged_next_prefill": int((decode & (flag == 0) & next_prefill).sum()),
           "unknown": int((decode & (flag < 0)).sum())}
    latency = 1e3 * columns.step_latency_s
    for depth in (0, 3):
        for lo, hi in FLAG_BANDS:
            sel = (decode & (columns.steps_used == depth) & (columns.running_requests >= lo)
                   & (columns.running_requests < hi))
            groups = {"flagged": sel & (flag == 1), "unflagged": sel & (flag == 0),
                      "next_prefill_unflagged": sel & (flag == 0) & next_prefill}
            row[f"d{depth} running {lo}-{hi - 1}"] = {
                name: (int(mask.sum()), round(float(np.median(latency[mask])), 2))
                for name, mask in groups.items() if mask.sum() >= 5}
    return row


def report(runs: dict, nospec: dict[int, str], files: dict[str, Path] = FILES) -> None:
    """Print one JSON line per no-speculation replay (run -> file), per serving, per trace;
    ``files``: the policy file each serving's label names."""
    policies = {label: ExportedPolicy.load(path) for label, path in files.items()}
    for run, name in nospec.items():
        for path in sorted(OFFSWITCH.glob(name)):
            replay = json.loads(path.read_text())
            print(json.dumps({"run": run, "serving": f"nospec {path.stem.split('_')[-2]}",
                              "mean_tpot_ms": round(replay["headline"]["mean_tpot_ms"], 2),
                              "mean_ttft_ms": round(replay["headline"]["mean_ttft_ms"], 1)}))
    for run, (model, profile, tag, names) in runs.items():
        prior = load_profile(profile)
        for policy, steps, row in headline_servings(model, run, tag, names):
            replayed = rd.replay(steps, policies[policy], prior)
            row["replayed_8-23"] = band_summary(replayed, 8, 24)
            row["replayed_>=24"] = band_summary(replayed, 24, 10**9)
            print(json.dumps(row))
        trace = OFFSWITCH / f"{model}_trace_{tag}_run{run}.tar.gz"
        print(json.dumps({"run": run, "before_prefill": flag_rows(trace)}))


def main() -> None:
    report(RUNS, {70: "moe_nospec_replay_r6_run70.json"})

if __name__ == "__main__":
    main()

"""Run 44's two ``ppo`` servings replayed open loop (swap16's ``replay_decisions``) with the
shipped file, ``policy_c45d9410.npz`` (the same file, ``drop_warmup_latency`` on) and
``policy_9505319e.npz`` (also ``warmup_restarts_draft``), each with the borrowed profile
served in run 44 and with the MoE's own.

    PYTHONPATH=$PWD:docs/results/swap16 python docs/results/drop_warmup/replay_run44.py \\
        > docs/results/drop_warmup/replay_run44.txt
"""

from __future__ import annotations

from pathlib import Path

import replay_decisions as rd

from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile
from env.traces.trace_format import read_packed_trace

CANDIDATE = Path(__file__).resolve().parent / "policy_c45d9410.npz"


def main() -> None:
    trace = read_packed_trace(rd.TRACE)
    t0 = trace.meta["t0_unix"]
    print("| file | profile | rate | >= 24: depth shares | predicted off / depth 3 ms "
          "| depth 3 / off as priced | 8-23 | < 8 |")
    print("|---|---|---|---|---|---|---|---|")
    files = (("shipped", rd.SHIPPED), ("c45d9410", CANDIDATE),
             ("9505319e", CANDIDATE.parent / "policy_9505319e.npz"))
    for name, path in files:
        policy = ExportedPolicy.load(path)
        for profile in ("h100_llama31_8b", "h200_qwen3_30b_a3b"):
            prior = load_profile(profile)
            for serving, (start, end) in rd.SERVINGS.items():
                lo, hi = rd.unix(start) - t0, rd.unix(end) - t0
                records = [r for r in trace.steps if lo <= r.time_s < hi]
                bands = rd.summarise(rd.replay(records, policy, prior))
                high = bands[">=24"]
                print(f"| {name} | {profile} | {serving} | {high['replayed']} "
                      f"| {high['predicted_ms_depth0_depth3_median']} "
                      f"| {high['depth3_over_off_goodput_median']} "
                      f"| {bands['8-23']['replayed']} | {bands['<8']['replayed']} |")


if __name__ == "__main__":
    main()

"""Simulated vs measured: replay the H200 session's workloads in the simulator.

    python scripts/h200/compare.py [--results docs/results/h200] [--profile NAME_OR_PATH]

Reads what ``session.py`` measured (``sweep_real.json``, ``plain_static3.json``,
``headline_*.json``), runs the same workloads in the simulator with the given
profile, and writes ``fidelity.json`` and ``fidelity.md`` next to the results:

* the one-batch sweep (C requests at once, 256-token prompts, 128 output tokens,
  the measured load generator's client model from ``configs/workload/h200_measured.yaml``)
  for static depths and the PPO policy;
* the headline replay (Azure conv arrivals whose rate rises and falls, from
  ``session.headline_workload``) for steps 0, static 3, SGLang's adaptive rule and PPO.

The PPO policy runs with the cost profile the real controller used as its prior
(``controller_prior_profile.yaml``) so both sides see the same features.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agents.policies import SGLangAdaptivePolicy, make_policy
from env.acceptance import SGLangSimulatedAcceptance
from env.cost_model import load_profile
from env.features import FeatureSpec
from env.rollout import DecisionLoop, rollout
from env.simulator import SchedulerConfig, Simulator
from env.workloads import ClosedLoop, Workload

REPO = Path(__file__).resolve().parents[2]


def simulate(profile, workload, policy, prior=None, horizon_s=None, seed=0) -> dict:
    sim = Simulator(profile, SGLangSimulatedAcceptance(3.5), workload,
                    SchedulerConfig.from_profile(profile), seed=seed)
    result = rollout(DecisionLoop(sim, FeatureSpec(), 3, horizon_s, cost_prior=prior), policy)
    return {"throughput_tok_s": result.throughput_tok_s, "mean_tpot_ms": result.mean_tpot_ms}


def policy_for(name: str, profile):
    if name == "sglang_adaptive":  # SGLang's default config, as the plain server ran it
        return SGLangAdaptivePolicy(initial_steps=7)
    return make_policy(name, profile=profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(REPO / "docs/results/h200"))
    parser.add_argument("--profile", default="h200_llama31_8b_recorded")
    args = parser.parse_args()
    results = Path(args.results)
    profile = load_profile(args.profile)
    prior = load_profile(results / "controller_prior_profile.yaml")
    client = OmegaConf.load(REPO / "configs/workload/h200_measured.yaml")
    report = {"profile": profile.name, "sweep": {}, "headline": {}}

    real_sweep = json.loads((results / "sweep_real.json").read_text())
    real_plain = json.loads((results / "plain_static3.json").read_text())
    for name in ("static_0", "static_1", "static_3", "static_7", "ppo"):
        for c, measured in real_sweep[name].items():
            loop = ClosedLoop(int(c), 256, 128, requests_per_client=1,
                              start_interval_s=float(client.start_interval_s),
                              client_overhead_s=float(client.client_overhead_s))
            sim = simulate(profile, loop, policy_for(name, profile), prior)
            report["sweep"].setdefault(name, {})[c] = {
                "measured": measured["throughput_tok_s"], "simulated": sim["throughput_tok_s"]}
    for c, measured in real_plain.items():
        if c.isdigit():
            report["sweep"].setdefault("static_3_no_plugin", {})[c] = {
                "measured": measured["throughput_tok_s"],
                "simulated": report["sweep"]["static_3"][c]["simulated"]}

    from session import headline_workload

    arrivals, prompts, outputs = headline_workload()
    workload = Workload("headline", np.asarray(arrivals), np.asarray(prompts, np.int32),
                        np.asarray(outputs, np.int32))
    measured = {}
    for file in ("headline_real.json", "headline_sglang.json", "headline_static3.json"):
        measured.update({k: v for k, v in json.loads((results / file).read_text()).items()
                         if k != "workload"})
    for name in ("static_0", "static_3", "sglang_adaptive", "ppo"):
        sim = simulate(profile, workload, policy_for(name, profile), prior)
        report["headline"][name] = {
            "measured_tok_s": measured[name]["throughput_tok_s"],
            "simulated_tok_s": sim["throughput_tok_s"],
            "measured_tpot_ms": measured[name]["mean_tpot_ms"],
            "simulated_tpot_ms": sim["mean_tpot_ms"],
        }
    (results / "fidelity.json").write_text(json.dumps(report, indent=2))
    lines = [f"Simulated ({profile.name}) vs measured on the H200, output tok/s", "",
             "| policy | " + " | ".join(f"C={c}" for c in real_sweep["static_0"]) + " |",
             "|---" * (len(real_sweep["static_0"]) + 1) + "|"]
    for name, cells in report["sweep"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{v['measured']:,.0f} / {v['simulated']:,.0f} "
            f"({v['simulated'] / v['measured'] - 1:+.0%})" for v in cells.values()) + " |")
    lines += ["", "| headline policy | measured tok/s | simulated | measured TPOT ms | simulated |",
              "|---|---|---|---|---|"]
    for name, v in report["headline"].items():
        lines.append(f"| {name} | {v['measured_tok_s']:,.0f} | {v['simulated_tok_s']:,.0f} | "
                     f"{v['measured_tpot_ms']:.1f} | {v['simulated_tpot_ms']:.1f} |")
    (results / "fidelity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

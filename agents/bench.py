"""``specctl-bench``: the closed-loop concurrency sweep.

For each concurrency C and each policy, C simulated clients send requests back
to back (the next when the previous finishes) to the simulated server for a
fixed horizon; the cell reports output tokens per second, mean TPOT and mean
end-to-end latency. Writes ``results.json`` and ``throughput.png`` into the
Hydra output directory and prints a table.

    specctl-bench profile=blackwell_tp8 'policies=[no_spec,static_3]' concurrency=[1,70,250]
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from agents import checks
from agents.cli import hydra_app
from agents.policies import make_policy
from agents.progress import run_all
from agents.report import plot_sweep, sweep_table
from env.factory import make_acceptance, make_closed_loop, make_profile, make_scheduler_config
from env.features import FeatureSpec
from env.rollout import DecisionLoop, RunResult, rollout
from env.sim.simulator import Simulator

log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def _parts(profile: str, acceptance_json: str, max_depth: int):
    """Profile and acceptance model, built once per worker process."""
    profile_obj = make_profile(profile)
    acceptance = make_acceptance(json.loads(acceptance_json), profile_obj, max_depth)
    return profile_obj, acceptance


def run_cell(settings: Mapping[str, Any], policy_name: str, concurrency: int) -> RunResult:
    """One (policy, concurrency) cell of the sweep; ``settings`` is the plain bench config."""
    max_depth = int(settings["max_depth"])
    profile, acceptance = _parts(str(settings["profile"]), json.dumps(settings["acceptance"]),
                                 max_depth)
    config = make_scheduler_config(settings.get("sim"), profile, max_depth)
    workload = make_closed_loop(settings["workload"], concurrency,
                                settings.get("requests_per_client"), profile)
    sim = Simulator(profile, acceptance, workload, config, seed=int(settings["seed"]))
    policy = make_policy(policy_name, profile=profile, max_depth=max_depth,
                         policy_path=settings.get("policy_path"),
                         sim_config=config)
    loop = DecisionLoop(sim, policy.feature_spec(FeatureSpec(max_depth=max_depth)),
                        feedback_lag=int(settings["feedback_lag"]),
                        horizon_s=settings.get("horizon_s"),
                        cost_prior=profile if settings.get("cost_prior", "profile") == "profile"
                        else None)
    return rollout(loop, policy, seed=int(settings["seed"]))


def run_sweep(settings: Mapping[str, Any]) -> dict:
    """Every (policy, concurrency) cell; returns the ``results.json`` document."""
    settings = dict(settings)
    cells = [(p, int(c)) for p in settings["policies"] for c in settings["concurrency"]]
    outcomes = run_all(run_cell, [(settings, p, c) for p, c in cells],
                       workers=max(1, int(settings.get("workers", 1))),
                       desc=f"sweep {settings['profile']}")
    results: dict[str, dict[str, dict]] = {}
    for (policy, concurrency), outcome in zip(cells, outcomes, strict=True):
        results.setdefault(policy, {})[str(concurrency)] = {
            "throughput_tok_s": outcome.throughput_tok_s,
            "mean_tpot_ms": _finite(outcome.mean_tpot_ms),
            "mean_e2e_s": _finite(outcome.mean_e2e_s),
            "steps_chosen": outcome.steps_chosen,
        }
    return {
        "profile": str(settings["profile"]),
        "workload": settings["workload"],
        "horizon_s": settings.get("horizon_s"),
        "results": results,
    }


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


def write_outputs(document: dict, out_dir: Path, plot: bool = True) -> None:
    """``results.json`` (and ``throughput.png``) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(document, indent=2))
    if plot:
        plot_sweep(document["results"], out_dir / "throughput.png",
                   title=f"profile {document['profile']}")


def check_settings(settings: Mapping[str, Any]) -> None:
    """Every name, file and number of a bench config, before the sweep starts."""
    profile = checks.profile("profile", settings["profile"])
    checks.concurrency("concurrency", settings["concurrency"])
    checks.workload("workload", settings["workload"])
    if "ppo" in settings["policies"]:
        checks.policy_file("policy_path", settings.get("policy_path"))
    checks.policies("policies", settings["policies"], profile=profile,
                    max_depth=int(settings["max_depth"]), policy_path=settings.get("policy_path"))


@hydra_app("bench", prog="specctl-bench")
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``specctl-bench``."""
    settings = OmegaConf.to_container(cfg, resolve=True)
    check_settings(settings)
    document = run_sweep(settings)
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    write_outputs(document, out_dir, plot=bool(cfg.plot))
    sweep_table(document["results"],
                title=f"output tok/s, {cfg.profile}")
    log.info("results in %s (results.json%s)", out_dir, ", throughput.png" if cfg.plot else "")


if __name__ == "__main__":
    main()

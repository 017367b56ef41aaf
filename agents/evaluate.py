"""``specctl-eval``: an exported policy against every baseline.

Runs each policy on the held-out windows of every workload (the last
``held_out_fraction`` of each trace, at each configured load, steady and
modulated) and on the closed-loop concurrency sweep, then writes into the
output directory:

* ``results.json``: ``{"workloads": {name: {policy: {"throughput_tok_s",
  "mean_tpot_ms", "oracle_fraction", ...}}}, "sweep": <bench results>,
  "sweep_by_profile": {...}, "scenarios": [...], "checks": {...}}``;
* ``report.md``: the tables and the target checks;
* ``throughput_<profile>.png`` (throughput vs concurrency) and
  ``policy_map_<profile>.png`` (steps chosen against batch size and acceptance).

    specctl-eval                                  # the shipped default policy
    specctl-eval policy=outputs/train/.../policy.npz workload.path=my_trace.parquet
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import hydra
import matplotlib
import numpy as np
from omegaconf import DictConfig

from agents.bench import run_sweep
from agents.config import env_config
from agents.policies import make_policy
from agents.report import plot_sweep
from controller.default_policy import default_policy_path
from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder, FeatureSpec
from env.rollout import DecisionLoop, rollout
from env.scenarios import ScenarioSampler
from env.schema import StepRecord
from env.simulator import Simulator

matplotlib.use("Agg")
import matplotlib.pyplot as plt

log = logging.getLogger(__name__)

#: Policies that know what no online controller can (excluded from "best baseline").
CLAIRVOYANT = {"oracle"}


@lru_cache(maxsize=4)
def _scenarios(env_json: str, windows: int, seed: int):
    return ScenarioSampler(json.loads(env_json), split="eval").evaluation(windows, seed)


def _run_scenario(env_json: str, windows: int, seed: int, index: int, policy_name: str,
                  policy_path: str | None) -> dict:
    env = json.loads(env_json)
    scenario = _scenarios(env_json, windows, seed)[index]
    sim = Simulator(scenario.profile, scenario.acceptance, scenario.workload, scenario.config,
                    seed=scenario.seed)
    slo = env.get("slo_tpot_ms")
    loop = DecisionLoop(sim, FeatureSpec(max_depth=int(env["max_depth"])),
                        feedback_lag=int(env["feedback_lag"]), horizon_s=scenario.horizon_s,
                        slo_tpot_s=None if slo is None else slo / 1e3,
                        cost_prior=scenario.profile if env.get("cost_prior", "profile")
                        == "profile" else None)
    policy = make_policy(policy_name, profile=scenario.profile, max_depth=int(env["max_depth"]),
                         policy_path=policy_path,
                         sim_config=scenario.config)
    result = rollout(loop, policy, seed=scenario.seed).as_dict()
    result["scenario"] = scenario.label
    return result


def evaluate_workloads(env: Mapping[str, Any], policies: Sequence[str], policy_path: str | None,
                       windows: int = 2, seed: int = 0, workers: int = 1) -> dict:
    """Every policy on every held-out scenario; per-workload aggregates and the details."""
    env_json = json.dumps(env, sort_keys=True)
    scenarios = _scenarios(env_json, windows, seed)
    tasks = [(env_json, windows, seed, i, p, policy_path)
             for i in range(len(scenarios)) for p in policies]
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            outcomes = list(pool.map(_run_scenario, *zip(*tasks, strict=True), chunksize=4))
    else:
        outcomes = [_run_scenario(*task) for task in tasks]

    details: list[dict] = []
    for i, scenario in enumerate(scenarios):
        runs = {o["policy"]: o for o in outcomes[i * len(policies):(i + 1) * len(policies)]}
        oracle = runs.get("oracle", {}).get("throughput_tok_s")
        details.append({
            "scenario": scenario.label,
            "workload": scenario.workload_name,
            "profile": scenario.profile.name,
            "modulated": scenario.varying_load,
            "runs": {
                name: {
                    "throughput_tok_s": run["throughput_tok_s"],
                    "mean_tpot_ms": _finite(run["mean_tpot_ms"]),
                    "oracle_fraction": (run["throughput_tok_s"] / oracle) if oracle else None,
                    "steps_chosen": run["steps_chosen"],
                    "slo_goodput_tok_s": run["slo_goodput_tok_s"],
                }
                for name, run in runs.items()
            },
        })
    return {"workloads": _aggregate(details, policies), "scenarios": details}


def _aggregate(details: list[dict], policies: Sequence[str]) -> dict:
    out: dict[str, dict] = {}
    for workload in sorted({d["workload"] for d in details}):
        rows = [d for d in details if d["workload"] == workload]
        out[workload] = {}
        for policy in policies:
            runs = [d["runs"][policy] for d in rows]
            fractions = [r["oracle_fraction"] for r in runs if r["oracle_fraction"] is not None]
            tpots = [r["mean_tpot_ms"] for r in runs if r["mean_tpot_ms"] is not None]
            out[workload][policy] = {
                "throughput_tok_s": float(np.mean([r["throughput_tok_s"] for r in runs])),
                "mean_tpot_ms": float(np.mean(tpots)) if tpots else None,
                "oracle_fraction": float(np.mean(fractions)) if fractions else None,
                "scenarios": len(runs),
            }
    return out


def _finite(value: float) -> float | None:
    return None if value is None or math.isnan(value) else value


def target_checks(document: dict, policy: str = "ppo") -> dict:
    """The evaluation targets of the default policy, measured on this document."""
    checks: dict[str, Any] = {}
    workloads = document.get("workloads", {})
    for name, table in workloads.items():
        if policy not in table:
            continue
        ours = table[policy]
        baselines = {p: v["throughput_tok_s"] for p, v in table.items()
                     if p not in CLAIRVOYANT and p != policy}
        best = max(baselines, key=baselines.get) if baselines else None
        checks[name] = {
            "oracle_fraction": ours["oracle_fraction"],
            "meets_95pct_of_oracle": (ours["oracle_fraction"] or 0.0) >= 0.95,
            "best_baseline": best,
            "vs_best_baseline": ours["throughput_tok_s"] / baselines[best] if best else None,
            "at_least_best_baseline": bool(best) and ours["throughput_tok_s"]
            >= baselines[best] * (1 - 1e-9),
        }
    varying = [d for d in document.get("scenarios", []) if d["modulated"]
               and policy in d["runs"] and "sglang_adaptive" in d["runs"]
               and d["runs"]["sglang_adaptive"]["throughput_tok_s"] > 0]
    if varying:
        wins = [d["runs"][policy]["throughput_tok_s"] >= d["runs"]["sglang_adaptive"][
            "throughput_tok_s"] for d in varying]
        checks["varying_load_vs_sglang_adaptive"] = {
            "scenarios": len(varying), "wins": int(sum(wins)),
            "mean_ratio": float(np.mean([d["runs"][policy]["throughput_tok_s"]
                                         / d["runs"]["sglang_adaptive"]["throughput_tok_s"]
                                         for d in varying])),
        }
    for profile, sweep in document.get("sweep_by_profile", {}).items():
        results = sweep["results"]
        if policy not in results or "no_spec" not in results or "static_3" not in results:
            continue
        shortfalls = {}
        for c, cell in results[policy].items():
            bar = max(results["no_spec"][c]["throughput_tok_s"],
                      results["static_3"][c]["throughput_tok_s"])
            shortfalls[c] = cell["throughput_tok_s"] / bar
        checks[f"sweep_{profile}_vs_max_nospec_eagle3"] = {
            "ratio_by_concurrency": shortfalls,
            "all_at_least": all(v >= 1 - 1e-9 for v in shortfalls.values()),
            "worst_ratio": min(shortfalls.values()),
        }
    return checks


def policy_map(exported: ExportedPolicy, profile, path: Path,
               batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
               accept_rates: Sequence[float] = (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)) -> np.ndarray:
    """Steps the policy chooses against batch size and per-position acceptance rate.

    The telemetry fed to the feature builder is synthetic but consistent: steps
    at every depth with the profile's latency at that batch size and geometric
    acceptance at the given rate.
    """
    rng = np.random.default_rng(0)
    spec = exported.feature_spec
    chosen = np.zeros((len(accept_rates), len(batch_sizes)), dtype=int)
    for i, alpha in enumerate(accept_rates):
        for j, batch in enumerate(batch_sizes):
            builder = FeatureBuilder(spec)
            kv = batch * 1500
            for step in range(64):
                depth = step % (spec.max_depth + 1)
                accepted = np.minimum(rng.geometric(1 - alpha, batch) - 1, depth).astype(np.int8)
                latency = profile.step_latency_s(batch, depth, kv, 0)
                builder.update(StepRecord(
                    server="map", rank=0, step_index=step, time_s=step * latency,
                    batch_size=batch, waiting_requests=0, running_requests=batch,
                    kv_used_tokens=kv, kv_capacity_tokens=profile.server.kv_capacity_tokens,
                    prefill_tokens=0, steps_used=depth,
                    accepted_drafts=accepted if depth else np.zeros(0, np.int8),
                    step_latency_s=latency))
            chosen[i, j] = exported.act(builder.observation(batch).vector)
    fig, ax = plt.subplots(figsize=(7, 4))
    image = ax.imshow(chosen, origin="lower", aspect="auto", cmap="viridis",
                      vmin=0, vmax=spec.max_depth)
    ax.set_xticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
    ax.set_yticks(range(len(accept_rates)), [f"{a:.1f}" for a in accept_rates])
    for (i, j), steps in np.ndenumerate(chosen):
        ax.text(j, i, str(steps), ha="center", va="center", color="w", fontsize=8)
    ax.set_xlabel("batch size")
    ax.set_ylabel("per-position acceptance rate")
    ax.set_title(f"{exported.name}: speculation steps chosen ({profile.name})")
    fig.colorbar(image, ax=ax, label="steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return chosen


def write_report(document: dict, out_dir: Path, title: str) -> None:
    """``report.md`` with the workload table, the sweep and the target checks."""
    lines = [f"# {title}", ""]
    for name, table in document["workloads"].items():
        lines += [f"## Workload `{name}` (held-out windows)", "",
                  "| policy | tok/s | mean TPOT ms | oracle fraction |", "|---|---|---|---|"]
        for policy, row in table.items():
            frac = row["oracle_fraction"]
            tpot = row["mean_tpot_ms"]
            lines.append(f"| {policy} | {row['throughput_tok_s']:,.1f} | "
                         f"{'-' if tpot is None else f'{tpot:.2f}'} | "
                         f"{'-' if frac is None else f'{frac:.3f}'} |")
        lines.append("")
    for profile, sweep in document.get("sweep_by_profile", {}).items():
        results = sweep["results"]
        cs = sorted({int(c) for cells in results.values() for c in cells})
        lines += [f"## Concurrency sweep, `{profile}` (output tok/s)", "",
                  "| policy | " + " | ".join(f"C={c}" for c in cs) + " |",
                  "|---" * (len(cs) + 1) + "|"]
        for policy, cells in results.items():
            lines.append(f"| {policy} | " + " | ".join(
                f"{cells[str(c)]['throughput_tok_s']:,.0f}" for c in cs) + " |")
        lines += ["", f"![throughput]({f'throughput_{profile}.png'})", ""]
    lines += ["## Target checks", "", "```json", json.dumps(document["checks"], indent=2), "```"]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")


def run_evaluation(cfg: DictConfig, policy_path: str | None, out_dir: Path) -> dict:
    """Everything ``specctl-eval`` does; also called at the end of ``specctl-train``."""
    env = env_config(cfg)
    ev = cfg.eval
    policies = list(ev.policies)
    path = str(policy_path or default_policy_path())
    document = evaluate_workloads(env, policies, path, int(ev.windows), int(cfg.seed),
                                  int(ev.workers))
    sweep_profiles = list(ev.sweep_profiles or env["profiles"])
    document["sweep_by_profile"] = {}
    for profile in sweep_profiles:
        settings = {
            "profile": profile, "acceptance": env.get("acceptance"),
            "max_depth": env["max_depth"], "policies": list(ev.sweep_policies),
            "policy_path": path, "concurrency": list(ev.sweep_concurrency),
            "horizon_s": ev.sweep_horizon_s, "requests_per_client": None,
            "feedback_lag": env["feedback_lag"], "seed": int(cfg.seed),
            "workers": int(ev.workers), "sim": env.get("sim"),
            "cost_prior": env.get("cost_prior", "profile"),
            "workload": {"name": "fixed", "path": None, "prompt_tokens": None,
                         "output_tokens": None},
        }
        sweep = run_sweep(settings)
        document["sweep_by_profile"][profile] = sweep
        plot_sweep(sweep["results"], out_dir / f"throughput_{profile}.png", title=profile)
    document["sweep"] = document["sweep_by_profile"][sweep_profiles[0]]["results"]
    document["policy"] = path
    document["checks"] = target_checks(document) if "ppo" in policies else {}
    if ev.policy_map and "ppo" in policies:
        from env.factory import make_profile

        exported = ExportedPolicy.load(path)
        for profile in sweep_profiles:
            policy_map(exported, make_profile(profile), out_dir / f"policy_map_{profile}.png")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(document, indent=2))
    write_report(document, out_dir, title=f"specctl evaluation of {Path(path).name}")
    return document


@hydra.main(config_path="pkg://configs", config_name="eval", version_base=None)
def main(cfg: DictConfig) -> None:
    """Hydra entry point of ``specctl-eval``."""
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    document = run_evaluation(cfg, cfg.policy, out_dir)
    for name, table in document["workloads"].items():
        log.info("%s: %s", name, {p: round(v["throughput_tok_s"], 1) for p, v in table.items()})
    log.info("checks: %s", json.dumps(document["checks"]))
    log.info("wrote %s", out_dir / "report.md")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""One-off (sixteenth session, issue 9): why the policy speculates in the never-pays
windows it misses. Not a new evaluator: it reads a ``specctl-eval`` run's
``results.json`` (its ``checks.never_pays.missed_windows``), reruns each missed window
exactly as ``specctl-eval`` does (the scenario from ``agents.evaluate._scenarios``, the
``ppo`` adapter with its file's guard and probes, ``env.rollout.rollout``), checks that
the rerun serves the recorded throughput, and labels every speculative step by what let
it run:

* the goodput guard, judged on the row the policy decided on (as ``env.guard`` judges
  it): ``margin`` (the depth priced at or above ``1 - margin`` of off's goodput: the
  policy's own choice, where the guard's margin does not reach), else the first of
  ``profile_error`` (|cost_profile_error| > max_profile_error), ``off_unmeasured``
  (cost_confidence_0 < confidence), ``depth_unmeasured`` (cost_confidence_d <
  confidence); ``acc_probe`` where the acceptance probe turned an off row into depth 1;
* the off probe, read from the stream's tracker before the step (its batch bucket):
  ``confirmed`` (off's prediction confirmed there), ``covered`` (off measured nearby:
  coverage >= off_samples), ``trusted`` (off_trust: the profile error within it),
  ``budget`` (accruing, not yet due), ``none`` (the file has no off probe).

The window's mechanism is the guard label of most of its speculative steps. A window
is a tie when the policy serves within 0.1% of no speculation. Usage::

    PYTHONPATH=$PWD python docs/results/never_pays16/diagnose.py SEED RESULTS_JSON \\
        [--policy FILE] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

from agents.evaluate import _eval_env, _scenarios
from agents.policies import ExportedPolicyAdapter, make_policy
from env.features import FeatureSpec
from env.guard import apply_guard
from env.probe import PROBE_ACCEPTANCE, apply_probe, off_bucket
from env.rollout import DecisionLoop, rollout
from env.sim.simulator import Simulator

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TIE = 0.001


class TracingAdapter(ExportedPolicyAdapter):
    """The ``ppo`` adapter, deciding exactly as it does, noting each speculative step's
    labels (see the module)."""

    def __init__(self, base: ExportedPolicyAdapter, loop: DecisionLoop) -> None:
        super().__init__(base.exported, base.name, base.probe, base.guard)
        self.loop = loop
        names = self.exported.feature_spec.names()
        self.goodput = {d: names.index(f"relative_goodput_{d}")
                        for d in range(1, self.exported.feature_spec.max_depth + 1)}
        self.confidence = [names.index(f"cost_confidence_{d}")
                           for d in range(self.exported.feature_spec.max_depth + 1)]
        self.error = names.index("cost_profile_error")
        self.guard_labels: Counter = Counter()
        self.probe_labels: Counter = Counter()
        self.priced: list[float] = []  # log goodput over off of 'margin' steps
        self.speculative = 0
        self.steps = 0

    def act(self, obs) -> int:
        vector = obs.vector.reshape(1, -1)
        raw = np.argmax(self.exported.logits(vector), axis=-1).reshape(1, 1)
        index = raw.copy()
        apply_guard(self.guard, self._columns, vector, index, self._actions, [None])
        if obs.probing:
            apply_probe(self.probe, index, self._actions, [obs.probing], [None])
        depth = int(self._actions[index[0, 0]])
        self.steps += 1
        if depth > 0:
            self.speculative += 1
            self._label(vector[0], int(self._actions[raw[0, 0]]), obs)
        return depth

    def _label(self, row: np.ndarray, chosen: int, obs) -> None:
        guard = self.guard
        if chosen == 0 and obs.probing == PROBE_ACCEPTANCE:
            self.guard_labels["acc_probe"] += 1
            return
        priced = 3.0 * float(row[self.goodput[chosen]])
        if not guard.enabled:
            label = "guard_off"
        elif priced >= math.log1p(-guard.margin):
            label = "margin"
            self.priced.append(priced)
        elif abs(row[self.error]) > guard.max_profile_error:
            label = "profile_error"
        elif row[self.confidence[0]] < guard.confidence:
            label = "off_unmeasured"
        elif row[self.confidence[chosen]] < guard.confidence:
            label = "depth_unmeasured"
        else:
            label = "guard_should_act?"  # never expected
        self.guard_labels[label] += 1
        self.probe_labels[self._probe_label()] += 1

    def _probe_label(self) -> str:
        features = self.loop.features
        tracker = features.probe_tracker
        spec = self.probe
        if tracker is None or not spec.off_share:
            return "none"
        batch = self.loop.sim.batch_size
        if tracker.off_confirmed[off_bucket(batch)]:
            return "confirmed"
        if tracker.off_coverage(batch, features.spec.latency_forgetting) >= spec.off_samples:
            return "covered"
        if (spec.off_trust and features.cost_prior is not None
                and abs(features.profile_log_error) <= spec.off_trust):
            return "trusted"
        return "budget"


def diagnose(seed: int, results: dict, policy_path: str | None,
             overrides: list[str]) -> list[dict]:
    """One entry per missed never-pays window of ``results`` (see the module)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(config_name="eval", overrides=[f"seed={seed}", *overrides])
    env = _eval_env(cfg)
    ev = cfg.eval
    scenarios = _scenarios(json.dumps(env, sort_keys=True), int(ev.windows), seed,
                           tuple(ev.get("prior_modes") or ("exact",)),
                           int(ev.get("random_servers") or 0))
    by_label = {s.label: s for s in scenarios}
    recorded = {d["scenario"]: d for d in results["scenarios"]}
    out = []
    max_depth = int(env["max_depth"])
    for missed in results["checks"]["never_pays"]["missed_windows"]:
        scenario = by_label[missed["scenario"]]
        sim = Simulator(scenario.profile, scenario.acceptance, scenario.workload,
                        scenario.config, seed=scenario.seed)
        base = make_policy("ppo", profile=scenario.prior, max_depth=max_depth,
                           policy_path=policy_path, sim_config=scenario.config)
        loop = DecisionLoop(sim, base.feature_spec(FeatureSpec(max_depth=max_depth)),
                            feedback_lag=int(env["feedback_lag"]),
                            horizon_s=scenario.horizon_s, cost_prior=scenario.prior)
        policy = TracingAdapter(base, loop)
        run = rollout(loop, policy, seed=scenario.seed).as_dict()
        runs = recorded[missed["scenario"]]["runs"]
        no_spec = runs["no_spec"]["throughput_tok_s"]
        mechanism = policy.guard_labels.most_common(1)[0][0]
        out.append({
            "scenario": missed["scenario"], "family": scenario.family,
            "workload": recorded[missed["scenario"]]["workload"],
            "prior_mode": scenario.prior_mode,
            "off_share": missed["off_share"], "vs_no_spec": missed["vs_no_spec"],
            "rerun_matches": bool(np.isclose(run["throughput_tok_s"],
                                             runs["ppo"]["throughput_tok_s"], rtol=1e-9)),
            "tie": abs(missed["vs_no_spec"] - 1.0) <= TIE,
            "static3_vs_no_spec": round(runs["static_3"]["throughput_tok_s"] / no_spec, 4)
            if "static_3" in runs else None,
            "oracle_off_share": round(runs["oracle"]["off_share"], 4),
            "speculative_steps": policy.speculative, "steps": policy.steps,
            "mechanism": mechanism, "guard_labels": dict(policy.guard_labels),
            "off_probe_labels": dict(policy.probe_labels),
            "margin_priced_median": round(float(np.median(policy.priced)), 4)
            if policy.priced else None,
            "steps_chosen": run["steps_chosen"],
        })
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, diagnose, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seed", type=int)
    parser.add_argument("results", help="a specctl-eval run's results.json")
    parser.add_argument("--policy", default=None, help="the policy file evaluated")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="specctl-eval config overrides")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    out = diagnose(args.seed, results, args.policy, args.overrides)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

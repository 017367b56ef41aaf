"""Why run 73's "ppo r6" serving (the shipped file 5c3d9060, the MoE at 6 requests/s)
locked into depth 3 at batch >= 24: its telemetry replayed open loop through the daemon's
decision code (controller.decider.StreamDecider, one record at a time, as
swap16/replay_decisions.py), with the features' state read after every record (the numpy
backend, whose estimator state is readable; the compiled one computes the same).

Per serving and file it prints:

* ``off_folded``: every depth-0 decode record at batch >= 16, how it entered off's cost
  estimators (``whole``; ``dropped_before_prefill``: FeatureSpec.latency_drop_before_prefill;
  ``dropped_warmup``: drop_warmup_latency with warmup_flag; ``clipped_off``:
  latency_off_outlier_ratio; the general outlier clip at 3x the profile never bites
  here), its latency against the profile's off price, its flags;
* ``thirds_>=24``: over the first, middle and last third of the serving's decode steps at
  batch >= 24, the medians of off's predicted latency at batch 32 and 48 and of each of
  its terms (latency_model 3 = 2 with a profile: ``profile``, the profile's off price at
  the latest KV tokens, plus the ridge regression's residual terms for off: ``level``,
  ``slope`` (batch slope x b/64), ``kv_term`` (KV term x kv/1e5), each before
  latency_off_ceiling's cap where a variant sets it; the local correction is off in this
  file, latency_local_samples 0),
  off's forgotten sample count (the regression's weight of off data, against the ridge's
  0.5 per term), and the off probe's state (coverage near 32 / 48, the label of why it
  did or did not fire at the step's batch: swap16/replay_decisions._probe_label);
* ``trace``: the same every 40th decode step (how it went).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu22 \\
        python docs/results/gpu22/lockin_73.py > docs/results/gpu22/lockin_73.txt
"""

from __future__ import annotations

import json
import os
from collections import Counter

os.environ["SPECCTL_FEATURES"] = "numpy"  # before any builder: the readable backend

import numpy as np
import replay_decisions as rd
from lockin_eval import RUNS, VARIANTS, variant
from servings import OFFSWITCH, cut_servings
from servings_70_74 import FILES

from controller.decider import StreamDecider
from controller.policy_file import ExportedPolicy
from env.sim.cost_model import load_profile

AT = np.array([32, 48])
#: (run, serving, file label): the lock-in and two servings of the same file that went right.
CASES = [(73, "ppo r6", "ppo"), (73, "ppo r6", "old"), (73, "ppo r6", "ppo+warmup_flag"),
         (73, "ppo r6", "ppo+off_clip_1.25"), (73, "ppo r6", "ppo+off_ceiling_0.1"),
         (73, "ppo r6_2", "ppo+off_ceiling_0.1"), (71, "ppo r6_2", "ppo+off_ceiling_0.1"),
         (73, "ppo r6_2", "ppo"), (71, "ppo r6_2", "ppo")]


def off_terms(builder) -> dict:
    """Off's predicted latency (ms) at batch 32 and 48 and its terms (see the module)."""
    pred = 1e3 * builder.latency_predictions_s(AT)[:, 0]
    theta, kv = builder._theta, builder._kv_used_tokens
    _, (at0, slope) = builder._design(AT)
    return {"pred": pred, "profile": at0[0, 0] + slope[0, 0] * kv,
            "level": np.full(2, theta[0]), "slope": theta[1] * AT / 64.0,
            "kv_term": np.full(2, theta[5] * kv / 1e5)}


def how_entered(spec, rec, prior_ms: float) -> str:
    """How a depth-0 decode record entered off's cost estimators."""
    if spec.latency_drop_before_prefill and rec.before_prefill:
        return "dropped_before_prefill"
    if spec.drop_warmup_latency and spec.warmup_flag and rec.warmup:
        return "dropped_warmup"
    ms = 1e3 * rec.step_latency_s
    if spec.latency_off_outlier_ratio and ms > spec.latency_off_outlier_ratio * prior_ms:
        return "clipped_off"  # if the stream trusts the profile then (it did here)
    if spec.latency_outlier_ratio and ms > spec.latency_outlier_ratio * prior_ms:
        return "clipped"
    return "whole"


def run_case(steps, policy: ExportedPolicy, prior) -> dict:
    decider = StreamDecider(policy, [0, 1, 3, 5], cost_prior=prior)
    spec, probe = policy.feature_spec, policy.probe
    folded, high, trace = [], [], []
    n = 0
    for rec in steps:
        decider.decide(rec)
        if rec.prefill_tokens:
            continue
        n += 1
        builder = decider.builder
        batch = max(rec.batch_size, 1)
        if rec.steps_used == 0 and batch >= 16:
            prior_ms = 1e3 * prior.step_latency_s(batch, 0, rec.kv_used_tokens, 0,
                                                  draft_extend=False, speculative_path=False)
            folded.append({"n": n, "batch": batch, "kv": rec.kv_used_tokens,
                           "ms": round(1e3 * rec.step_latency_s, 1),
                           "profile_ms": round(prior_ms, 1), "warmup": rec.warmup,
                           "before_prefill": rec.before_prefill,
                           "entered": how_entered(spec, rec, prior_ms)})
        if batch < 24 and n % 40:
            continue
        terms = off_terms(builder)
        tracker = builder.probe_tracker
        forget = spec.latency_forgetting
        state = {"n": n, "batch": batch, "depth": rec.steps_used, "kv": rec.kv_used_tokens,
                 **{k: v.round(2).tolist() for k, v in terms.items()},
                 "off_samples": round(builder._depth_samples[0], 2),
                 "off_weight": round(float(builder._moments[0, 0]), 2),
                 "profile_error": round(builder.profile_log_error, 3),
                 "coverage_32_48": [round(tracker.off_coverage(int(b), forget), 2) for b in AT],
                 "probe": rd._probe_label(builder, probe, batch, prior)}
        if batch >= 24:
            high.append(state)
        if n % 40 == 0:
            trace.append(state)
    thirds = []
    for part in np.array_split(np.arange(len(high)), 3):
        sel = [high[i] for i in part]
        thirds.append({
            "steps": len(sel),
            **{f"{k}_32_48": np.median([s[k] for s in sel], axis=0).round(2).tolist()
               for k in ("pred", "profile", "level", "slope", "kv_term")},
            "off_samples": round(float(np.median([s["off_samples"] for s in sel])), 2),
            "coverage_32_48": np.median([s["coverage_32_48"] for s in sel], axis=0
                                        ).round(2).tolist(),
            "profile_error": round(float(np.median([s["profile_error"] for s in sel])), 3),
            "probe": dict(Counter(s["probe"] for s in sel).most_common())})
    return {"off_folded": folded, "thirds_>=24": thirds, "trace": trace}


def main() -> None:
    files = {"ppo": ExportedPolicy.load(FILES["ppo"]), "old": ExportedPolicy.load(FILES["old"])}
    for name in ("warmup_flag", "off_clip_1.25", "off_ceiling_0.1"):
        files[f"ppo+{name}"] = variant(files["ppo"], VARIANTS[name])
    for run in sorted({c[0] for c in CASES}):
        model, profile, tag, names = RUNS[run]
        prior = load_profile(profile)
        for name, steps in cut_servings(OFFSWITCH / f"{model}_trace_{tag}_run{run}.tar.gz",
                                        OFFSWITCH / f"{model}_controller_run{run}.log", names):
            for label in [c[2] for c in CASES if c[:2] == (run, name)]:
                out = run_case(steps, files[label], prior)
                head = {"run": run, "serving": name, "through": label}
                print(json.dumps({**head, "thirds_>=24": out["thirds_>=24"]}))
                print(json.dumps({**head, "off_folded_batch_16_plus": out["off_folded"]}))
                entered = Counter(f["entered"] for f in out["off_folded"])
                print(json.dumps({**head, "off_folded_summary": dict(entered)}))
                for state in out["trace"]:
                    print(json.dumps({**head, "trace": state}))
                print(flush=True)


if __name__ == "__main__":
    main()

"""``latency_outlier_relative`` replayed open loop through the daemon's decision code over
every ``ppo`` serving of runs 46-60 (the MoE @ 2.5 and the dense model @ 3.0), as
``docs/results/stall19/replay.py`` does: the shipped file, stall19's candidate (the clip
armed from the second step, ``policy_0f7e6c6c``) and this session's (the shipped file with
the relative rule, ``policy_6a931a92``); then gpu18's warm-up-aware retrain
(``policy_c1ec8046``) against it with the rule (``policy_5df277f3``).

Per serving: the decode steps whose replayed depth differs from the shipped file's (from
c1ec8046's in the second table), the off share, and at batch 8-23 and >= 24 the predicted
depth-3 ms against the measured (the median over the serving's steps in the band).
Then, per serving, the steps the relative rule clipped in the warm-up (record index,
depth, batch, measured ms, the profile's price).

    R=docs/results; PYTHONPATH=$PWD:$R/swap16:$R/drop_warmup:$R/gpu18:$R/gpu19 \\
        python docs/results/clip20/replay.py > docs/results/clip20/replay.txt
"""

from __future__ import annotations

import math
from pathlib import Path

import replay_decisions as rd
from band_prices import band_summary, policy_servings
from dense_band_prices import PROFILE, ppo_servings
from servings import RUNS

from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder
from env.sim.cost_model import load_profile

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
W1 = RESULTS / "stall19/policy_0f7e6c6c.npz"
RELATIVE = HERE / "policy_6a931a92.npz"
RETRAIN = RESULTS / "gpu18/policy_c1ec8046.npz"
RETRAIN_RELATIVE = HERE / "policy_5df277f3.npz"
BANDS = (("8-23", 8, 24), (">=24", 24, 10**9))


def servings():
    """``(run, serving, records, prior)`` of every ``ppo`` serving, MoE then dense."""
    for run in RUNS:
        for name, records, prior in policy_servings(run):
            if name.startswith("ppo"):
                yield run, name, records, prior
    dense_prior = load_profile(PROFILE)
    for run, name, records in ppo_servings():
        yield run, name, records, dense_prior


def clipped_steps(records, spec, prior) -> list[str]:
    """The decode steps the relative rule clipped in the warm-up (the numpy builder's
    summed entered log error grew less than the step's own log(measured / profile));
    for a spec that folds each record at once (``drop_warmup_latency`` off)."""
    builder = FeatureBuilder(spec, prior, backend="numpy")
    out = []
    for i, rec in enumerate(records):
        warm = sum(builder._depth_samples) < spec.latency_outlier_warmup
        before = builder._early_log_error
        builder.update(rec)
        if rec.prefill_tokens or rec.step_latency_s <= 0.0 or not warm:
            continue
        steps = min(max(rec.steps_used, 0), spec.max_depth)
        price = 1e3 * prior.step_latency_s(max(rec.batch_size, 1), steps,
                                           rec.kv_used_tokens, 0, draft_extend=steps > 0,
                                           speculative_path=steps > 0)
        measured = 1e3 * rec.step_latency_s
        if builder._early_log_error - before < math.log(measured / price) - 1e-9:
            out.append(f"record {i} (depth {steps}, batch {rec.batch_size}): "
                       f"{measured:.1f} ms, profile {price:.2f} ms, entered at "
                       f"{price * math.exp(builder._early_log_error - before):.2f} ms")
    return out


def row(run, name, rows_list, reference) -> str:
    """One table row: differing steps against ``reference``, off shares, band prices."""
    differing = [sum(x["replayed"] != y["replayed"] for x, y in zip(rows_list[reference], r,
                                                                    strict=True))
                 for r in rows_list]
    off = [sum(r["replayed"] == 0 for r in rows) / max(len(rows), 1) for rows in rows_list]
    cells = []
    for _, lo, hi in BANDS:
        sums = [band_summary(r, lo, hi) for r in rows_list]
        if not sums[0]:
            cells.append("-")
            continue
        cells.append(" / ".join(str(s["pred_ms_off_d3"][1]) for s in sums)
                     + f" / {sums[0]['meas_ms_off_d3'][1]}")
    diff = " / ".join(str(d) for i, d in enumerate(differing) if i != reference)
    if len(rows_list) == 3:  # and the relative rule's against the clip armed from step 2
        diff += " (rel vs w1: " + str(sum(x["replayed"] != y["replayed"] for x, y in zip(
            rows_list[1], rows_list[2], strict=True))) + ")"
    return (f"| {run} | {name} | {len(rows_list[0])} | {diff} | "
            + " / ".join(f"{o:.3f}" for o in off) + " | " + " | ".join(cells) + " |")


def main() -> None:
    files = [ExportedPolicy.load(p) for p in (rd.SHIPPED, W1, RELATIVE)]
    retrains = [ExportedPolicy.load(p) for p in (RETRAIN, RETRAIN_RELATIVE)]
    first, second, clips = [], [], []
    for run, name, records, prior in servings():
        first.append(row(run, name, [rd.replay(records, f, prior) for f in files], 0))
        second.append(row(run, name, [rd.replay(records, f, prior) for f in retrains], 0))
        steps = clipped_steps(records, files[2].feature_spec, prior)
        clips.append(f"* run {run} {name}: " + ("; ".join(steps) if steps else "none"))
    print("## The shipped file (shipped / w1 = policy_0f7e6c6c / rel = policy_6a931a92)\n")
    print("| run | serving | decode steps | differing from shipped (w1 / rel) | off share "
          "(shipped / w1 / rel) | depth-3 ms 8-23 (shipped / w1 / rel / measured) | "
          "depth-3 ms >= 24 |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(first))
    print("\n## gpu18's retrain (c1ec8046 / rel = policy_5df277f3)\n")
    print("| run | serving | decode steps | differing from c1ec8046 | off share "
          "(c1ec8046 / rel) | depth-3 ms 8-23 (c1ec8046 / rel / measured) | "
          "depth-3 ms >= 24 |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(second))
    print("\n## Steps the relative rule clipped (the shipped file's spec)\n")
    print("\n".join(clips))


if __name__ == "__main__":
    main()

"""Fit the load-aware profiles of docs/FIDELITY.md from recorded traces (no GPU needed).

    python scripts/h200/fit_load_profiles.py --out docs/results/h200/fidelity

Per model, two profiles (``env.sim.load_fit``: group medians of every decode and prefill step):

* ``<model>_nospec.yaml``: the server without speculation, fitted to the plain-decode and
  prefill steps of the plugin's off path under a constant steps-0 policy (the off trace of
  ``offswitch.py off``; off is within 0.5-3% of a server without speculation on the MoE and
  2-8% on the dense model, ``docs/OFFSWITCH.md``). The no-speculation server's own runs
  are never seen by the fit.
* ``<model>_spec.yaml``: the same steps plus the speculative steps of the record-mode
  explore trace, jointly: base terms, KV, prefill, verify and draft terms. The MoE's
  instead: the explore trace's decode steps and the first run of each recorded replay
  (``MOE_REPLAY_TRACES``), which identify its verify-mode KV cost.

Traces: ``docs/results/h200/offswitch/<model>_off_trace.tar.gz`` and the explore traces
(``docs/results/h200/trace-explore``; ``shared/measured/h200-sglang-0.5.15-offswitch/
results/moe_acc25_trace_explore.tar.gz``). Depth-0 steps of explore traces are SGLang's
own steps=0 (a verify forward), not a plain decode: ``env.sim.load_fit`` leaves out depth-0
steps next to speculative ones.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from env.sim.cost_model import CostProfile, FitReport, load_profile, save_profile
from env.sim.load_fit import (
    StepArrays,
    blank_template,
    fit_server_profile,
    fit_speculative_on_plain,
    load_points,
)

REPO = Path(__file__).resolve().parents[2]
#: The shared measurements (``../shared`` from the project root; ``--shared`` elsewhere).
SHARED = REPO.parent / "shared/measured/h200-sglang-0.5.15-offswitch/results"
#: What is fitted: ``env.sim.load_fit.fit_server_profile`` (``BASE_TERMS``, ``c_moe``,
#: ``SPEC_TERMS``). A plain decode step's KV cost, ``c_kv``, is not fitted jointly but set to
#: the slope of latency over cached tokens *within* one batch size of the fit's plain decode
#: steps (``env.sim.load_fit.within_batch_kv_slope``): dense 40 ns per token (run-1 off
#: trace; reading 128 KiB per token at 4.8 TB/s is 27 ns), MoE 35 ns in its one-batch off
#: trace and 34-36 ns in both runs of the token-100 replay (attention over the cache does
#: not depend on the expert routing). In a one-batch sweep every request holds about as
#: many cached tokens, so a joint fit puts that cost on c_request (the MoE's no-speculation
#: headline, 713-token prompts, came out 12% fast with c_kv 0).
MOE_ACTIVE_FRACTION = 8 / 128  # Qwen3-30B-A3B: top-8 of 128 experts
#: The MoE's shape (shared/measured/h200-sglang-0.5.15-offswitch/models_moe/target/config.json).
MOE_MODEL = {"name": "Qwen3-30B-A3B (shape), EAGLE-3 draft head (1 layer)", "params_b": 30.5,
             "layers": 48, "hidden": 2048, "attention_heads": 32, "kv_heads": 4,
             "head_dim": 128, "experts": 128, "experts_per_token": 8,
             "kv_bytes_per_token": 2 * 48 * 4 * 128 * 2}
#: The MoE replays recorded by ``offswitch.py sim`` (run 3): each trace holds two runs of
#: the 40 s headline on one server, one after the other. The fit takes the *first* run of
#: each and leaves the second held out (docs/FIDELITY.md):
#: acc 2.5: static_3 (fitted), then the shipped policy (held out; depth 3 throughout too);
#: acc 1.1: the shipped policy (fitted; off on 5,279 of 5,300 decode steps), then static_0
#: (held out). They are the only MoE traces whose requests hold thousands of cached tokens,
#: so the only ones that identify the verify-mode KV cost ``c_steps0_kv`` (in the 256-token
#: explore and off traces every request holds ~330, and the KV column moves with the
#: per-request ones), and they are in the routing regime of the replays (below).
MOE_REPLAY_TRACES = ("moe_acc2.5_trace.tar.gz", "moe_acc1.1_trace_run2.tar.gz")


def steps_of(path: Path, prefills_measured: bool = True) -> StepArrays:
    """The steps of a trace folder or a ``.tar.gz`` holding one."""
    return StepArrays.load(path, prefills_measured)


def first_run(item: str) -> tuple[StepArrays, str]:
    """``TRACE[:RUNS]``: the first of the RUNS runs (1: the whole trace) and its label."""
    path, _, runs = item.partition(":")
    label = Path(path).name + (" (first run)" if int(runs or 1) > 1 else "")
    return steps_of(Path(path)).phases(int(runs or 1))[0], label


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs/results/h200/fidelity"))
    parser.add_argument("--shared", default=str(SHARED))
    parser.add_argument("--moe-real-off", default=None,
                        help="the MoE off server's trace with real tokens (.tar.gz or folder): "
                             "also fit moe_real_{nospec,spec}.yaml to it")
    parser.add_argument("--moe-real-replay", nargs="*", default=[], metavar="TRACE[:RUNS]",
                        help="with --moe-real-off: real-token traces (a replay trace of RUNS "
                             "runs one after another) whose first run joins moe_real_spec's "
                             "fit: the off trace's verify steps all hold ~330 cached tokens "
                             "per request and cannot tell per-request from per-KV verify cost "
                             "(static depth 3 at long contexts does; run 6's closed loops, "
                             "load_cells.py, add depth 3 at short ones under load)")
    parser.add_argument("--dense-replay", nargs="*", default=[], metavar="TRACE[:RUNS]",
                        help="plugin traces of the dense server (off path and speculative "
                             "steps) whose first run joins dense_spec's fit")
    parser.add_argument("--held-out", nargs="*", default=[], metavar="TRACE[:RUNS]",
                        help="with --moe-real-off: real-token MoE traces the fit never saw "
                             "(a replay trace holding RUNS runs one after another): print "
                             "moe_real_spec's step-level error on each run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    offswitch = REPO / "docs/results/h200/offswitch"
    sources = {
        "dense": (offswitch / "dense_off_trace.tar.gz", REPO / "docs/results/h200/trace-explore",
                  load_profile("h200_llama31_8b_recorded"), 0.0),
        "moe": (offswitch / "moe_off_trace.tar.gz",
                Path(args.shared) / "moe_acc25_trace_explore.tar.gz",
                load_profile("h200_llama31_8b_recorded"), MOE_ACTIVE_FRACTION),
    }
    jobs = []  # (file stem, speculative, steps, plain-decode runs, template, files)
    for model, (off_path, explore_path, template, moe) in sources.items():
        off = steps_of(off_path)
        # The explore servers ran with the radix cache on: their prefill steps count
        # uncached tokens only, so only their decode steps are used.
        explore = steps_of(explore_path, prefills_measured=False)
        template = blank_template(template, moe)
        if moe:
            template = template.replace(model=MOE_MODEL)
        spec_runs, spec_files = [off, explore], [off_path.name, explore_path.name]
        # the runs whose depth-0 steps are plain decodes (an explore trace's are
        # SGLang's steps=0, a verify forward)
        spec_plain = [off]
        nospec_runs, nospec_files = [off], [off_path.name]
        if moe:
            # With random weights the MoE's step cost depends on the tokens routed:
            # plain decode steps at batch 44-48 took 7.0 ms in the replay and 16.9 ms
            # in the one-batch sweep of the off trace. One profile cannot hold both;
            # the speculative server's is fitted in the replays' regime (the off
            # trace's sweep steps left out), the no-speculation one in the sweep's.
            spec_plain = [steps_of(offswitch / name).phases(2)[0]
                          for name in MOE_REPLAY_TRACES]
            spec_runs = [explore, *spec_plain]
            spec_files = [explore_path.name] + [f"{name} (first run)"
                                                for name in MOE_REPLAY_TRACES]
            # The off trace's prefill steps are 10 groups of 256-6,016 tokens, several
            # of them first-use kernel compilation (256 tokens: 50 ms, 6,016: 25 ms).
            # The replays' prefills compute the loadgen's real prompt ids (only the
            # generated tokens are token 100), 26-8,192 tokens at 500+ steps: their
            # prefill steps join the fit, their decode steps do not.
            nospec_runs += [dataclasses.replace(run, decodes_measured=False)
                            for run in spec_plain]
            nospec_files += [f"{name} (first run, prefill steps)"
                             for name in MOE_REPLAY_TRACES]
        if model == "dense":
            for item in args.dense_replay:
                run, name = first_run(item)
                spec_runs.append(run)
                spec_plain.append(run)  # the plugin's steps 0 are plain decodes
                spec_files.append(name)
        jobs += [(f"{model}_nospec", False, nospec_runs, [off], template, nospec_files),
                 (f"{model}_spec", True, spec_runs, spec_plain, template, spec_files)]
    if args.moe_real_off:
        # Real tokens throughout (no simulated acceptance on the off server): every
        # step of its trace, the one-batch sweeps, the depth-3 and switching steps
        # and its replay under constant off, in one routing regime. The other real-token
        # servers (no speculation, simulated acceptance with real-draft-token) are
        # held out.
        path = Path(args.moe_real_off)
        off = steps_of(path)
        template = blank_template(sources["moe"][2], MOE_ACTIVE_FRACTION).replace(
            model=MOE_MODEL)
        spec_runs, spec_files = [off], [path.name]
        for item in args.moe_real_replay:
            run, name = first_run(item)
            spec_runs.append(run)
            spec_files.append(name)
        jobs += [("moe_real_nospec", False, [off], [off], template, [path.name])]
    fitted: dict[str, CostProfile] = {}
    for stem, speculative, steps, plain, template, files in jobs:
        profile, report = fit_server_profile(steps, template, speculative=speculative,
                                             plain_runs=plain)
        profile = profile.replace(
            name=f"h200_{stem}_load",
            description=f"{stem} on one H200 (SGLang 0.5.15.post1), "
                        f"{'EAGLE-3' if speculative else 'without speculation'}; "
                        "env.sim.load_fit on every decode and prefill step",
            # Only this fit's provenance: the template's describes another fit.
            provenance={"fit": profile.provenance["fit"],
                        "fitted_to": files,
                        "c_kv": "env.sim.load_fit.within_batch_kv_slope of the plain "
                                "decode steps of the fitted off / replay traces",
                        "method": "scripts/h200/fit_load_profiles.py (env.sim.load_fit)",
                        "server": "--disable-radix-cache --max-running-requests 48 "
                                  "(off and replay traces); explore trace: radix "
                                  "cache on, decode steps only"})
        save_profile(profile, out / f"{stem}.yaml")
        fitted[stem] = profile
        print(f"{stem}: {report.summary()}; c_kv {profile.c_kv * 1e9:.1f} ns "
              "(within-batch slope)")
        print("  " + ", ".join(f"{k}={v * 1e6:.3f}us" for k, v in
                               profile.coefficients.items() if k in report.free))
    if args.moe_real_off:
        # The speculative server = the server without speculation (its off path runs
        # that plain decode) + verify and draft terms fitted to the speculative steps.
        plain = fitted["moe_real_nospec"]
        profile, report, by_share = fit_speculative_on_plain(spec_runs, plain)
        profile = profile.replace(
            name="h200_moe_real_spec_load",
            description="moe_real_spec on one H200 (SGLang 0.5.15.post1), EAGLE-3: "
                        "moe_real_nospec's plain terms + verify and draft terms fitted to "
                        "the speculative decode steps (env.sim.load_fit."
                        "fit_speculative_on_plain)",
            provenance={"fit": profile.provenance["fit"], "fitted_to": spec_files,
                        "plain_terms": "moe_real_nospec.yaml (same fit run)",
                        "moe_draft_token_share": {f"{k:g}": round(v, 4)
                                                  for k, v in by_share.items()},
                        "method": "scripts/h200/fit_load_profiles.py (env.sim.load_fit)"})
        save_profile(profile, out / "moe_real_spec.yaml")
        print(f"moe_real_spec (on moe_real_nospec): {report.summary()}; median error by "
              "draft-token share: " + ", ".join(f"{k:g}: {v:.4f}" for k, v in by_share.items()))
        print("  " + ", ".join(f"{k}={getattr(profile, k) * 1e6:.3f}us" for k in report.free)
              + f", moe_draft_token_share={profile.moe_draft_token_share:g}")
    if args.held_out and not args.moe_real_off:
        parser.error("--held-out checks the moe_real_spec fit: give --moe-real-off too")
    for item in args.held_out:
        path, _, runs = item.partition(":")
        profile = load_profile(out / "moe_real_spec.yaml")
        for i, run in enumerate(steps_of(Path(path)).phases(int(runs or 1))):
            report = FitReport.evaluate(profile, load_points(run))
            print(f"held out {Path(path).name} run {i + 1}: {report.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

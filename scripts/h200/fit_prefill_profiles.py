"""Refit the prefill terms of the fidelity profiles on a long-prompt record (no GPU needed).

    python scripts/h200/fit_prefill_profiles.py \
        --trace dense=docs/results/h200/fidelity_record/fidelity_record_models_trace.tar.gz \
        --trace moe=docs/results/h200/fidelity_record/fidelity_record_models_moe_trace.tar.gz \
        docs/results/h200/fidelity/{dense_spec,dense_nospec,moe_real_spec,moe_real_nospec}.yaml

Runs after ``fit_load_profiles.py`` (which fits every term on traces of prompts of at most
1,024 tokens): each profile keeps its other coefficients and gets ``c_prefill_token`` and
``c_prefill_pair`` from its model's record traces (``env.sim.prefill_fit``; a model may
have several ``--trace``, fitted together), rewritten in place with the fit in its
provenance. A profile's model is the start of its file name.
``moe_spec.yaml`` is left as it is: it prices runs whose every token was id 100 (another
expert routing), and the record decoded real tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from env.sim.cost_model import load_profile, save_profile
from env.sim.load_fit import StepArrays
from env.sim.prefill_fit import fit_prefill_terms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", default=[], metavar="MODEL=TRACE",
                        help="a model's record trace (folder or .tar.gz); repeat for several")
    parser.add_argument("profiles", nargs="+", help="profile files, rewritten in place")
    args = parser.parse_args(argv)
    traces: dict[str, list[StepArrays]] = {}
    paths: dict[str, list[str]] = {}
    for item in args.trace:
        model, sep, path = item.partition("=")
        if not sep:
            parser.error(f"--trace {item!r}: expected MODEL=TRACE")
        traces.setdefault(model, []).append(StepArrays.load(path))
        paths.setdefault(model, []).append(path)
    for name in args.profiles:
        path = Path(name)
        model = path.stem.split("_")[0]
        if model not in traces:
            parser.error(f"{path}: no --trace {model}=... for its model")
        before = load_profile(path)
        profile, report = fit_prefill_terms(before, traces[model])
        # The profile's own fit stays its provenance; this one is added beside it.
        provenance = {**before.provenance, "prefill_fit": {
            "free": list(report.free),
            "trace": paths[model][0] if len(paths[model]) == 1 else paths[model],
            "points": len(report.points),
            "median_abs_rel_error": round(report.median_abs_error, 4)}}
        save_profile(profile.replace(provenance=provenance), path)
        print(f"{path}: c_prefill_token {profile.c_prefill_token * 1e6:.2f} us, "
              f"c_prefill_pair {profile.c_prefill_pair * 1e9:.2f} ns, "
              f"{len(report.points)} points, median |error| "
              f"{report.median_abs_error * 100:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fit the load generator's client model to one-batch runs whose traces the profile saw.

    python scripts/h200/fit_client.py --profile dense=docs/results/h200/fidelity/dense_nospec.yaml \
        --profile moe=docs/results/h200/fidelity/moe_nospec.yaml \
        --runs docs/results/h200/offswitch --files dense_off_run3.json moe_off.json \
        --out docs/results/h200/fidelity/client.yaml

``loadgen.one_batch`` starts C requests "at once"; how far apart they really reach the
server (``start_interval_s``) and the time each spends outside it (``client_overhead_s``)
decide how many prefill steps interleave with the first requests' decoding, hence their
TPOT. ``configs/workload/h200_measured.yaml`` fitted both to the first session's sweep
through the old cost profile. Here the start interval is chosen on a grid to minimise the
squared relative errors of throughput and mean TPOT of the given (fit-run) one-batch
cells, so the cells judged afterwards (``compare.py --client``) stay held out. Each cell is
simulated with its model's profile (``--profile`` as in ``compare.py``): one load generator
drives both models, so one client is fitted to both. The
overhead is kept from ``--base``: with one request per client it hardly changes a
one-batch run (rms error 0.058 at 0 ms, 0.062 at 15 ms on the dense off sweep), but it
sets the gap between a closed-loop client's requests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import profile_for, profile_names, simulate
from measured_runs import read_run_dir

from env.sim.cost_model import load_profile

#: Candidate start intervals (seconds).
INTERVALS = (0.0, 0.0005, 0.001, 0.002, 0.003, 0.0041)
REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", default=[],
                        help="MODEL[.SERVER|.TOKENS]=PATH_OR_NAME, as compare.py takes it")
    parser.add_argument("--runs", nargs="+", required=True)
    parser.add_argument("--files", nargs="+", required=True,
                        help="run files whose one-batch cells the client is fitted to")
    parser.add_argument("--base", default=str(REPO / "configs/workload/h200_measured.yaml"),
                        help="client config whose client_overhead_s is kept")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    overhead = float(OmegaConf.load(args.base).client_overhead_s)
    names = profile_names(args.profile, parser)
    profiles = {k: load_profile(v) for k, v in names.items()}
    cells = [c for run in args.runs for c in read_run_dir(run)[0]
             if c.workload == "one_batch" and c.source.split(":")[0] in args.files]
    if not cells:
        parser.error(f"no one-batch cell in {args.files} under {args.runs}")
    missing = sorted({c.model for c in cells if profile_for(c, profiles) is None})
    if missing:
        parser.error(f"no --profile for the model(s) {missing}")
    scores = {}
    for interval in INTERVALS:
        client = OmegaConf.create({"start_interval_s": interval, "client_overhead_s": overhead})
        error = 0.0
        for cell in cells:
            profile = profile_for(cell, profiles)
            sim = simulate(cell, profile, profile, client)
            error += (sim["throughput_tok_s"] / cell.throughput_tok_s - 1) ** 2
            error += (sim["mean_tpot_ms"] / cell.mean_tpot_ms - 1) ** 2
        scores[interval] = (error / (2 * len(cells))) ** 0.5
        print(f"start_interval {interval * 1e3:.1f} ms: rms error {scores[interval]:.3f}")
    interval = min(scores, key=scores.get)
    Path(args.out).write_text(yaml.safe_dump({
        "start_interval_s": interval, "client_overhead_s": overhead,
        "fitted_to": sorted({c.source.split(":")[0] for c in cells}),
        "profiles": names, "rms_relative_error": round(scores[interval], 4),
        "method": f"scripts/h200/fit_client.py: grid over the start interval; overhead "
                  f"from {Path(args.base).name}"}))
    print(f"chose start_interval {interval * 1e3:.1f} ms (overhead {overhead * 1e3:.0f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

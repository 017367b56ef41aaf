"""Recalibrate and rewrite the shipped profiles and the
``h200_measured`` workload preset."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from env.sim.calibration.blackwell import calibrate_blackwell_tp8
from env.sim.calibration.fitting import REPO_DIR, SIM_DIR
from env.sim.calibration.h100 import calibrate_h100
from env.sim.calibration.h200 import (
    H200_WORKLOAD_PRESET,
    calibrate_h200,
    calibrate_h200_recorded,
    calibrate_h200_sweep,
    default_measured_dir,
    recorded_trace_dir,
    write_h200_workload_preset,
)
from env.sim.calibration.h200_moe import (
    MOE_HELD_OUT_TRACE,
    MOE_REAL_TRACE,
    MOE_SPEC_TRACES,
    calibrate_h200_moe,
    held_out_error,
)
from env.sim.calibration.prefill_launch import H200_DENSE, H200_MOE, with_prefill_launch
from env.sim.cost_model import load_profile, save_profile


def main(argv: Sequence[str] | None = None) -> None:
    """Recalibrate and write the shipped profiles (``python -m env.sim.calibration``).

    The dense H200 profiles then get their off-path terms (:mod:`env.sim.off_cost`); the
    H100 profile is derived from the H200 fit before that. The MoE's
    (``h200_qwen3_30b_a3b``) is fitted to a real-token trace of its off server where the
    project holds one (:mod:`env.sim.calibration.h200_moe`).
    """
    from env.sim.off_cost import dense_h200_points, fit_off_path

    parser = argparse.ArgumentParser(prog="python -m env.sim.calibration",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SIM_DIR / "profiles")
    parser.add_argument(
        "--measured", type=Path, default=None, help="folder of the H200 step_latency_*.csv files"
    )
    parser.add_argument(
        "--configs", type=Path, default=REPO_DIR / "configs",
        help="config folder to write workload/h200_measured.yaml into",
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes for the simulations")
    args = parser.parse_args(argv)
    measured = args.measured or default_measured_dir()
    if measured.is_dir():
        h200, fit = calibrate_h200(measured)
        print(f"h200_llama31_8b (fit to {measured}):\n{fit}\n")
        # The sweep is simulated (and its errors recorded) with the profile as shipped,
        # off-path terms included: they move a little cost from prefill steps.
        shipped, sweep = calibrate_h200_sweep(fit_off_path(h200, dense_h200_points())[0],
                                              measured, args.workers)
        print(f"{sweep}\n")
        save_profile(with_prefill_launch(shipped, H200_DENSE), args.out / "h200_llama31_8b.yaml")
        write_h200_workload_preset(
            sweep.setup, args.configs / "workload" / f"{H200_WORKLOAD_PRESET}.yaml"
        )
    else:
        print(f"{measured} not found: keeping the shipped h200_llama31_8b profile")
        h200 = load_profile("h200_llama31_8b")
    recorded = recorded_trace_dir()
    if (recorded / "trace-explore").is_dir():
        profile, fit = calibrate_h200_recorded(recorded, h200)
        print(f"h200_llama31_8b_recorded (fit to {recorded}):\n{fit}\n")
        save_profile(with_prefill_launch(fit_off_path(profile, dense_h200_points())[0],
                                         H200_DENSE),
                     args.out / "h200_llama31_8b_recorded.yaml")
    if MOE_REAL_TRACE.exists() and all(path.exists() for path, _ in MOE_SPEC_TRACES):
        # server limits, model and acceptance from the shipped file; every cost refitted
        profile, fit = calibrate_h200_moe(MOE_REAL_TRACE, load_profile("h200_qwen3_30b_a3b"),
                                          MOE_SPEC_TRACES)
        print(f"h200_qwen3_30b_a3b (plain terms fit to {MOE_REAL_TRACE}, verify terms on "
              f"top): {fit.summary()}")
        if MOE_HELD_OUT_TRACE.exists():
            print(f"  held out {MOE_HELD_OUT_TRACE.name}: "
                  f"{held_out_error(profile).summary()}")
        print()
        save_profile(with_prefill_launch(profile, H200_MOE),
                     args.out / "h200_qwen3_30b_a3b.yaml")
    else:
        print(f"{MOE_REAL_TRACE} not found: keeping the shipped h200_qwen3_30b_a3b profile")
    for name, calibrate in (
        ("h100_llama31_8b", lambda: calibrate_h100(h200, args.workers)),
        ("blackwell_tp8", lambda: calibrate_blackwell_tp8(args.workers)),
    ):
        profile, report = calibrate()
        print(f"{name}:\n{report}")
        for key in ("c_fixed", "c_request", "c_verify", "c_verify_token"):
            print(f"  {key} = {getattr(profile, key) * 1e3:.4f} ms")
        print()
        save_profile(profile, args.out / f"{name}.yaml")


if __name__ == "__main__":
    main()

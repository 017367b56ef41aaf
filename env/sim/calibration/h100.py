"""The ``h100_llama31_8b`` profile: the EAGLE-3 paper's Tables 3 and 4 (SGLang, H100, LLaMA-3.1-8B,
MT-bench, chain of 3), matched end to end in the simulator, costs transferred from the H200 fit."""

from __future__ import annotations

import numpy as np

from env.sim.acceptance import ParametricAcceptance
from env.sim.calibration.fitting import (
    BenchSetup,
    CalibrationReport,
    ThroughputTarget,
    bench_command,
    fit_in_simulator,
    simulate_cells,
    with_calibration,
)
from env.sim.calibration.h200 import LLAMA31_8B_KV_BYTES
from env.sim.cost_model import CostProfile, ServerLimits, load_profile

H100_TABLE3_BATCH = (2, 4, 8, 16, 24, 32, 48, 56, 64)
H100_TABLE3_EAGLE3_SPEEDUP = (1.81, 1.82, 1.62, 1.48, 1.39, 1.32, 1.38, 1.34, 1.38)
H100_TABLE4_NO_SPEC_BS1_TOK_S = 158.34
H100_PROMPT_TOKENS = 256
H100_OUTPUT_TOKENS = 384
#: EAGLE-3 chain acceptance assumed for LLaMA-3.1-8B on MT-bench, temperature 0.
H100_ACCEPT_LENGTH_AT_3 = 2.9
H100_ACCEPT_DECAY = 0.98
#: How Tables 3 and 4 are reproduced: C closed-loop clients (C = the batch size)
#: for 120 simulated seconds, the baseline a server without a draft model.
H100_BENCH = BenchSetup(
    prompt_tokens=H100_PROMPT_TOKENS,
    output_tokens=H100_OUTPUT_TOKENS,
    horizon_s=120.0,
    skip_zero_step_draft_extend=True,
)


def h100_acceptance() -> ParametricAcceptance:
    """The acceptance assumed for the H100 calibration (and the profile's default)."""
    return ParametricAcceptance.calibrated(
        H100_ACCEPT_LENGTH_AT_3, depth=3, max_depth=7, decay=H100_ACCEPT_DECAY
    )


def h100_template(h200: CostProfile) -> CostProfile:
    """Priors and limits of the H100 profile, before the fits (costs transferred from ``h200``)."""
    acceptance = h100_acceptance()
    kv_bytes_per_s = 3.35e12 * (4.0 / 4.8)  # same achievable fraction as the H200 prior
    return CostProfile(
        name="h100_llama31_8b",
        description=(
            "SGLang v0.4.4, one H100, LLaMA-3.1-8B-Instruct with EAGLE-3 (chain), "
            "calibrated to the EAGLE-3 paper's end-to-end throughputs."
        ),
        server=ServerLimits(
            max_running_requests=64,
            kv_capacity_tokens=int((0.8 * 80e9 - 16e9) // LLAMA31_8B_KV_BYTES),
            chunked_prefill_tokens=8192,
            cuda_graph_max_bs=64,
        ),
        c_request=h200.c_request,
        c_token=h200.c_token,
        c_prefill_token=h200.c_prefill_token,  # same GH100 compute (989 bf16 TFLOP/s)
        c_kv=LLAMA31_8B_KV_BYTES / kv_bytes_per_s,
        c_draft=h200.c_draft,
        c_draft_token=h200.c_draft_token,
        c_extend=h200.c_extend,
        c_extend_token=h200.c_extend_token,
        model=dict(h200.model, name="LLaMA-3.1-8B-Instruct, EAGLE-3 draft head (1 layer)"),
        hardware={"gpu": "NVIDIA H100 80GB (SXM)", "count": 1, "hbm_gb": 80, "hbm_tb_s": 3.35},
        acceptance=acceptance.to_config()
        | {
            "assumption": (
                f"EAGLE-3 chain acceptance on MT-bench (temperature 0): accept length "
                f"{H100_ACCEPT_LENGTH_AT_3} at depth 3 (alpha about 0.8 per position, decay "
                f"{H100_ACCEPT_DECAY}); Table 1's tau = 6.13 is for the tree and out of reach "
                "of a chain of 3 (at most 4)"
            )
        },
    )


def calibrate_h100(h200: CostProfile | None = None,
                   workers: int = 1) -> tuple[CostProfile, CalibrationReport]:
    """Calibrate the H100 profile to EAGLE-3 Tables 3 and 4, through the simulator.

    Stage 1 (no speculation): ``c_fixed`` so that one client gets Table 4's
    158.34 tok/s; per-request and per-token costs transferred from the H200
    measurement (same GH100 compute die; the per-request cost is SGLang's CPU
    work). The baseline at every Table 3 batch size is then simulated.
    Stage 2 (EAGLE-3, chain of 3): draft-model costs transferred from the H200
    measurement; the verify-path overhead ``c_verify`` + ``c_verify_token *
    batch`` fitted so that static depth 3 over the simulated baseline gives
    Table 3's speedups (SGLang v0.4.4 did not overlap scheduling with
    speculation, so a large per-request overhead is expected). The fit is
    minimax: the requirement is per batch size.

    Table 3 cannot be matched everywhere within 5%: with per-step costs linear
    in the batch, the speedup ``A (x0 + x1 b) / (y0 + y1 b)`` is monotone in
    ``b`` with a knee set by the no-speculation costs ``x0 / x1`` (fixed here by
    Table 4 and the H200 transfer), while the table stays flat from 2 to 4,
    drops 11% from 4 to 8, and dips at 32 between 1.39 and 1.38. The minimax
    fit spreads the remaining error evenly over batches 4, 32 and 64 (see the
    profile's provenance).
    """
    h200 = h200 if h200 is not None else load_profile("h200_llama31_8b")
    setup = H100_BENCH
    accept = {3: h100_acceptance().expected_accept_length_at(3)}
    template = h100_template(h200)
    base_targets = [
        ThroughputTarget(
            "Table 4, no speculation, batch 1", 1, 0, False, H100_TABLE4_NO_SPEC_BS1_TOK_S
        )
    ]
    stage1, base = fit_in_simulator(template, base_targets, setup, accept, ("c_fixed",),
                                    workers=workers)
    baseline = simulate_cells(stage1, setup, [(b, 0) for b in H100_TABLE3_BATCH], workers)
    spec_targets = [
        ThroughputTarget(f"Table 3, EAGLE-3 x{speedup} at batch {b}", b, 3, True,
                         speedup * float(tok_s))
        for b, speedup, tok_s in zip(H100_TABLE3_BATCH, H100_TABLE3_EAGLE3_SPEEDUP, baseline,
                                     strict=True)
    ]
    stage2, spec = fit_in_simulator(stage1, spec_targets, setup, accept,
                                    ("c_verify", "c_verify_token"), minimax=True,
                                    workers=workers)
    p, o = setup.prompt_tokens, setup.output_tokens
    assumptions = [
        f"end to end through the simulator: C closed-loop clients (C = Table 3's batch size), "
        f"prompt {p} and output {o} tokens per request (MT-bench-like), all starting at "
        f"t = 0, {setup.horizon_s:g} simulated seconds per cell, seed {setup.seed}; "
        "EAGLE-3 = static depth 3; no speculation = steps 0 without the draft extend "
        "(sim.skip_zero_step_draft_extend=true, a server without a draft model)",
        "Table 3 speedup at batch b = simulated static_3 / simulated no_spec at C = b",
        f"acceptance: ParametricAcceptance.calibrated({H100_ACCEPT_LENGTH_AT_3}, depth=3, "
        f"decay={H100_ACCEPT_DECAY}) -> {accept[3]:.4f} tokens per step at depth 3; it "
        "scales every speedup alike, so it cannot change their shape over the batch",
        "c_request, c_token, c_draft, c_draft_token, c_extend, c_extend_token transferred from "
        "h200_llama31_8b (same GH100 die, same SGLang draft path)",
        "c_kv: 128 KiB/token over 3.35 TB/s * 0.83 achievable",
        "baseline throughput at batch > 1 is not published: it follows from the transferred "
        "per-request cost; only the speedup ratios are matched there",
        "max_running_requests = 64 (Table 3's largest batch, set explicitly: SGLang would "
        "otherwise cap speculative servers at 48); KV capacity (0.8 * 80 GB - 16 GB) / 128 KiB",
        "remaining gap: with step costs linear in the batch the speedup "
        "A (x0 + x1 b) / (y0 + y1 b) is monotone in the batch b, its knee set by the "
        "no-speculation costs x0 / x1 (Table 4 and the H200 transfer); Table 3 is flat from "
        "batch 2 to 4, falls 11% from 4 to 8 and dips at 32, so the minimax fit leaves "
        f"{np.abs(spec.rel_errors).max() * 100:.1f}% at worst. Within 5% everywhere would "
        "take a no-speculation per-request cost about 1.5 times the measured one (and a "
        "baseline about 20% slower at batch 64), which no measurement supports: rejected",
    ]
    report = CalibrationReport(assumptions=assumptions)
    report.add(base)
    report.add(spec)
    profile = with_calibration(
        stage2,
        report,
        {
            "calibrated_to": "EAGLE-3 paper (arXiv 2503.01840) Table 3 (EAGLE-3 chain-3 "
            "speedups, SGLang v0.4.4, H100) and Table 4 (158.34 tok/s without speculation, "
            "batch 1)",
            "method": "env.sim.calibration.h100.calibrate_h100: steady-state fit corrected by the "
            "simulator (env.sim.calibration.fitting.fit_in_simulator), minimax on the speedups",
            "prompt_tokens": p,
            "output_tokens": o,
            "bench_setup": setup.describe(),
            "bench_command": bench_command(
                "h100_llama31_8b", setup, ["no_spec", "static_3"], [1, *H100_TABLE3_BATCH]
            ),
        },
    )
    return profile, report

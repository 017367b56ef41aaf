"""How the shipped cost profiles were calibrated; re-run to regenerate them.

``python -m env.calibration --out env/profiles`` rewrites the three YAML files
(the H200 fit needs the measured data under ``shared/measured/``; without it
the shipped H200 profile is kept and the other two are derived from it).

Three calibrations:

* :func:`calibrate_h200`: step latencies measured on SGLang 0.5.15 / H200
  (Llama-3.1-8B shape), fitted point by point (:func:`env.cost_model.fit_profile`).
* :func:`calibrate_h100`: EAGLE-3 paper, Tables 3 and 4 (SGLang, H100,
  LLaMA-3.1-8B, MT-bench, chain of 3): end-to-end throughputs.
* :func:`calibrate_blackwell_tp8`: PUBLISHED.md section 1 (a Kimi-K2.5-class
  MoE, TP=8 on 8x RTX PRO 6000 Blackwell): end-to-end throughputs.

End-to-end numbers are matched with a steady-state approximation of a
closed-loop benchmark (:func:`steady_state`), explicit so the simulator can be
checked against it:

* ``batch = min(C, max_running_requests)`` requests decode together;
* every request is prefilled alone, in chunks of ``chunked_prefill_tokens``,
  one step per chunk, not mixed with decoding; the prefill emits its first token;
* each decode step commits ``accept_length`` tokens per request on average
  (1 without speculation), so a request takes ``(O - 1) / accept_length``
  decode steps;
* the KV cache a decode step reads is ``batch * (P + O / 2)`` (each request
  half-way through its output on average);
* throughput = ``batch * O / (decode_steps * decode_latency + batch * prefill_latency)``.

Seconds per output token are linear in the coefficients, so each calibration
is a non-negative least-squares fit of a few free coefficients (the others are
physical priors, or transferred from the H200 measurement), in two stages:
first the server without speculation, then the speculative one.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from env.acceptance import ParametricAcceptance, SGLangSimulatedAcceptance
from env.cost_model import (
    COEFFICIENTS,
    DEFAULT_TIES,
    CostProfile,
    FitReport,
    LatencyPoints,
    ServerLimits,
    design_matrix,
    fit_coefficients,
    fit_profile,
    load_profile,
    save_profile,
)

# ---------------------------------------------------------------------------
# The steady-state approximation
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SteadyState:
    """Steady state of a closed-loop benchmark (see the module docstring)."""

    batch: int
    decode_step_s: float
    prefill_s: float
    decode_steps_per_request: float
    throughput_tok_s: float


def _prefill_chunks(prompt_tokens: int, chunk: int) -> list[int]:
    full, rest = divmod(prompt_tokens, chunk)
    return [chunk] * full + ([rest] if rest else [])


def steady_state(
    profile: CostProfile,
    concurrency: int,
    depth: int,
    accept_length: float,
    prompt_tokens: int,
    output_tokens: int,
    *,
    speculative: bool,
) -> SteadyState:
    """Throughput of ``concurrency`` closed-loop clients at a fixed ``depth``.

    Args:
        profile: The cost profile.
        concurrency: Clients C, each with one request in flight.
        depth: Draft depth of every decode step (0 = none).
        accept_length: Tokens committed per decode step and request (1 + accepted drafts).
        prompt_tokens, output_tokens: P and O of every request.
        speculative: Whether the server runs a draft model (its extend runs at depth 0).
    """
    design = _steady_state_row(
        profile, concurrency, depth, accept_length, prompt_tokens, output_tokens, speculative
    )
    batch = min(concurrency, profile.server.max_running_requests)
    kv = batch * (prompt_tokens + output_tokens / 2.0)
    decode = profile.step_latency_s(batch, depth, kv, 0, speculative)
    prefill = sum(
        profile.step_latency_s(0, 0, done + c, c, speculative)
        for done, c in _chunk_progress(prompt_tokens, profile.server.chunked_prefill_tokens)
    )
    seconds_per_token = float(design @ np.array([getattr(profile, n) for n in COEFFICIENTS]))
    return SteadyState(
        batch=batch,
        decode_step_s=decode,
        prefill_s=prefill,
        decode_steps_per_request=(output_tokens - 1) / accept_length,
        throughput_tok_s=1.0 / seconds_per_token,
    )


def _chunk_progress(prompt_tokens: int, chunk: int) -> list[tuple[int, int]]:
    out, done = [], 0
    for c in _prefill_chunks(prompt_tokens, chunk):
        out.append((done, c))
        done += c
    return out


def _steady_state_row(
    profile: CostProfile,
    concurrency: int,
    depth: int,
    accept_length: float,
    prompt_tokens: int,
    output_tokens: int,
    speculative: bool,
) -> np.ndarray:
    """Seconds per output token as a row of the design (linear in the coefficients)."""
    if concurrency < 1 or output_tokens < 1 or prompt_tokens < 1 or accept_length < 1:
        raise ValueError("concurrency, lengths and accept_length must be >= 1")
    batch = min(concurrency, profile.server.max_running_requests)
    kv = batch * (prompt_tokens + output_tokens / 2.0)
    kw = {
        "moe_active_fraction": profile.moe_active_fraction,
        "cuda_graph_max_bs": profile.server.cuda_graph_max_bs,
    }
    decode = design_matrix(batch, depth, kv, 0, speculative, **kw)[0]
    chunks = _chunk_progress(prompt_tokens, profile.server.chunked_prefill_tokens)
    prefill = sum(design_matrix(0, 0, done + c, c, speculative, **kw)[0] for done, c in chunks)
    steps = (output_tokens - 1) / accept_length
    return (steps * decode + batch * prefill) / (batch * output_tokens)


@dataclass(frozen=True)
class ThroughputTarget:
    """A published end-to-end number to match."""

    label: str
    concurrency: int
    depth: int
    speculative: bool
    throughput_tok_s: float


@dataclass
class CalibrationReport:
    """Targets against the steady-state predictions of the calibrated profile."""

    rows: list[dict] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def worst_abs_error(self) -> float:
        """Largest |relative error| over the targets."""
        return max((abs(r["rel_error"]) for r in self.rows), default=0.0)

    def __str__(self) -> str:
        lines = [
            f"{'target':<34} {'C':>4} {'d':>2} {'target tok/s':>12} {'model tok/s':>11} "
            f"{'error':>7}"
        ]
        for r in self.rows:
            lines.append(
                f"{r['label']:<34} {r['concurrency']:>4} {r['depth']:>2} "
                f"{r['target_tok_s']:12.2f} {r['model_tok_s']:11.2f} {r['rel_error'] * 100:+6.2f}%"
            )
        lines.append(f"worst |error| {self.worst_abs_error * 100:.2f}%")
        return "\n".join(lines)


def _fit_targets(
    template: CostProfile,
    targets: Sequence[ThroughputTarget],
    accept_length: dict[int, float],
    prompt_tokens: int,
    output_tokens: int,
    free: Sequence[str],
    ties: dict[str, tuple[str, float]],
) -> CostProfile:
    rows = np.stack(
        [
            _steady_state_row(
                template,
                t.concurrency,
                t.depth,
                accept_length.get(t.depth, 1.0),
                prompt_tokens,
                output_tokens,
                t.speculative,
            )
            for t in targets
        ]
    )
    seconds_per_token = np.array([1.0 / t.throughput_tok_s for t in targets])
    values = fit_coefficients(rows, seconds_per_token, template=template, free=free, ties=ties)
    return template.replace(**values)


def _report(
    profile: CostProfile,
    targets: Sequence[ThroughputTarget],
    accept_length: dict[int, float],
    prompt_tokens: int,
    output_tokens: int,
    assumptions: list[str],
) -> CalibrationReport:
    report = CalibrationReport(assumptions=list(assumptions))
    for t in targets:
        model = steady_state(
            profile,
            t.concurrency,
            t.depth,
            accept_length.get(t.depth, 1.0),
            prompt_tokens,
            output_tokens,
            speculative=t.speculative,
        ).throughput_tok_s
        report.rows.append(
            {
                "label": t.label,
                "concurrency": t.concurrency,
                "depth": t.depth,
                "speculative": t.speculative,
                "target_tok_s": round(t.throughput_tok_s, 3),
                "model_tok_s": round(model, 3),
                "rel_error": round(model / t.throughput_tok_s - 1.0, 5),
            }
        )
    return report


def _with_calibration(profile: CostProfile, report: CalibrationReport, extra: dict) -> CostProfile:
    provenance = dict(profile.provenance)
    provenance.update(extra)
    provenance["assumptions"] = report.assumptions
    provenance["targets"] = report.rows
    provenance["worst_abs_rel_error"] = round(report.worst_abs_error, 5)
    return profile.replace(provenance=provenance)


# ---------------------------------------------------------------------------
# H200, measured
# ---------------------------------------------------------------------------

#: Measured files and the ``max_new_tokens`` of their requests.
H200_FILES = {
    "step_latency_dummy_acceptance.csv": 160,
    "step_latency_simulated_acc3.5.csv": 128,
}
H200_PROMPT_TOKENS = 256
#: Llama-3.1-8B KV bytes per token: 32 layers * 8 KV heads * 128 dim * (K, V) * 2 B.
LLAMA31_8B_KV_BYTES = 32 * 8 * 128 * 2 * 2
H200_FREE = ("c_fixed", "c_request", "c_token", "c_verify", "c_draft", "c_draft_token")


def default_measured_dir() -> Path:
    """``shared/measured/h200-sglang-0.5.15`` beside the repository checkout."""
    return Path(__file__).resolve().parents[2] / "shared" / "measured" / "h200-sglang-0.5.15"


def read_h200_points(measured_dir: str | Path | None = None) -> LatencyPoints:
    """Median step periods of the measured CSVs as fit points.

    KV tokens per point = ``batch * (256 + max_new_tokens / 2)``: prompts of 256
    tokens, each request on average half-way through its output (160 or 128
    new tokens). The period includes CPU scheduling (overlap on), and steps=0
    still ran the draft extend (``draft_extend`` True everywhere).
    """
    folder = Path(measured_dir) if measured_dir is not None else default_measured_dir()
    batch, depth, kv, latency = [], [], [], []
    needed = ("batch_size", "steps", "step_ms_median")
    for name, max_new in H200_FILES.items():
        path = folder / name
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in needed if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: line 1: missing column {missing[0]!r}")
            for lineno, row in enumerate(reader, start=2):
                try:
                    b = int(row["batch_size"])
                    d = int(row["steps"])
                    ms = float(row["step_ms_median"])
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{path}: line {lineno}: {exc}") from None
                if b < 1 or d < 0 or not ms > 0:
                    raise ValueError(f"{path}: line {lineno}: bad values {row}")
                batch.append(b)
                depth.append(d)
                kv.append(b * (H200_PROMPT_TOKENS + max_new / 2))
                latency.append(ms / 1e3)
    return LatencyPoints(
        batch_size=np.array(batch),
        depth=np.array(depth),
        kv_tokens=np.array(kv),
        prefill_tokens=np.zeros(len(batch)),
        latency_s=np.array(latency),
    )


def h200_template() -> CostProfile:
    """Priors and limits of the H200 profile, before the fit."""
    hbm_bytes = 141e9
    weights_bytes = 16e9
    kv_capacity = int((0.8 * hbm_bytes - weights_bytes) // LLAMA31_8B_KV_BYTES)
    return CostProfile(
        name="h200_llama31_8b",
        description=(
            "SGLang 0.5.15, one H200, Llama-3.1-8B shape (bf16) with an EAGLE-3 head, "
            "triton attention, overlap scheduling; fitted to measured step periods."
        ),
        server=ServerLimits(
            max_running_requests=256,
            kv_capacity_tokens=kv_capacity,
            chunked_prefill_tokens=8192,
            cuda_graph_max_bs=64,
        ),
        # Attention reads each KV token once per step; not identifiable from the
        # measured points (KV grows with the batch), so a physical prior:
        # 128 KiB per token over ~4 TB/s achievable HBM bandwidth.
        c_kv=LLAMA31_8B_KV_BYTES / 4.0e12,
        model={
            "name": "Llama-3.1-8B (shape), EAGLE-3 draft head (1 layer)",
            "params_b": 8.03,
            "dtype": "bfloat16",
            "layers": 32,
            "hidden": 4096,
            "kv_heads": 8,
            "head_dim": 128,
            "kv_bytes_per_token": LLAMA31_8B_KV_BYTES,
            "weights_gb": 16.0,
        },
        hardware={"gpu": "NVIDIA H200", "count": 1, "hbm_gb": 141, "hbm_tb_s": 4.8},
        acceptance=SGLangSimulatedAcceptance(3.5).to_config()
        | {"note": "the measured run's SGLANG_SIMULATE_ACC_LEN=3.5 (match-expected)"},
        provenance={
            "calibrated_to": "shared/measured/h200-sglang-0.5.15/step_latency_*.csv (medians)",
            "method": "env.calibration.calibrate_h200: NNLS on relative errors",
            "assumptions": [
                "kv_tokens = batch * (256 prompt + max_new_tokens/2): 160 new tokens in the "
                "dummy run, 128 in the simulated run",
                "step latency = the scheduler's median step period (includes CPU scheduling)",
                "steps=0 points ran the draft extend (SGLang default)",
                "c_kv fixed at the physical prior (128 KiB/token over 4 TB/s)",
                "ties: c_extend = c_draft, c_extend_token = 0.05 * c_token",
                "kv_capacity_tokens = (0.8 * 141 GB - 16 GB weights) / 128 KiB",
                "max_running_requests = 256 is an assumption (not measured); batches above "
                "48 and above cuda_graph_max_bs = 64 are extrapolated (c_eager = 0, unmeasured)",
            ],
        },
    )


def calibrate_h200(measured_dir: str | Path | None = None) -> tuple[CostProfile, FitReport]:
    """Fit the H200 profile to the measured medians; returns the profile and fit report."""
    points = read_h200_points(measured_dir)
    return fit_profile(points, template=h200_template(), free=H200_FREE, ties=DEFAULT_TIES)


# ---------------------------------------------------------------------------
# H100, EAGLE-3 paper
# ---------------------------------------------------------------------------

H100_TABLE3_BATCH = (2, 4, 8, 16, 24, 32, 48, 56, 64)
H100_TABLE3_EAGLE3_SPEEDUP = (1.81, 1.82, 1.62, 1.48, 1.39, 1.32, 1.38, 1.34, 1.38)
H100_TABLE4_NO_SPEC_BS1_TOK_S = 158.34
H100_PROMPT_TOKENS = 256
H100_OUTPUT_TOKENS = 384
#: EAGLE-3 chain acceptance assumed for LLaMA-3.1-8B on MT-bench, temperature 0.
H100_ACCEPT_LENGTH_AT_3 = 2.9
H100_ACCEPT_DECAY = 0.98


def h100_acceptance() -> ParametricAcceptance:
    """The acceptance assumed for the H100 calibration (and the profile's default)."""
    return ParametricAcceptance.calibrated(
        H100_ACCEPT_LENGTH_AT_3, depth=3, max_depth=7, decay=H100_ACCEPT_DECAY
    )


def calibrate_h100(h200: CostProfile | None = None) -> tuple[CostProfile, CalibrationReport]:
    """Calibrate the H100 profile to EAGLE-3 Tables 3 and 4.

    Stage 1 (no speculation): ``c_fixed`` from Table 4 (158.34 tok/s at batch 1);
    per-request and per-token costs transferred from the H200 measurement
    (same GH100 compute die; the per-request cost is SGLang's CPU work).
    Stage 2 (EAGLE-3, chain of 3): draft-model costs transferred from the H200
    measurement; the verify-path overhead ``c_verify`` + ``c_verify_token *
    batch`` fitted to the Table 3 speedups (SGLang v0.4.4 did not overlap
    scheduling with speculation, so a large per-request overhead is expected).
    """
    h200 = h200 if h200 is not None else load_profile("h200_llama31_8b")
    acceptance = h100_acceptance()
    accept = {3: acceptance.expected_accept_length_at(3)}
    p, o = H100_PROMPT_TOKENS, H100_OUTPUT_TOKENS
    kv_bytes_per_s = 3.35e12 * (4.0 / 4.8)  # same achievable fraction as the H200 prior
    template = CostProfile(
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
    base_targets = [
        ThroughputTarget(
            "Table 4, no speculation, batch 1", 1, 0, False, H100_TABLE4_NO_SPEC_BS1_TOK_S
        )
    ]
    stage1 = _fit_targets(template, base_targets, accept, p, o, ("c_fixed",), {})
    spec_targets = []
    for b, speedup in zip(H100_TABLE3_BATCH, H100_TABLE3_EAGLE3_SPEEDUP, strict=True):
        base = steady_state(stage1, b, 0, 1.0, p, o, speculative=False).throughput_tok_s
        spec_targets.append(
            ThroughputTarget(
                f"Table 3, EAGLE-3 x{speedup} at batch {b}", b, 3, True, speedup * base
            )
        )
    stage2 = _fit_targets(stage1, spec_targets, accept, p, o, ("c_verify", "c_verify_token"), {})
    assumptions = [
        f"steady-state closed loop (env.calibration.steady_state), prompt {p} and output {o} "
        "tokens per request (MT-bench-like), batch = Table 3's batch size",
        f"acceptance: ParametricAcceptance.calibrated({H100_ACCEPT_LENGTH_AT_3}, depth=3, "
        f"decay={H100_ACCEPT_DECAY}) -> {accept[3]:.4f} tokens per step at depth 3",
        "c_request, c_token, c_draft, c_draft_token, c_extend, c_extend_token transferred from "
        "h200_llama31_8b (same GH100 die, same SGLang draft path)",
        "c_kv: 128 KiB/token over 3.35 TB/s * 0.83 achievable",
        "no-speculation baseline = depth 0 without draft extend",
        "baseline throughput at batch > 1 is not published: it follows from the transferred "
        "per-request cost; only the speedup ratios are matched there",
        "max_running_requests = 64 (Table 3's largest batch); KV capacity (0.8 * 80 GB - 16 GB) "
        "/ 128 KiB",
    ]
    report = _report(stage2, [*base_targets, *spec_targets], accept, p, o, assumptions)
    profile = _with_calibration(
        stage2,
        report,
        {
            "calibrated_to": "EAGLE-3 paper (arXiv 2503.01840) Table 3 (EAGLE-3 chain-3 "
            "speedups, SGLang v0.4.4, H100) and Table 4 (158.34 tok/s without speculation, "
            "batch 1)",
            "method": "env.calibration.calibrate_h100: steady-state closed-loop "
            "approximation, NNLS on seconds per output token",
            "prompt_tokens": p,
            "output_tokens": o,
        },
    )
    return profile, report


# ---------------------------------------------------------------------------
# Blackwell TP8, large MoE
# ---------------------------------------------------------------------------

BLACKWELL_CONCURRENCY = (1, 70, 250)
BLACKWELL_NO_SPEC_TOK_S = (92.6, 784.2, 772.1)
BLACKWELL_EAGLE3_TOK_S = (77.5, 337.7, 340.9)
BLACKWELL_DEPTH = 3
BLACKWELL_PROMPT_TOKENS = 512
BLACKWELL_OUTPUT_TOKENS = 512
BLACKWELL_ACCEPT_LENGTH_AT_3 = 2.5
BLACKWELL_ACCEPT_DECAY = 0.95
#: Kimi-K2-class shape: 61 layers (60 MoE), hidden 7168, 384 routed experts of
#: intermediate 2048, 8 per token; MLA latent KV of 512 + 64 per layer.
KIMI_MOE_LAYERS = 60
KIMI_EXPERTS = 384
KIMI_EXPERTS_PER_TOKEN = 8
KIMI_ROUTED_PARAMS = KIMI_MOE_LAYERS * KIMI_EXPERTS * 3 * 7168 * 2048
KIMI_KV_BYTES = 61 * (512 + 64) * 2
RTX_PRO_6000_TB_S = 1.792
RTX_PRO_6000_GB = 96


def blackwell_acceptance() -> ParametricAcceptance:
    """The acceptance assumed for the Blackwell calibration (and the profile's default)."""
    return ParametricAcceptance.calibrated(
        BLACKWELL_ACCEPT_LENGTH_AT_3,
        depth=BLACKWELL_DEPTH,
        max_depth=7,
        decay=BLACKWELL_ACCEPT_DECAY,
    )


def calibrate_blackwell_tp8() -> tuple[CostProfile, CalibrationReport]:
    """Calibrate the Blackwell TP8 MoE profile to PUBLISHED.md section 1.

    Physical priors: ``c_moe`` (all routed experts read once, INT4, over the
    8 GPUs' bandwidth), ``c_kv`` (MLA latent cache, replicated per rank),
    ``c_token`` (compute plus PCIe all-reduce volume per token), draft-model
    costs (one layer plus LM head). Stage 1 fits ``c_fixed`` and ``c_request``
    to the no-speculation numbers; stage 2 fits the verify-path overhead
    ``c_verify`` + ``c_verify_token * batch`` to the EAGLE-3 numbers.
    """
    acceptance = blackwell_acceptance()
    accept = {BLACKWELL_DEPTH: acceptance.expected_accept_length_at(BLACKWELL_DEPTH)}
    p, o = BLACKWELL_PROMPT_TOKENS, BLACKWELL_OUTPUT_TOKENS
    gpus = 8
    achievable = 0.8
    aggregate_bw = gpus * RTX_PRO_6000_TB_S * 1e12 * achievable
    expert_bytes = KIMI_ROUTED_PARAMS * 0.5 * 1.03  # INT4 weights + group scales
    weights_per_gpu = 595e9 / gpus
    kv_capacity = int((0.85 * RTX_PRO_6000_GB * 1e9 - weights_per_gpu) // KIMI_KV_BYTES)
    # Per target token: 64 GFLOP over ~0.8 PFLOP/s effective (8 GPUs, bf16 MoE GEMMs
    # from INT4 weights) = 80 us, plus 2 all-reduces per layer of 7168 bf16 values
    # over PCIe (~25 GB/s bus bandwidth, ring factor 2*7/8) = 122 * 1.0 us.
    c_token = 64e9 / 0.8e15 + 122 * (2 * 7 / 8 * 7168 * 2) / 25e9
    # Draft forward: one dense layer + LM head (163840 x 7168, bf16) read over the
    # aggregate bandwidth, 3 all-reduces and launches: ~0.7 ms; per token ~5 us.
    template = CostProfile(
        name="blackwell_tp8",
        description=(
            "SGLang, Kimi-K2.5-class 1T-parameter MoE (384 experts, top-8, ~32B active, "
            "INT4 experts), TP=8 on 8x RTX PRO 6000 Blackwell (PCIe), EAGLE-3 depth 3; "
            "calibrated to published end-to-end throughputs."
        ),
        server=ServerLimits(
            max_running_requests=64,
            kv_capacity_tokens=kv_capacity,
            chunked_prefill_tokens=8192,
            cuda_graph_max_bs=64,
        ),
        moe_active_fraction=KIMI_EXPERTS_PER_TOKEN / KIMI_EXPERTS,
        c_moe=expert_bytes / aggregate_bw,
        c_kv=KIMI_KV_BYTES / (RTX_PRO_6000_TB_S * 1e12 * achievable),
        c_token=c_token,
        c_draft=0.7e-3,
        c_draft_token=5e-6,
        c_extend=0.7e-3,
        c_extend_token=5e-6,
        model={
            "name": "Kimi-K2.5-class MoE (shape of Kimi K2), EAGLE-3 draft head",
            "params_b": 1000,
            "active_params_b": 32,
            "layers": 61,
            "moe_layers": KIMI_MOE_LAYERS,
            "experts": KIMI_EXPERTS,
            "experts_per_token": KIMI_EXPERTS_PER_TOKEN,
            "expert_dtype": "int4",
            "kv": "MLA latent 512 + rope 64 per layer, bf16",
            "kv_bytes_per_token": KIMI_KV_BYTES,
            "weights_gb": 595,
        },
        hardware={
            "gpu": "NVIDIA RTX PRO 6000 Blackwell (SM120)",
            "count": gpus,
            "interconnect": "PCIe (no NVLink)",
            "memory_gb_per_gpu": RTX_PRO_6000_GB,
            "memory_tb_s_per_gpu": RTX_PRO_6000_TB_S,
        },
        acceptance=acceptance.to_config()
        | {
            "assumption": (
                f"accept length {BLACKWELL_ACCEPT_LENGTH_AT_3} at depth 3 (decay "
                f"{BLACKWELL_ACCEPT_DECAY}); not measured for this system"
            )
        },
    )
    base_targets = [
        ThroughputTarget(f"no speculation, C={c}", c, 0, False, t)
        for c, t in zip(BLACKWELL_CONCURRENCY, BLACKWELL_NO_SPEC_TOK_S, strict=True)
    ]
    spec_targets = [
        ThroughputTarget(f"EAGLE-3 depth 3, C={c}", c, BLACKWELL_DEPTH, True, t)
        for c, t in zip(BLACKWELL_CONCURRENCY, BLACKWELL_EAGLE3_TOK_S, strict=True)
    ]
    stage1 = _fit_targets(template, base_targets, accept, p, o, ("c_fixed", "c_request"), {})
    stage2 = _fit_targets(stage1, spec_targets, accept, p, o, ("c_verify", "c_verify_token"), {})
    assumptions = [
        f"steady-state closed loop (env.calibration.steady_state), prompt {p} and output {o} "
        "tokens per request",
        "max_running_requests = 64: the flat throughput from C=70 to C=250 (both modes) says "
        "the running batch is capped below 70; 64 x (512 + 512) tokens fits the KV capacity",
        f"kv_capacity_tokens = (0.85 * 96 GB - 595 GB / 8 weights) / {KIMI_KV_BYTES} B "
        "(MLA latent cache replicated on every TP rank)",
        f"acceptance: ParametricAcceptance.calibrated({BLACKWELL_ACCEPT_LENGTH_AT_3}, depth=3, "
        f"decay={BLACKWELL_ACCEPT_DECAY}) -> {accept[BLACKWELL_DEPTH]:.4f} tokens per step",
        "c_moe: 60 layers x 384 experts x 3 x 7168 x 2048 INT4 params over 8 x 1.79 TB/s x 0.8",
        "c_token: 64 GFLOP/token over 0.8 PFLOP/s + PCIe all-reduce volume (2 per layer, "
        "25 GB/s bus bandwidth)",
        "c_kv: 70 KB/token (MLA) over 1.79 TB/s x 0.8 per rank",
        "draft forward 0.7 ms + 5 us/token (one layer + LM head, TP8), extend the same",
        "the EAGLE-3 numbers imply a very expensive verify path at load (several ms per "
        "request and step); no hardware term explains it, so it is fitted as the verify "
        "overhead c_verify + c_verify_token * batch (likely software: no CUDA graph for "
        "verify, fallback kernels on SM120)",
    ]
    report = _report(stage2, [*base_targets, *spec_targets], accept, p, o, assumptions)
    profile = _with_calibration(
        stage2,
        report,
        {
            "calibrated_to": "shared/anchors/PUBLISHED.md section 1 (no speculation 92.6 / "
            "784.2 / 772.1 tok/s and EAGLE-3 77.5 / 337.7 / 340.9 tok/s at C = 1 / 70 / 250)",
            "method": "env.calibration.calibrate_blackwell_tp8: steady-state closed-loop "
            "approximation, NNLS on seconds per output token",
            "prompt_tokens": p,
            "output_tokens": o,
        },
    )
    return profile, report


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """Recalibrate and write the shipped profiles (``python -m env.calibration``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "profiles")
    parser.add_argument(
        "--measured", type=Path, default=None, help="folder of the H200 step_latency_*.csv files"
    )
    args = parser.parse_args(argv)
    measured = args.measured or default_measured_dir()
    if measured.is_dir():
        h200, fit = calibrate_h200(measured)
        print(f"h200_llama31_8b (fit to {measured}):\n{fit}\n")
        save_profile(h200, args.out / "h200_llama31_8b.yaml")
    else:
        print(f"{measured} not found: keeping the shipped h200_llama31_8b profile")
        h200 = load_profile("h200_llama31_8b")
    for name, (profile, report) in {
        "h100_llama31_8b": calibrate_h100(h200),
        "blackwell_tp8": calibrate_blackwell_tp8(),
    }.items():
        print(f"{name}:\n{report}\n")
        for key in ("c_fixed", "c_request", "c_verify", "c_verify_token"):
            print(f"  {key} = {getattr(profile, key) * 1e3:.4f} ms")
        save_profile(profile, args.out / f"{name}.yaml")


if __name__ == "__main__":
    main()

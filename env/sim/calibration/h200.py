"""The H200 profiles: ``h200_llama31_8b`` fitted point by point to the step latencies measured
on SGLang 0.5.15 (then the measured sweep's load generator, :func:`calibrate_h200_sweep`), and
``h200_llama31_8b_recorded`` fitted to the traces the specctl plugin recorded on the real server."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.calibration.fitting import (
    REPO_DIR,
    SIM_DIR,
    BenchSetup,
    ThroughputTarget,
    bench_command,
    simulate_cells,
)
from env.sim.cost_model import (
    DEFAULT_TIES,
    CostProfile,
    FitReport,
    LatencyPoints,
    ServerLimits,
    fit_profile,
    fit_profile_from_trace,
)
from env.traces.trace_format import read_trace

#: Measured files and the ``max_new_tokens`` of their requests.
H200_FILES = {
    "step_latency_dummy_acceptance.csv": 160,
    "step_latency_simulated_acc3.5.csv": 128,
}
H200_PROMPT_TOKENS = 256
#: Llama-3.1-8B KV bytes per token: 32 layers * 8 KV heads * 128 dim * (K, V) * 2 B.
LLAMA31_8B_KV_BYTES = 32 * 8 * 128 * 2 * 2
H200_FREE = ("c_fixed", "c_request", "c_token", "c_verify", "c_draft", "c_draft_token")
#: SGLang's ``--max-running-requests`` when EAGLE-family speculation is on and the
#: flag is not given (``server_args``: "Max running requests is reset to 48 for
#: speculative decoding"). The measured server did not give it, and the data show
#: the cap: the step-latency CSVs have no batch-64 step although C = 64 was run,
#: and the simulated run has twice the steps=0 samples at batches 48 and 16 (254)
#: as at 32 (127): C = 64 decoded as 48, then the remaining 16.
SGLANG_SPEC_DEFAULT_MAX_RUNNING_REQUESTS = 48


def default_measured_dir() -> Path:
    """The H200 measurements, shipped in ``env/sim/data/measured/h200-sglang-0.5.15`` (a copy of
    the project's ``shared/measured/`` folder, so that an installed package can refit)."""
    return SIM_DIR / "data" / "measured" / "h200-sglang-0.5.15"


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


#: Prompt compute per token beyond ``c_token`` on an H200 (and an H100: the same GH100
#: compute) for the 8B model: the median over the 378 prefill steps of >= 1000 tokens in
#: the trace the specctl plugin recorded on a real H200 server
#: (docs/results/h200/trace-main), after the decode-fitted terms. Decode steps are
#: memory-bound and cannot show it; the step-latency CSVs have no prefill steps.
H200_PREFILL_TOKEN_S = 13.3e-6


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
            max_running_requests=SGLANG_SPEC_DEFAULT_MAX_RUNNING_REQUESTS,
            kv_capacity_tokens=kv_capacity,
            chunked_prefill_tokens=8192,
            cuda_graph_max_bs=64,
        ),
        # Attention reads each KV token once per step; not identifiable from the
        # measured points (KV grows with the batch), so a physical prior:
        # 128 KiB per token over ~4 TB/s achievable HBM bandwidth.
        c_kv=LLAMA31_8B_KV_BYTES / 4.0e12,
        c_prefill_token=H200_PREFILL_TOKEN_S,
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
            "method": "env.sim.calibration.h200.calibrate_h200: NNLS on relative errors",
            "assumptions": [
                "kv_tokens = batch * (256 prompt + max_new_tokens/2): 160 new tokens in the "
                "dummy run, 128 in the simulated run",
                "step latency = the scheduler's median step period (includes CPU scheduling)",
                "steps=0 points ran the draft extend (SGLang default)",
                "c_kv fixed at the physical prior (128 KiB/token over 4 TB/s)",
                "ties: c_extend = c_draft, c_extend_token = 0.05 * c_token",
                "kv_capacity_tokens = (0.8 * 141 GB - 16 GB weights) / 128 KiB",
                "max_running_requests = 48: SGLang's default under EAGLE speculation (the "
                "measured server did not set --max-running-requests); the CSVs show it: no "
                "batch-64 steps although C = 64 was run, and doubled samples at batches 48 "
                "and 16 (C = 64 decoded as 48 + 16). Set sim.max_running_requests for a "
                "server that raises it; batches above 48 are extrapolated (cuda_graph_max_bs "
                "= 64, c_eager = 0, unmeasured)",
            ],
        },
    )


def calibrate_h200(measured_dir: str | Path | None = None) -> tuple[CostProfile, FitReport]:
    """Fit the H200 profile to the measured medians; returns the profile and fit report."""
    points = read_h200_points(measured_dir)
    return fit_profile(points, template=h200_template(), free=H200_FREE, ties=DEFAULT_TIES)


# -- the measured sweep: how its load generator ran --------------------------------

H200_SWEEP_FILE = "sweep_simulated_acc3.5.jsonl"
#: ``max_new_tokens`` of the sweep's requests (every cell is one batch of C of them).
H200_SWEEP_OUTPUT_TOKENS = 128
#: Client start intervals tried: a coarse grid, then one of
#: ``H200_START_INTERVAL_RESOLUTION_S`` around the best; the per-request
#: overhead is solved for each interval (bisection) and rounded.
H200_START_INTERVAL_GRID_S = tuple(np.round(np.arange(0.0, 0.01201, 0.0005), 6))
H200_START_INTERVAL_RESOLUTION_S = 1e-4
H200_OVERHEAD_RESOLUTION_S = 1e-3
H200_OVERHEAD_MAX_S = 0.1
#: Where :func:`main` writes the sweep's workload preset (``workload=h200_measured``).
H200_WORKLOAD_PRESET = "h200_measured"


def read_h200_sweep(measured_dir: str | Path | None = None) -> list[ThroughputTarget]:
    """The measured end-to-end sweep as targets, one per (concurrency, steps) cell.

    Each line holds ``concurrency``, ``steps``, ``tokens`` (C x 128: one batch
    of C requests) and ``tok_s``. The server ran SGLang's default mode, so
    steps=0 still ran the draft extend (``speculative`` True everywhere).
    """
    folder = Path(measured_dir) if measured_dir is not None else default_measured_dir()
    path = folder / H200_SWEEP_FILE
    targets = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                c, d = int(row["concurrency"]), int(row["steps"])
                tokens, tok_s = int(row["tokens"]), float(row["tok_s"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: line {lineno}: {exc!r}") from None
            if c < 1 or d < 0 or not tok_s > 0 or tokens != c * H200_SWEEP_OUTPUT_TOKENS:
                raise ValueError(f"{path}: line {lineno}: unexpected cell {row}")
            targets.append(ThroughputTarget(f"C={c} steps={d}", c, d, True, tok_s))
    if not targets:
        raise ValueError(f"{path}: no cells")
    return targets


def h200_sweep_setup(start_interval_s: float = 0.0, client_overhead_s: float = 0.0) -> BenchSetup:
    """The sweep's cells as bench settings: one request per client, run to the end."""
    return BenchSetup(
        prompt_tokens=H200_PROMPT_TOKENS,
        output_tokens=H200_SWEEP_OUTPUT_TOKENS,
        horizon_s=None,
        skip_zero_step_draft_extend=False,
        requests_per_client=1,
        start_interval_s=start_interval_s,
        client_overhead_s=client_overhead_s,
    )


@dataclass(frozen=True)
class SweepFit:
    """The measured sweep against the simulator with the fitted load generator."""

    setup: BenchSetup
    targets: tuple[ThroughputTarget, ...]
    simulated_tok_s: np.ndarray

    @property
    def rel_errors(self) -> np.ndarray:
        """``simulated / measured - 1`` per cell."""
        return self.simulated_tok_s / np.array([t.throughput_tok_s for t in self.targets]) - 1

    def errors_by_concurrency(self) -> dict[int, list[float]]:
        """Relative errors (rounded), per concurrency, in increasing steps."""
        table: dict[int, list[tuple[int, float]]] = {}
        for t, e in zip(self.targets, self.rel_errors, strict=True):
            table.setdefault(t.concurrency, []).append((t.depth, round(float(e), 5) + 0.0))
        return {c: [e for _, e in sorted(cells)] for c, cells in sorted(table.items())}

    def __str__(self) -> str:
        steps = sorted({t.depth for t in self.targets})
        lines = ["sweep: simulated vs measured tok/s, by concurrency (rows) and steps",
                 f"{'C':>4} " + " ".join(f"{f'steps={d}':>9}" for d in steps)]
        for c, errors in self.errors_by_concurrency().items():
            lines.append(f"{c:>4} " + " ".join(f"{e * 100:+8.1f}%" for e in errors))
        worst = float(np.abs(self.rel_errors).max())
        lines.append(f"start interval {self.setup.start_interval_s * 1e3:.1f} ms, client "
                     f"overhead {self.setup.client_overhead_s * 1e3:.0f} ms; worst |error| "
                     f"{worst * 100:.2f}%")
        return "\n".join(lines)


def _best_overhead(elapsed_s: np.ndarray, measured_s: np.ndarray) -> tuple[float, float]:
    """The per-request overhead ``o`` in ``[0, H200_OVERHEAD_MAX_S]`` minimising the largest
    |error| of ``measured / (elapsed + o) - 1`` (throughput ratio); returns ``(o, error)``.

    With one request per client, an overhead shifts every arrival, so a cell's
    simulated time is exactly ``elapsed + o``. Every error falls as ``o`` grows,
    so ``max + min`` of the errors does too: bisect for where it crosses zero.
    """
    def errors(o: float) -> np.ndarray:
        return measured_s / (elapsed_s + o) - 1.0

    lo, hi = 0.0, H200_OVERHEAD_MAX_S
    if errors(lo).max() + errors(lo).min() <= 0:
        hi = lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        e = errors(mid)
        if e.max() + e.min() > 0:
            lo = mid
        else:
            hi = mid
    o = 0.5 * (lo + hi)
    return o, float(np.abs(errors(o)).max())


def fit_h200_sweep(profile: CostProfile, targets: Sequence[ThroughputTarget],
                   workers: int = 1) -> SweepFit:
    """Fit the sweep's load generator (client start interval, per-request overhead).

    The cost profile is not touched: it stays fitted to the step latencies.
    What the client saw beyond the server's steps is the ramp (clients started
    one after another) and a fixed time per request outside the server (HTTP,
    request and response handling). Both are fitted minimax over every cell,
    the requirement being per cell.
    """
    targets = tuple(targets)
    cells = [(t.concurrency, t.depth) for t in targets]
    tokens = np.array([c * H200_SWEEP_OUTPUT_TOKENS for c, _ in cells], dtype=float)
    measured_s = tokens / np.array([t.throughput_tok_s for t in targets])

    def score(interval: float) -> tuple[float, float]:
        simulated = simulate_cells(profile, h200_sweep_setup(interval), cells, workers)
        overhead, error = _best_overhead(tokens / simulated, measured_s)
        return error, overhead

    scores = {float(si): score(float(si)) for si in H200_START_INTERVAL_GRID_S}
    coarse = min(scores, key=lambda si: scores[si][0])
    step = H200_START_INTERVAL_RESOLUTION_S
    for k in range(-4, 5):
        si = round(coarse + k * step, 6)
        if si >= 0 and si not in scores:
            scores[si] = score(si)
    interval = min(scores, key=lambda si: scores[si][0])
    overhead = round(scores[interval][1] / H200_OVERHEAD_RESOLUTION_S) * H200_OVERHEAD_RESOLUTION_S
    setup = h200_sweep_setup(interval, round(overhead, 6))
    return SweepFit(setup, targets, simulate_cells(profile, setup, cells, workers))


def calibrate_h200_sweep(profile: CostProfile, measured_dir: str | Path | None = None,
                         workers: int = 1) -> tuple[CostProfile, SweepFit]:
    """Fit the measured sweep's load generator and record it in the profile's provenance."""
    fit = fit_h200_sweep(profile, read_h200_sweep(measured_dir), workers)
    steps = sorted({t.depth for t in fit.targets})
    concurrency = sorted({t.concurrency for t in fit.targets})
    provenance = dict(profile.provenance)
    provenance["sweep"] = {
        "calibrated_to": f"shared/measured/h200-sglang-0.5.15/{H200_SWEEP_FILE} (tok_s)",
        "method": "env.sim.calibration.h200.fit_h200_sweep: the cost coefficients stay fitted to "
        "the step latencies; the load generator's client start interval and fixed per-request "
        "overhead are fitted, minimax over every cell, by simulating each cell as "
        "specctl-bench does",
        "assumptions": [
            f"each cell: one batch of C clients, one request each (prompt "
            f"{H200_PROMPT_TOKENS}, {H200_SWEEP_OUTPUT_TOKENS} output tokens), static steps, "
            "run until every request finished; throughput = tokens / time from the first "
            "client's start to the last request's end, as the client measured it",
            "the server ran SGLang's default mode: steps=0 still runs the draft extend",
            "acceptance: the profile's SGLANG_SIMULATE_ACC_LEN=3.5 model",
            f"client i starts at i * start_interval_s; every request spends client_overhead_s "
            f"outside the server (a constant, fitted to {H200_OVERHEAD_RESOLUTION_S * 1e3:g} ms)",
            f"max_running_requests = {SGLANG_SPEC_DEFAULT_MAX_RUNNING_REQUESTS}: C = 64 runs "
            "as a wave of 48 and one of 16, which is why it is slower than C = 48 without "
            "speculation",
        ],
        "setup": fit.setup.describe(),
        "workload_preset": f"configs/workload/{H200_WORKLOAD_PRESET}.yaml",
        "bench_command": bench_command(
            profile.name, fit.setup, [f"static_{d}" if d else "no_spec" for d in steps],
            concurrency, workload_preset=H200_WORKLOAD_PRESET,
        ),
        "steps": steps,
        "rel_errors_by_concurrency": fit.errors_by_concurrency(),
        "worst_abs_rel_error": round(float(np.abs(fit.rel_errors).max()), 5),
    }
    return profile.replace(provenance=provenance), fit


def write_h200_workload_preset(setup: BenchSetup, path: str | Path) -> Path:
    """Write ``configs/workload/h200_measured.yaml``: the sweep's request shape and ramp."""
    path = Path(path)
    text = "\n".join([
        "# The load generator of the measured H200 sweep (shared/measured/h200-sglang-0.5.15/",
        "# sweep_*.jsonl): C clients started one after another, one request each, prompts of",
        f"# {setup.prompt_tokens} tokens, {setup.output_tokens} output tokens, a fixed "
        "per-request time outside the server.",
        "# Written by `python -m env.sim.calibration` (start interval and overhead fitted to the",
        "# sweep through the simulator; see provenance.sweep in",
        "# env/sim/profiles/h200_llama31_8b.yaml).",
        "# Use with horizon_s=null requests_per_client=1.",
        "name: fixed",
        "path: null",
        f"prompt_tokens: {setup.prompt_tokens}",
        f"output_tokens: {setup.output_tokens}",
        "max_output_tokens: null",
        f"start_interval_s: {setup.start_interval_s!r}",
        f"client_overhead_s: {setup.client_overhead_s!r}",
        "",
    ])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def recorded_trace_dir() -> Path:
    """Where the traces recorded on the real H200 are kept (docs/results/h200)."""
    return REPO_DIR / "docs" / "results" / "h200"


def calibrate_h200_recorded(folder: Path, template: CostProfile) -> tuple[CostProfile, FitReport]:
    """The H200 profile fitted to the traces the specctl plugin recorded on the real server.

    Decode costs: the record-mode trace that explored every candidate depth
    (``trace-explore``), one point per (batch size, depth) cell. Prompt compute:
    the prefill steps of the controller session's trace (``trace-main``).
    """
    explore = read_trace(folder / "trace-explore")
    profile, report = fit_profile_from_trace(explore, template)
    session = read_trace(folder / "trace-main")
    prefill = fit_profile_from_trace(session, template)[0].c_prefill_token
    profile = profile.replace(
        name="h200_llama31_8b_recorded",
        c_prefill_token=prefill,
        description=(
            "SGLang 0.5.15.post1, one H200, Llama-3.1-8B shape with an EAGLE-3 head (random "
            "weights, SGLANG_SIMULATE_ACC_LEN=3.5); fitted to traces the specctl plugin "
            "recorded on the real server."
        ),
        provenance={
            "calibrated_to": (
                "docs/results/h200/trace-explore (record mode, SPECCTL_RECORD_EXPLORE=1, dwell 4, "
                "candidate steps 0,1,2,3,5,7, closed loops C = 1, 8, 32, 48)"),
            "prefill_from": "docs/results/h200/trace-main (prefill steps >= 1000 tokens)",
            "method": "env.sim.calibration.h200.calibrate_h200_recorded: NNLS on the median "
                      "latency of each (batch size, depth) cell with >= 5 decode steps",
            "fit": report.summary(),
            "template": f"{template.name} (server limits, descriptors, c_kv prior)",
        },
    )
    return profile, report

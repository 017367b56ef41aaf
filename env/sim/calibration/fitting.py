"""What the calibrations share: bench cells simulated as ``specctl-bench`` runs them, and the fit.

End-to-end numbers are matched through the simulator itself: every target is
a ``specctl-bench`` cell (:class:`BenchSetup`), simulated exactly as the bench
runs it (:func:`simulate_throughput`). The fit (:func:`fit_in_simulator`)
starts from a steady-state approximation of a closed-loop benchmark
(:func:`steady_state`), which is linear in the coefficients:

* ``batch = min(C, max_running_requests)`` requests decode together;
* every request is prefilled alone, in chunks of ``chunked_prefill_tokens``,
  one step per chunk, not mixed with decoding; the prefill emits its first token;
* each decode step commits ``accept_length`` tokens per request on average
  (1 without speculation), so a request takes ``(O - 1) / accept_length``
  decode steps;
* the KV cache a decode step reads is ``batch * (P + O / 2)`` (each request
  half-way through its output on average);
* throughput = ``batch * O / (decode_steps * decode_latency + batch * prefill_latency)``.

What it misses (clients that finish together share one batched prefill, the
ramp, the horizon cut, the spread of acceptance) is measured per cell as
``simulated / steady-state``; the steady state is refitted to the targets
divided by that correction, and the cells simulated again, until the
correction settles (:data:`SIM_TOLERANCE`). Each round is a
non-negative least-squares (or minimax) fit of a few free coefficients (the
others are physical priors, or transferred from the H200 measurement), in two
stages: first the server without speculation, then the speculative one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from env.factory import make_acceptance, make_closed_loop, make_scheduler_config
from env.features import FeatureSpec, Observation
from env.rollout import DecisionLoop, rollout
from env.sim.cost_model import COEFFICIENTS, CostProfile, design_matrix, fit_coefficients
from env.sim.simulator import Simulator

#: ``env/sim``: the shipped profiles and calibration data (a filesystem path: main() writes there).
SIM_DIR = Path(__file__).resolve().parents[1]
#: The checkout (or site-packages folder) holding ``env/`` and ``configs/``.
REPO_DIR = SIM_DIR.parents[1]

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
    decode = profile.step_latency_s(batch, depth, kv, 0, speculative, speculative)
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
        "moe_draft_token_share": profile.moe_draft_token_share,
    }
    decode = design_matrix(batch, depth, kv, 0, speculative, speculative, **kw)[0]
    chunks = _chunk_progress(prompt_tokens, profile.server.chunked_prefill_tokens)
    prefill = sum(design_matrix(0, 0, done + c, c, speculative, **kw)[0] for done, c in chunks)
    steps = (output_tokens - 1) / accept_length
    return (steps * decode + batch * prefill) / (batch * output_tokens)


@dataclass(frozen=True)
class ThroughputTarget:
    """A published (or measured) end-to-end number to match.

    ``speculative`` says whether the server runs a draft model at all: a server
    without one (the published "no speculation" baselines) pays no draft extend
    at depth 0; one with a draft model (SGLang's default) does.
    """

    label: str
    concurrency: int
    depth: int
    speculative: bool
    throughput_tok_s: float


# ---------------------------------------------------------------------------
# The simulator in the loop
# ---------------------------------------------------------------------------

#: Most fit-then-simulate rounds of :func:`fit_in_simulator`. The per-cell ratio
#: simulated / steady-state depends little on the coefficients, so each round
#: cuts the remaining error about tenfold; the last round's simulation is the
#: one reported.
SIM_ITERATIONS = 6
#: :func:`fit_in_simulator` stops once no per-cell correction moved by more than
#: this (relative) in a round: the last fit then used the correction its own
#: simulation confirms, so simulated and target agree to about this much.
SIM_TOLERANCE = 5e-5
#: Re-weighting rounds of the minimax (Lawson) fit.
LAWSON_ROUNDS = 40


@dataclass(frozen=True)
class BenchSetup:
    """How an end-to-end number is reproduced with ``specctl-bench`` (closed loop, fixed lengths).

    Each cell is a static policy at one concurrency, run exactly as
    :func:`agents.bench.run_cell` runs it; the defaults are those of
    ``configs/bench.yaml``.

    Attributes:
        prompt_tokens, output_tokens: Request shape (``workload=fixed``).
        horizon_s: Simulated seconds per cell; None = until every request finished.
        skip_zero_step_draft_extend: ``sim.skip_zero_step_draft_extend``; True for
            comparisons against a server without a draft model.
        requests_per_client: None = clients keep sending until the horizon.
        start_interval_s: Client i starts at ``i * start_interval_s``.
        client_overhead_s: Per-request time outside the server.
        seed, feedback_lag, max_depth: As in ``configs/bench.yaml``.
    """

    prompt_tokens: int
    output_tokens: int
    horizon_s: float | None
    skip_zero_step_draft_extend: bool
    requests_per_client: int | None = None
    start_interval_s: float = 0.0
    client_overhead_s: float = 0.0
    seed: int = 0
    feedback_lag: int = 2
    max_depth: int = 7

    def workload_config(self) -> dict[str, Any]:
        """The ``workload`` section of the bench settings."""
        return {
            "name": "fixed",
            "path": None,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "max_output_tokens": None,
            "start_interval_s": self.start_interval_s,
            "client_overhead_s": self.client_overhead_s,
        }

    def describe(self) -> dict[str, Any]:
        """YAML-friendly record of the setup (for a profile's provenance)."""
        return asdict(self)

    def draft_extend(self, depth: int) -> bool:
        """Whether the draft extend runs in a step of ``depth`` (as the simulator decides)."""
        return depth > 0 or not self.skip_zero_step_draft_extend

    def sim_overrides(self) -> dict:
        """The ``sim`` settings: without the draft extend, depth 0 is a server without
        speculation (``zero_step=off``); with it, SGLang's own steps=0."""
        if self.skip_zero_step_draft_extend:
            return {"skip_zero_step_draft_extend": True}
        return {"zero_step": "sglang_steps0"}


#: ``configs/bench.yaml`` defaults a :class:`BenchSetup` may differ from.
_BENCH_DEFAULTS = {"seed": 0, "feedback_lag": 2, "max_depth": 7}


def bench_command(profile: str, setup: BenchSetup, policies: Sequence[str],
                  concurrency: Sequence[int], *, workload_preset: str | None = None) -> str:
    """The ``specctl-bench`` command line that runs ``setup`` (for provenance and docs).

    Prompt and output lengths are left to the profile's ``provenance`` (the
    ``fixed`` workload's default) unless a workload preset is named.
    """
    args = [
        f"profile={profile}",
        f"'policies=[{','.join(policies)}]'",
        f"'concurrency=[{','.join(str(c) for c in concurrency)}]'",
        "horizon_s=null" if setup.horizon_s is None else f"horizon_s={setup.horizon_s:g}",
    ]
    if setup.requests_per_client is not None:
        args.append(f"requests_per_client={setup.requests_per_client}")
    if workload_preset is not None:
        args.append(f"workload={workload_preset}")
    else:
        for name in ("start_interval_s", "client_overhead_s"):
            if getattr(setup, name):
                args.append(f"workload.{name}={getattr(setup, name):g}")
    if setup.skip_zero_step_draft_extend:
        args.append("sim.skip_zero_step_draft_extend=true")
    else:
        args.append("sim.zero_step=sglang_steps0")
    for name, default in _BENCH_DEFAULTS.items():
        if getattr(setup, name) != default:
            args.append(f"{name}={getattr(setup, name)}")
    return "specctl-bench " + " ".join(args)


class _StaticSteps:
    """The same speculation steps every decode step (``agents.policies.StaticPolicy``,
    restated here because ``env`` must not depend on ``agents``)."""

    def __init__(self, steps: int) -> None:
        self.steps = int(steps)
        self.name = "no_spec" if self.steps == 0 else f"static_{self.steps}"

    def reset(self, sim: Simulator | None = None) -> None:
        """Stateless."""

    def act(self, obs: Observation) -> int:
        return self.steps


def simulate_throughput(profile: CostProfile, setup: BenchSetup, concurrency: int,
                        depth: int) -> float:
    """Output tok/s of one bench cell: ``concurrency`` clients, static ``depth``.

    Builds the simulator with the same factory calls, seed, feature spec and
    feedback lag as ``specctl-bench`` (:func:`agents.bench.run_cell`), so the
    number equals the bench's for the same settings.
    """
    acceptance = make_acceptance(None, profile, setup.max_depth)
    config = make_scheduler_config(setup.sim_overrides(), profile, setup.max_depth)
    workload = make_closed_loop(setup.workload_config(), concurrency,
                                setup.requests_per_client, profile)
    sim = Simulator(profile, acceptance, workload, config, seed=setup.seed)
    loop = DecisionLoop(sim, FeatureSpec(max_depth=setup.max_depth),
                        feedback_lag=setup.feedback_lag, horizon_s=setup.horizon_s)
    return rollout(loop, _StaticSteps(depth), seed=setup.seed).throughput_tok_s


def _simulate_job(job: tuple[CostProfile, BenchSetup, int, int]) -> float:
    return simulate_throughput(*job)


def simulate_cells(profile: CostProfile, setup: BenchSetup, cells: Sequence[tuple[int, int]],
                   workers: int = 1) -> np.ndarray:
    """:func:`simulate_throughput` of each ``(concurrency, depth)`` cell, in order."""
    jobs = [(profile, setup, int(c), int(d)) for c, d in cells]
    if workers <= 1 or len(jobs) <= 1:
        return np.array([_simulate_job(job) for job in jobs])
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        return np.array(list(pool.map(_simulate_job, jobs)))


def _coefficient_vector(values: Mapping[str, float]) -> np.ndarray:
    return np.array([values[name] for name in COEFFICIENTS])


def _fit_rows(
    template: CostProfile,
    rows: np.ndarray,
    seconds_per_token: np.ndarray,
    free: Sequence[str],
    ties: Mapping[str, tuple[str, float]],
    minimax: bool,
) -> dict[str, float]:
    """Least-squares (or minimax) relative fit of ``rows @ c`` to ``seconds_per_token``.

    Minimax is Lawson's iteratively re-weighted least squares: each round
    multiplies a target's weight by its current |relative error|, which drives
    the weighted least-squares solution toward the one with the smallest
    largest error. It is the natural criterion for a requirement stated per
    cell ("within 5% at each batch size").
    """
    values = fit_coefficients(rows, seconds_per_token, template=template, free=free, ties=ties)
    if not minimax:
        return values
    weight = np.ones(len(seconds_per_token))
    best, best_err = values, np.inf
    for _ in range(LAWSON_ROUNDS):
        err = np.abs(rows @ _coefficient_vector(values) / seconds_per_token - 1.0)
        if err.max() < best_err:
            best, best_err = values, float(err.max())
        weight = weight * np.maximum(err, 1e-9)
        weight /= weight.sum()
        values = fit_coefficients(rows, seconds_per_token, template=template, free=free,
                                  ties=ties, weight=weight)
    err = np.abs(rows @ _coefficient_vector(values) / seconds_per_token - 1.0)
    if err.max() < best_err:
        best = values
    return _polish_minimax(best, rows, seconds_per_token, free, ties)


def _polish_minimax(values: dict[str, float], rows: np.ndarray, seconds_per_token: np.ndarray,
                    free: Sequence[str], ties: Mapping[str, tuple[str, float]]) -> dict[str, float]:
    """Refine a Lawson solution to the smallest largest *throughput* error.

    Lawson minimises the largest relative error of seconds per token; the
    requirement is on throughput (its reciprocal), where the same solution is
    a few tenths of a percent off the optimum. A Nelder-Mead search over the
    free coefficients (``|x|`` keeps them non-negative) closes that gap.
    """
    free = list(free)

    def expand(x: np.ndarray) -> dict[str, float]:
        out = dict(values)
        out.update({name: float(abs(v)) for name, v in zip(free, x, strict=True)})
        for name, (other, factor) in ties.items():
            out[name] = factor * out[other]
        return out

    def worst(x: np.ndarray) -> float:
        return float(np.abs(seconds_per_token / (rows @ _coefficient_vector(expand(x))) - 1).max())

    x0 = np.array([values[name] for name in free])
    x, _ = _nelder_mead(worst, x0, step=0.05 * np.abs(x0) + 1e-7)
    return expand(x) if worst(x) < worst(x0) else values


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: np.ndarray,
                 rounds: int = 500, tol: float = 1e-12) -> tuple[np.ndarray, float]:
    """Minimise ``f`` from ``x0`` (a plain Nelder-Mead simplex; scipy is not a dependency)."""
    simplex = [np.array(x0, dtype=float)]
    for i in range(len(x0)):
        x = np.array(x0, dtype=float)
        x[i] += step[i]
        simplex.append(x)
    values = [f(x) for x in simplex]
    for _ in range(rounds):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centre = np.mean(simplex[:-1], axis=0)
        reflected = centre + (centre - simplex[-1])
        f_reflected = f(reflected)
        if f_reflected < values[0]:
            expanded = centre + 2.0 * (centre - simplex[-1])
            f_expanded = f(expanded)
            simplex[-1], values[-1] = ((expanded, f_expanded) if f_expanded < f_reflected
                                       else (reflected, f_reflected))
        elif f_reflected < values[-2]:
            simplex[-1], values[-1] = reflected, f_reflected
        else:
            contracted = centre + 0.5 * (simplex[-1] - centre)
            f_contracted = f(contracted)
            if f_contracted < values[-1]:
                simplex[-1], values[-1] = contracted, f_contracted
            else:  # shrink toward the best vertex
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [f(x) for x in simplex]
    best = int(np.argmin(values))
    return simplex[best], values[best]


@dataclass(frozen=True)
class StageResult:
    """Outcome of :func:`fit_in_simulator` for one set of targets.

    Attributes:
        targets: The targets.
        simulated_tok_s: What the simulator gives with the final profile.
        steady_tok_s: What the steady-state approximation gives with it.
        correction: ``simulated / steady`` per target, as used by the last refit
            (from the previous round's profile).
    """

    targets: tuple[ThroughputTarget, ...]
    simulated_tok_s: np.ndarray
    steady_tok_s: np.ndarray
    correction: np.ndarray

    @property
    def rel_errors(self) -> np.ndarray:
        """``simulated / target - 1`` per target."""
        return self.simulated_tok_s / np.array([t.throughput_tok_s for t in self.targets]) - 1.0


def _steady_rows(profile: CostProfile, targets: Sequence[ThroughputTarget], setup: BenchSetup,
                 accept_length: Mapping[int, float]) -> np.ndarray:
    return np.stack([
        _steady_state_row(profile, t.concurrency, t.depth, accept_length.get(t.depth, 1.0),
                          setup.prompt_tokens, setup.output_tokens,
                          setup.draft_extend(t.depth))
        for t in targets
    ])


def fit_in_simulator(
    template: CostProfile,
    targets: Sequence[ThroughputTarget],
    setup: BenchSetup,
    accept_length: Mapping[int, float],
    free: Sequence[str],
    *,
    ties: Mapping[str, tuple[str, float]] | None = None,
    minimax: bool = False,
    iterations: int = SIM_ITERATIONS,
    tolerance: float = SIM_TOLERANCE,
    correction: np.ndarray | None = None,
    workers: int = 1,
) -> tuple[CostProfile, StageResult]:
    """Fit ``free`` so that the *simulator* reproduces ``targets``.

    The steady-state approximation is linear in the coefficients but misses
    what the simulator does (clients that finish together are prefilled in one
    batched step, a ramp, the horizon cut, acceptance spread). So: fit the
    steady state to the targets divided by a per-cell correction
    ``simulated / steady-state``, simulate every target cell as
    ``specctl-bench`` would, update the correction, refit; until no correction
    moves by more than ``tolerance`` (at most ``iterations`` rounds), starting
    from ``correction`` (default: none). At the fixed point, simulated = target
    wherever the free coefficients can reach it.

    Args:
        template: Fixed coefficients and priors; ``free`` ones are refitted.
        targets: Cells to match (concurrency, depth, tok/s).
        setup: How the cells are run.
        accept_length: Expected tokens per verify step at each depth (for the
            steady state only; the simulator draws from the profile's acceptance).
        free: Coefficients to fit (>= 0).
        ties: ``name -> (other, factor)`` ties, as in :func:`fit_coefficients`.
        minimax: Minimise the largest relative error instead of the squared sum.
        iterations: Most fit-then-simulate rounds (1: the steady-state fit alone,
            simulated once for the report).
        tolerance: Stop once the corrections changed by less than this.
        correction: Initial per-target correction.
        workers: Processes for the simulations.
    """
    ties = dict(ties or {})
    targets = tuple(targets)
    seconds_per_token = np.array([1.0 / t.throughput_tok_s for t in targets])
    correction = np.ones(len(targets)) if correction is None else np.asarray(correction, float)
    cells = [(t.concurrency, t.depth) for t in targets]
    profile = template
    for _ in range(max(iterations, 1)):
        used = correction
        rows = _steady_rows(profile, targets, setup, accept_length)
        # simulated = correction * steady, so the steady state must hit target / correction.
        values = _fit_rows(profile, rows, seconds_per_token * correction, free, ties, minimax)
        profile = profile.replace(**values)
        simulated = simulate_cells(profile, setup, cells, workers)
        steady = 1.0 / (_steady_rows(profile, targets, setup, accept_length)
                        @ _coefficient_vector(profile.coefficients))
        correction = simulated / steady
        if np.abs(correction / used - 1.0).max() < tolerance:
            break
    return profile, StageResult(targets, simulated, steady, used)


@dataclass
class CalibrationReport:
    """Targets against the simulated (and steady-state) predictions of a calibrated profile."""

    rows: list[dict] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def worst_abs_error(self) -> float:
        """Largest |relative error| (simulated vs target) over the targets."""
        return max((abs(r["rel_error"]) for r in self.rows), default=0.0)

    def add(self, stage: StageResult) -> None:
        """Append a stage's targets."""
        for t, sim, steady, corr, err in zip(stage.targets, stage.simulated_tok_s,
                                             stage.steady_tok_s, stage.correction,
                                             stage.rel_errors, strict=True):
            self.rows.append({
                "label": t.label,
                "concurrency": t.concurrency,
                "depth": t.depth,
                "speculative": t.speculative,
                "target_tok_s": round(t.throughput_tok_s, 3),
                "simulated_tok_s": round(float(sim), 3),
                "rel_error": round(float(err), 5) + 0.0,  # + 0.0: no "-0.0" in the YAML
                "steady_state_tok_s": round(float(steady), 3),
                # Kept at full precision: the final refit can be redone from it.
                "correction": float(corr),
            })

    def __str__(self) -> str:
        lines = [
            f"{'target':<34} {'C':>4} {'d':>2} {'target tok/s':>12} {'simulated':>10} "
            f"{'error':>7} {'steady':>9}"
        ]
        for r in self.rows:
            lines.append(
                f"{r['label']:<34} {r['concurrency']:>4} {r['depth']:>2} "
                f"{r['target_tok_s']:12.2f} {r['simulated_tok_s']:10.2f} "
                f"{r['rel_error'] * 100:+6.2f}% {r['steady_state_tok_s']:9.2f}"
            )
        lines.append(f"worst |error| {self.worst_abs_error * 100:.2f}% (simulated vs target)")
        return "\n".join(lines)


def with_calibration(profile: CostProfile, report: CalibrationReport, extra: dict) -> CostProfile:
    """``profile`` with the report's assumptions, targets and worst error in its provenance."""
    provenance = dict(profile.provenance)
    provenance.update(extra)
    provenance["assumptions"] = report.assumptions
    provenance["targets"] = report.rows
    provenance["worst_abs_rel_error"] = round(report.worst_abs_error, 5)
    return profile.replace(provenance=provenance)

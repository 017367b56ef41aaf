"""End-to-end calibration: the shipped profiles reproduce their targets through ``specctl-bench``.

Each sweep below is the README's command line, composed by Hydra from
``configs/bench.yaml`` and run by :func:`agents.bench.run_sweep`, the code path
of ``specctl-bench`` (without the output files). The targets are the
published / measured numbers themselves (``shared/anchors/PUBLISHED.md``,
``env/sim/data/measured/h200-sglang-0.5.15``, shipped), so a drifting profile fails here.
The rest checks the simulator-in-the-loop machinery of :mod:`env.sim.calibration`.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from agents.bench import run_cell, run_sweep
from env.factory import make_acceptance
from env.sim.calibration import fitting, h200
from env.sim.cost_model import COEFFICIENTS, FitReport, load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.workloads import ClosedLoop

MEASURED = h200.default_measured_dir()  # shipped with the package
PRESET = Path(__file__).resolve().parents[1] / "configs" / "workload" / "h200_measured.yaml"

# -- the README commands (specctl-bench overrides) -----------------------------------

BLACKWELL_COMMAND = [
    "profile=blackwell_tp8", "policies=[no_spec,static_3]", "concurrency=[1,70,250]",
    "horizon_s=300", "sim.skip_zero_step_draft_extend=true",
]
H100_COMMAND = [
    "profile=h100_llama31_8b", "policies=[no_spec,static_3]",
    "concurrency=[1,2,4,8,16,24,32,48,56,64]", "horizon_s=120",
    "sim.skip_zero_step_draft_extend=true",
]
H200_COMMAND = [
    "profile=h200_llama31_8b",
    "policies=[no_spec,static_1,static_2,static_3,static_5,static_7]",
    "concurrency=[1,4,8,16,32,48,64]", "horizon_s=null", "requests_per_client=1",
    "workload=h200_measured", "sim.zero_step=sglang_steps0",
]

# -- the targets, from PUBLISHED.md -------------------------------------------------

#: Section 1: (C, no speculation tok/s, EAGLE-3 tok/s).
BLACKWELL_PUBLISHED = [(1, 92.6, 77.5), (70, 784.2, 337.7), (250, 772.1, 340.9)]
#: Section 2, Table 3: EAGLE-3 speedup over no speculation by batch size.
H100_TABLE3 = {2: 1.81, 4: 1.82, 8: 1.62, 16: 1.48, 24: 1.39, 32: 1.32, 48: 1.38, 56: 1.34,
               64: 1.38}
H100_TABLE4_NO_SPEC = 158.34
TOLERANCE = 0.05
#: Table 3 is not reachable within 5% at batches 4, 32 and 64 with step costs
#: linear in the batch (see env.sim.calibration.h100.calibrate_h100); the minimax fit
#: leaves about 5.3% there. Anything beyond 5.5% is drift.
H100_TOLERANCE = {4: 0.055, 32: 0.055, 64: 0.055}
H200_TOLERANCE = 0.10


def bench(overrides: list[str]) -> dict[str, dict[str, float]]:
    """Throughput by policy and concurrency of one ``specctl-bench`` command."""
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="bench", overrides=[*overrides, "plot=false"])
    document = run_sweep(OmegaConf.to_container(cfg, resolve=True))
    return {policy: {c: cell["throughput_tok_s"] for c, cell in cells.items()}
            for policy, cells in document["results"].items()}


@pytest.fixture(scope="module")
def blackwell_results():
    return bench(BLACKWELL_COMMAND)


@pytest.fixture(scope="module")
def h100_results():
    return bench(H100_COMMAND)


@pytest.fixture(scope="module")
def h200_results():
    return bench(H200_COMMAND)


def measured_sweep() -> dict[tuple[int, int], float]:
    cells = {}
    for line in (MEASURED / "sweep_simulated_acc3.5.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            cells[(row["concurrency"], row["steps"])] = row["tok_s"]
    return cells


# -- end to end ---------------------------------------------------------------------


@pytest.mark.parametrize(("concurrency", "no_spec", "eagle3"), BLACKWELL_PUBLISHED)
def test_blackwell_reproduces_published_section_1(blackwell_results, concurrency, no_spec,
                                                  eagle3):
    got_base = blackwell_results["no_spec"][str(concurrency)]
    got_spec = blackwell_results["static_3"][str(concurrency)]
    assert got_base == pytest.approx(no_spec, rel=TOLERANCE)
    assert got_spec == pytest.approx(eagle3, rel=TOLERANCE)
    assert got_spec < got_base  # the point of section 1: speculation loses at every load


def test_h100_reproduces_table_4(h100_results):
    assert h100_results["no_spec"]["1"] == pytest.approx(H100_TABLE4_NO_SPEC, rel=TOLERANCE)


@pytest.mark.parametrize(("batch", "speedup"), sorted(H100_TABLE3.items()))
def test_h100_reproduces_table_3(h100_results, batch, speedup):
    got = h100_results["static_3"][str(batch)] / h100_results["no_spec"][str(batch)]
    assert got == pytest.approx(speedup, rel=H100_TOLERANCE.get(batch, TOLERANCE))


def test_h200_reproduces_measured_sweep(h200_results):
    measured = measured_sweep()
    assert len(measured) == 42
    errors = {}
    for (c, steps), tok_s in measured.items():
        policy = "no_spec" if steps == 0 else f"static_{steps}"
        errors[(c, steps)] = h200_results[policy][str(c)] / tok_s - 1.0
    worst = max(errors, key=lambda k: abs(errors[k]))
    c, steps = worst
    assert abs(errors[worst]) < H200_TOLERANCE, f"C={c} steps={steps}: {errors[worst]:+.3f}"
    # C = 64 is slower than C = 48 without speculation (SGLang's cap of 48 running
    # requests under speculation): the simulator must show the same dip.
    assert h200_results["no_spec"]["64"] < h200_results["no_spec"]["48"]


def test_h200_profile_stays_fitted_to_step_latencies():
    report = FitReport.evaluate(load_profile("h200_llama31_8b"),
                                            h200.read_h200_points(MEASURED))
    assert report.median_abs_error < 0.05
    assert report.worst_abs_error < 0.10


#: How far (relative) a cell may be from what the profile's provenance says the
#: simulator gives. These are not targets (those are the published and measured numbers
#: above, which the tests above check against their own sources); they check that
#: the provenance shipped with each profile is true of this code. A change to the profile
#: or the simulator that leaves it stale trips them: re-run ``python -m env.sim.calibration``.
RECORDED = 1e-3


def test_the_blackwell_and_h100_provenance_states_what_the_simulator_gives(blackwell_results,
                                                                          h100_results):
    for name, results in (("blackwell_tp8", blackwell_results),
                          ("h100_llama31_8b", h100_results)):
        for row in load_profile(name).provenance["targets"]:
            policy = "no_spec" if row["depth"] == 0 else f"static_{row['depth']}"
            got = results[policy][str(row["concurrency"])]
            assert got == pytest.approx(row["simulated_tok_s"], rel=RECORDED), row["label"]


def test_the_h200_provenance_states_the_errors_the_simulator_gives(h200_results):
    """Each recorded error is the simulated cell over the measured one (the measured
    sweep, shipped, is the independent source), as the bench gives it now."""
    sweep = load_profile("h200_llama31_8b").provenance["sweep"]
    measured = measured_sweep()
    for c, errors in sweep["rel_errors_by_concurrency"].items():
        for steps, error in zip(sweep["steps"], errors, strict=True):
            policy = "no_spec" if steps == 0 else f"static_{steps}"
            got = h200_results[policy][str(c)] / measured[(int(c), steps)] - 1.0
            assert got == pytest.approx(error, abs=RECORDED), f"C={c} steps={steps}"


def test_commands_are_the_ones_the_calibration_simulated():
    """The provenance records the command each profile was calibrated with; it is this one."""
    for name, command in (("blackwell_tp8", BLACKWELL_COMMAND),
                          ("h100_llama31_8b", H100_COMMAND)):
        recorded = load_profile(name).provenance["bench_command"]
        assert shlex.split(recorded) == ["specctl-bench", *command]
    recorded = load_profile("h200_llama31_8b").provenance["sweep"]["bench_command"]
    assert shlex.split(recorded) == ["specctl-bench", *H200_COMMAND]


def test_h200_workload_preset_is_the_fitted_setup():
    preset = yaml.safe_load(PRESET.read_text())
    setup = load_profile("h200_llama31_8b").provenance["sweep"]["setup"]
    for key in ("prompt_tokens", "output_tokens", "start_interval_s", "client_overhead_s"):
        assert preset[key] == setup[key]
    assert preset["name"] == "fixed" and setup["requests_per_client"] == 1
    # Physically sensible: a load generator's per-client start gap and a per-request
    # time outside the server of milliseconds to tens of milliseconds.
    assert 0.0 < setup["start_interval_s"] < 0.02
    assert 0.0 <= setup["client_overhead_s"] < 0.05


# -- the machinery ------------------------------------------------------------------


def test_simulate_throughput_is_what_the_bench_runs():
    profile = load_profile("h200_llama31_8b")
    setup = h200.h200_sweep_setup(start_interval_s=0.004, client_overhead_s=0.02)
    settings = {
        "profile": "h200_llama31_8b", "acceptance": None, "max_depth": setup.max_depth,
        "sim": setup.sim_overrides(), "workload": setup.workload_config(),
        "requests_per_client": 1, "seed": setup.seed, "feedback_lag": setup.feedback_lag,
        "horizon_s": None,
    }
    for c, d in ((1, 0), (8, 3), (64, 5)):
        expected = run_cell(settings, "no_spec" if d == 0 else f"static_{d}", c).throughput_tok_s
        assert fitting.simulate_throughput(profile, setup, c, d) == expected


def test_fit_in_simulator_hits_simulated_targets_the_steady_state_misses():
    """Recover targets produced by the simulator itself from a perturbed template."""
    truth = load_profile("h200_llama31_8b")
    setup = fitting.BenchSetup(prompt_tokens=256, output_tokens=256, horizon_s=10.0,
                                   skip_zero_step_draft_extend=True)
    cells = [(1, 0), (16, 0), (48, 0)]
    simulated = fitting.simulate_cells(truth, setup, cells)
    targets = [fitting.ThroughputTarget(f"C={c}", c, d, False, float(t))
               for (c, d), t in zip(cells, simulated, strict=True)]
    template = truth.replace(c_fixed=0.0, c_request=0.0)
    free = ("c_fixed", "c_request")
    # One round = the steady-state fit alone: batched prefills of clients that
    # finish together make it miss at load.
    _, steady_only = fitting.fit_in_simulator(template, targets, setup, {}, free,
                                                  iterations=1)
    fitted, result = fitting.fit_in_simulator(template, targets, setup, {}, free)
    assert np.abs(steady_only.rel_errors).max() > 0.03
    assert np.abs(result.rel_errors).max() < 1e-3
    assert fitted.c_fixed == pytest.approx(truth.c_fixed, rel=5e-3)
    assert fitted.c_request == pytest.approx(truth.c_request, rel=5e-3)
    assert result.correction[-1] > 1.03  # what the steady state misses at C = 48


def test_minimax_fit_lowers_the_largest_error():
    rng = np.random.default_rng(3)
    rows = np.zeros((12, len(COEFFICIENTS)))
    fixed, request = (COEFFICIENTS.index(n) for n in ("c_fixed", "c_request"))
    batch = rng.uniform(1, 64, size=12)
    rows[:, fixed], rows[:, request] = 1.0, batch
    target = (5e-3 + 2e-4 * batch) * rng.uniform(0.93, 1.07, size=12)
    template = load_profile("h200_llama31_8b")

    def worst(values):
        predicted = rows @ fitting._coefficient_vector(values)
        return np.abs(target / predicted - 1).max()  # throughput error

    free = ("c_fixed", "c_request")
    least_squares = fitting._fit_rows(template, rows, target, free, {}, minimax=False)
    minimax = fitting._fit_rows(template, rows, target, free, {}, minimax=True)
    assert worst(minimax) < worst(least_squares)
    assert min(minimax[n] for n in free) >= 0.0


def test_best_overhead_recovers_a_constant_shift():
    elapsed = np.array([0.3, 0.8, 1.1, 2.4])
    measured = (elapsed + 0.021) * np.array([1.02, 0.98, 1.0, 1.0])
    overhead, error = h200._best_overhead(elapsed, measured)
    assert overhead == pytest.approx(0.021, abs=0.002)
    assert error == pytest.approx(0.02, abs=0.002)
    # An overhead never goes negative: a simulator too slow already gets none.
    assert h200._best_overhead(elapsed, 0.9 * elapsed)[0] == 0.0


def test_client_overhead_delays_every_request_in_the_simulator():
    profile = load_profile("h200_llama31_8b")
    acceptance = make_acceptance(None, profile, 7)
    config = SchedulerConfig.from_profile(profile, max_depth=7)
    loop = ClosedLoop(concurrency=3, prompt_tokens=64, output_tokens=16, requests_per_client=2,
                      start_interval_s=0.01, client_overhead_s=0.05)
    sim = Simulator(profile, acceptance, loop, config, seed=1)
    while not sim.done:
        sim.advance()
        if not sim.done:
            sim.decode(3)
    stats = sim.stats()
    clients = sim.requests.client[: sim.requests.size]
    assert stats.finished.all() and len(clients) == 6
    for client in range(3):
        first, second = np.flatnonzero(clients == client)
        assert stats.arrival_s[first] == pytest.approx(0.01 * client + 0.05)
        assert stats.arrival_s[second] == pytest.approx(stats.finish_s[first] + 0.05)
    # The run ends with the last request, not with an overhead nobody waits for.
    assert sim.time_s == pytest.approx(stats.finish_s.max())
    with pytest.raises(ValueError, match="client_overhead_s"):
        ClosedLoop(concurrency=1, prompt_tokens=1, output_tokens=1, client_overhead_s=-1.0)

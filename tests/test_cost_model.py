"""Tests of the step-latency model, its fit, the shipped profiles and their calibration."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from env.sim.calibration import fitting, h200
from env.sim.calibration.__main__ import main as recalibrate
from env.sim.cost_model import (
    COEFFICIENTS,
    DEFAULT_FREE,
    DEFAULT_TIES,
    CostProfile,
    FitReport,
    LatencyPoints,
    ProfileError,
    ServerLimits,
    UnidentifiableFitError,
    design_matrix,
    fit_coefficients,
    fit_profile,
    fit_profile_from_trace,
    load_profile,
    nnls,
    points_from_trace,
    prefill_pairs,
    profile_from_dict,
    save_profile,
    shipped_profiles,
    unidentifiable,
)
from env.sim.fit_profile import main as fit_profile_main
from env.sim.off_cost import dense_h200_points, fit_off_path
from env.traces.schema import StepRecord
from env.traces.trace_format import RequestColumns, Trace, read_trace, write_trace

MEASURED = h200.default_measured_dir()  # shipped with the package
NAMES = ["blackwell_tp8", "h100_llama31_8b", "h200_llama31_8b", "h200_llama31_8b_recorded",
         "h200_qwen3_30b_a3b"]


def test_shipped_profiles_load_with_their_stated_acceptance_and_a_plausible_step():
    """Beyond the keys: each acceptance model gives what its own note states, and a plain
    decode step of one request costs what an 8B-30B model on one node does (ms)."""
    assert shipped_profiles() == NAMES
    for name in NAMES:
        profile = load_profile(name)
        assert profile.name == name
        assert profile.provenance.get("calibrated_to")
        acceptance = profile.acceptance
        if acceptance["model"] == "parametric":
            # "accept length L at depth 3 (... decay d)": a chain accepts position k with
            # probability alpha_1 ... alpha_k, so L = 1 + sum of those products up to 3.
            stated = re.search(r"accept length ([\d.]+) at depth 3 .*?decay ([\d.]+)",
                               acceptance["assumption"])
            alphas = np.array(acceptance["alphas"])
            assert len(alphas) == 7 and acceptance["structure"] == "iid", name
            assert 1 + np.cumprod(alphas[:3]).sum() == pytest.approx(float(stated[1]),
                                                                     rel=1e-3), name
            assert alphas[1:] / alphas[:-1] == pytest.approx(float(stated[2])), name
        else:  # the measured runs' simulated acceptance, as the note names it
            assert acceptance["model"] == "sglang_simulated", name
            assert (f"SGLANG_SIMULATE_ACC_LEN={acceptance['mean_accept_length']}"
                    in acceptance["note"]), name
        assert 2e-3 < profile.step_latency_s(1, 0, 1000, 0, False) < 0.05, name


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(0, 300),
    depth=st.integers(0, 7),
    kv=st.integers(0, 500_000),
    prefill=st.integers(0, 8192),
    extend=st.booleans(),
)
def test_scalar_matches_vectorised_and_is_monotone(name, batch, depth, kv, prefill, extend):
    p = load_profile(name)
    scalar = p.step_latency_s(batch, depth, kv, prefill, extend)
    vector = p.step_latency_array(batch, depth, kv, prefill, extend)
    assert vector.shape == (1,)
    assert scalar == pytest.approx(float(vector[0]), rel=1e-12)
    assert p.step_latency_s(batch, depth + 1, kv, prefill, extend) >= scalar
    assert p.step_latency_s(batch + 1, depth, kv, prefill, extend) >= scalar
    assert p.step_latency_s(batch, depth, kv + 1000, prefill, extend) >= scalar
    assert p.step_latency_s(batch, depth, kv, prefill, True) >= p.step_latency_s(
        batch, depth, kv, prefill, False
    )


def test_terms_by_hand():
    server = ServerLimits(64, 10_000, 512, cuda_graph_max_bs=8)
    p = CostProfile(
        "t", server, c_fixed=1, c_request=2, c_token=3, c_moe=100, c_kv=0.5, c_verify=7,
        c_verify_token=11, c_draft=13, c_draft_token=17, c_extend=19, c_extend_token=23,
        c_eager=29, c_eager_token=31, moe_active_fraction=0.25,
    )  # fmt: skip
    b, d, kv = 10, 3, 4
    tokens = b * (d + 1)
    expected = (
        1 + 2 * b + 3 * tokens + 100 * (1 - 0.75**tokens) + 0.5 * kv + 7 + 11 * b
        + (d - 1) * (13 + 17 * b) + 19 + 23 * tokens + 29 + 31 * b
    )  # fmt: skip
    assert p.step_latency_s(b, d, kv, 0) == pytest.approx(expected)
    # Depth 0 without extend: no speculation at all; a prefill-only step.
    assert p.step_latency_s(4, 0, 0, 0, False) == pytest.approx(1 + 8 + 12 + 100 * (1 - 0.75**4))
    assert p.step_latency_s(0, 0, 0, 100, True) == pytest.approx(
        1 + 300 + 100 * (1 - 0.75**100) + 19 + 2300
    )
    # The MoE term saturates at c_moe: every expert read once.
    assert p.step_latency_array(0, 0, 0, 10**6, False)[0] == pytest.approx(1 + 3e6 + 100)


@settings(max_examples=80, deadline=None)
@given(share=st.floats(0.0, 1.0), batch=st.integers(0, 64), depth=st.integers(0, 7),
       prefill=st.integers(0, 4096))
def test_draft_tokens_add_a_share_of_a_fresh_tokens_experts(share, batch, depth, prefill):
    """T_moe = batch * (1 + share * depth) + prefill: a request's drafts continue its text."""
    server = ServerLimits(64, 10_000, 4096)
    p = CostProfile("t", server, c_fixed=1e-3, c_moe=1e-2, moe_active_fraction=0.125,
                    moe_draft_token_share=share)
    moe_tokens = batch * (1 + share * depth) + prefill
    expected = 1e-3 + 1e-2 * (1 - 0.875**moe_tokens)
    assert p.step_latency_s(batch, depth, 0, prefill, False) == pytest.approx(expected)
    assert p.step_latency_array(batch, depth, 0, prefill, False)[0] == pytest.approx(expected)
    # a verified draft never adds more experts than a fresh token
    assert p.step_latency_s(batch, depth, 0, prefill) <= p.replace(
        moe_draft_token_share=1.0).step_latency_s(batch, depth, 0, prefill) + 1e-15
    loaded = profile_from_dict(p.to_dict())
    assert loaded.moe_draft_token_share == pytest.approx(share)
    with pytest.raises(ValueError, match="moe_draft_token_share"):
        p.replace(moe_draft_token_share=1.5)


def random_profile(rng) -> CostProfile:
    values = {name: 0.0 for name in COEFFICIENTS}
    for name in DEFAULT_FREE:
        values[name] = float(rng.uniform(0.2, 2.0)) * 10.0 ** rng.uniform(-5, -3)
    values["c_kv"] = 3e-8
    for name, (other, factor) in DEFAULT_TIES.items():
        values[name] = factor * values[other]
    return CostProfile("truth", ServerLimits(256, 10**6, 8192, 64), **values)


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_known_coefficients(seed):
    rng = np.random.default_rng(seed)
    truth = random_profile(rng)
    grid = np.array(list(itertools.product([1, 4, 8, 16, 32, 48], [0, 1, 2, 3, 5, 7])))
    b, d = grid.T
    kv = b * 320
    points = LatencyPoints(b, d, kv, 0, truth.step_latency_array(b, d, kv, 0))
    template = truth.replace(**{name: 0.0 for name in DEFAULT_FREE}, name="template")
    fitted, report = fit_profile(points, template=template)
    for name in COEFFICIENTS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12)
    assert report.worst_abs_error < 1e-9
    assert fitted.provenance["fit"]["free"] == list(DEFAULT_FREE)


def test_fit_with_noise_and_report():
    rng = np.random.default_rng(9)
    truth = load_profile("h200_llama31_8b")
    b = rng.integers(1, 64, 400)
    d = rng.integers(0, 8, 400)
    latency = truth.step_latency_array(b, d, b * 300, 0) * rng.lognormal(0, 0.02, 400)
    fitted, report = fit_profile(
        {"batch": b, "depth": d, "kv_tokens": b * 300, "latency_s": latency},
        template=truth.replace(c_fixed=0.0, c_request=0.0),
    )
    assert report.median_abs_error < 0.03
    assert fitted.c_fixed == pytest.approx(truth.c_fixed, rel=0.05)
    # Within 5% of what a request costs a (speculative-path) step in all.
    per_request = truth.c_request + truth.c_steps0_request
    assert fitted.c_request == pytest.approx(truth.c_request, abs=0.05 * per_request)
    text = str(report)
    assert "median |error|" in text and len(text.splitlines()) == 402


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10**6), m=st.integers(3, 12), n=st.integers(1, 4))
def test_nnls_matches_brute_force(seed, m, n):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(m, n))
    b = rng.normal(size=m)
    x = nnls(a, b)
    assert np.all(x >= 0)
    assert np.sum((a @ x - b) ** 2) == pytest.approx(_best_residual(a, b), rel=1e-7, abs=1e-9)


def _best_residual(a: np.ndarray, b: np.ndarray) -> float:
    """The least squared residual over x >= 0, by exhaustive search over active sets."""
    best = np.sum(b**2)
    for k in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), k):
            sol = np.linalg.lstsq(a[:, subset], b, rcond=None)[0]
            if np.all(sol >= 0):
                best = min(best, np.sum((a[:, subset] @ sol - b) ** 2))
    return best


@pytest.mark.parametrize(("a", "b"), [
    # Integer problems on which the inner loop takes several steps back (found by a
    # search over random ones): a wrong step, or a wrong value for the variables it
    # drops, ends off the optimum there.
    ([[0, 2, 0, 0, 1, 1], [3, 1, 1, 1, -1, 0], [0, -1, -3, -1, 0, 3], [0, -1, 3, -1, -3, 2],
      [2, -2, -1, 2, -3, -1], [-2, -1, 3, 1, -1, 1]], [1, 3, -1, -2, 1, 3]),
    ([[3, 0, 2, -3, -1, 0], [2, 3, -1, -3, -1, -1], [0, -1, 0, 2, 1, 0],
      [-2, -1, 2, -2, -2, 1]], [3, -3, -1, 3]),
])
def test_nnls_reaches_the_optimum_after_several_steps_back(a, b):
    a, b = np.array(a, float), np.array(b, float)
    x = nnls(a, b)
    assert np.all(x >= 0)
    assert np.sum((a @ x - b) ** 2) == pytest.approx(_best_residual(a, b), rel=1e-9, abs=1e-12)


def test_h200_profile_fits_measured_data():
    profile = load_profile("h200_llama31_8b")
    points = h200.read_h200_points(MEASURED)
    report = FitReport.evaluate(profile, points)
    assert len(points) == 67
    assert report.median_abs_error < 0.05
    assert report.worst_abs_error < 0.10
    # The shipped YAML is what the calibration code produces: the step-latency fit, then
    # the off path's terms from the off-switch measurements (python -m env.sim.calibration).
    refit, _ = fit_off_path(h200.calibrate_h200(MEASURED)[0], dense_h200_points())
    for name in COEFFICIENTS:
        assert getattr(profile, name) == pytest.approx(getattr(refit, name), rel=1e-9)
    # SGLang's cap on running requests under speculation (the measured server's).
    assert profile.server.max_running_requests == 48 == refit.server.max_running_requests


def test_steady_state_by_hand_and_exact_for_one_client():
    """The steady-state approximation is the closed form in the module docstring; with
    one client nothing is batched, so the simulator agrees with it closely."""
    profile = load_profile("h100_llama31_8b")
    state = fitting.steady_state(profile, 1, 0, 1.0, 256, 384, speculative=False)
    decode_time = state.decode_steps_per_request * state.decode_step_s
    assert 384 / (decode_time + state.prefill_s) == pytest.approx(state.throughput_tok_s,
                                                                  rel=1e-12)
    assert state.throughput_tok_s == pytest.approx(158.34, rel=1e-3)  # Table 4
    row = profile.provenance["targets"][0]
    assert row["concurrency"] == 1 and abs(row["correction"] - 1.0) < 1e-3


def test_end_to_end_provenance_records_the_simulated_targets():
    for name, worst in (("blackwell_tp8", 0.05), ("h100_llama31_8b", 0.055)):
        provenance = load_profile(name).provenance
        errors = [r["simulated_tok_s"] / r["target_tok_s"] - 1 for r in provenance["targets"]]
        assert max(abs(e) for e in errors) < worst
        assert provenance["worst_abs_rel_error"] == pytest.approx(max(map(abs, errors)),
                                                                  abs=1e-4)
        assert provenance["bench_command"].startswith(f"specctl-bench profile={name} ")


def test_the_h100_profile_reproduces_the_eagle3_papers_numbers_when_simulated():
    """Not the stored provenance: the shipped profile run through the simulator, as
    ``specctl-bench`` runs a cell, against the published numbers it was calibrated to
    (EAGLE-3, arXiv 2503.01840, SGLang on one H100: Table 4, 158.34 tok/s without
    speculation at batch 1; Table 3, chain-3 speedups x1.81 at batch 2 and x1.62 at
    batch 8). The stored ``simulated_tok_s`` is what the simulation gives."""
    profile = load_profile("h100_llama31_8b")
    setup = fitting.BenchSetup(**profile.provenance["bench_setup"])

    def tok_s(concurrency: int, depth: int) -> float:
        return fitting.simulate_throughput(profile, setup, concurrency, depth)

    batch1 = tok_s(1, 0)
    assert batch1 == pytest.approx(158.34, rel=1e-3)
    for batch, speedup in ((2, 1.81), (8, 1.62)):
        assert tok_s(batch, 3) / tok_s(batch, 0) == pytest.approx(speedup, rel=0.02), batch
    stored = {(r["concurrency"], r["depth"]): r["simulated_tok_s"]
              for r in profile.provenance["targets"]}
    assert stored[(1, 0)] == pytest.approx(batch1, abs=1e-3)
    assert stored[(8, 3)] == pytest.approx(tok_s(8, 3), abs=1e-3)


def _assert_same(shipped, regenerated, where="") -> None:
    """Equal YAML trees, floats to 1e-9 relative (last-bit differences between platforms)."""
    if isinstance(shipped, dict):
        assert isinstance(regenerated, dict) and shipped.keys() == regenerated.keys(), where
        for key in shipped:
            _assert_same(shipped[key], regenerated[key], f"{where}.{key}")
    elif isinstance(shipped, list):
        assert isinstance(regenerated, list) and len(shipped) == len(regenerated), where
        for i, (a, b) in enumerate(zip(shipped, regenerated, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(shipped, float):
        assert regenerated == pytest.approx(shipped, rel=1e-9, abs=1e-12), where
    else:
        assert shipped == regenerated, where


@pytest.mark.slow
def test_calibration_regenerates_the_shipped_files(tmp_path, capsys):
    """``python -m env.sim.calibration`` writes exactly the shipped profiles and preset (~1-2 min:
    it simulates every target cell several times)."""
    recalibrate(["--out", str(tmp_path / "profiles"), "--configs",
                      str(tmp_path / "configs"), "--measured", str(MEASURED)])
    assert "worst |error|" in capsys.readouterr().out
    shipped_dir = fitting.SIM_DIR / "profiles"
    for name in NAMES:
        _assert_same(yaml.safe_load((shipped_dir / f"{name}.yaml").read_text()),
                     yaml.safe_load((tmp_path / "profiles" / f"{name}.yaml").read_text()), name)
    preset = "workload/h200_measured.yaml"
    shipped_preset = fitting.REPO_DIR / "configs" / preset
    assert (tmp_path / "configs" / preset).read_text() == shipped_preset.read_text()


def test_profile_yaml_round_trip_and_errors(tmp_path):
    profile = load_profile("h100_llama31_8b")
    path = save_profile(profile, tmp_path / "p.yaml")
    again = load_profile(path)
    assert again == profile
    assert again.acceptance == profile.acceptance
    data = yaml.safe_load(path.read_text())
    data["cost"]["c_token"] = -1.0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=r"bad.yaml: cost.c_token must be finite and >= 0"):
        load_profile(bad)
    data["cost"]["c_token"] = 1e-6
    data["cost"]["c_magic"] = 1.0
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=r"unknown key 'cost\.c_magic'"):
        load_profile(bad)
    del data["cost"]["c_magic"]
    del data["server"]
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="missing key 'server'"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="unknown profile 'nope'"):
        load_profile("nope")


def synthetic_trace_file(tmp_path, truth: CostProfile) -> Path:
    rng = np.random.default_rng(0)
    steps = []
    for i in range(300):
        b = int(rng.integers(1, 64))
        d = int(rng.integers(0, 8))
        kv = b * 400
        prefill = 0 if i % 10 else 2048
        latency = truth.step_latency_s(b, d, kv, prefill) * float(rng.lognormal(0, 0.01))
        steps.append(
            StepRecord(
                "srv",
                0,
                i,
                i * 0.02,
                b,
                0,
                b,
                kv,
                10**6,
                prefill,
                0 if prefill else d,
                np.array([], np.int8),
                latency,
            )
        )
    return write_trace(tmp_path / "trace.parquet", [], steps, {"note": "synthetic"})


def test_fit_profile_from_trace_and_cli(tmp_path, capsys):
    truth = random_profile(np.random.default_rng(4))
    path = synthetic_trace_file(tmp_path, truth)
    template = truth.replace(c_fixed=0.0, c_request=0.0, c_draft=0.0)
    fitted, report = fit_profile_from_trace(read_trace(path), template, per_cell=False)
    assert len(report.points) == 270  # prefill steps left out
    assert report.median_abs_error < 0.02
    assert fitted.c_draft == pytest.approx(truth.c_draft, rel=0.1)
    out = tmp_path / "fitted.yaml"
    assert fit_profile_main([f"trace={path}", f"out={out}", "name=mine", "per_cell=false"]) == 0
    printed = capsys.readouterr().out
    assert "median |error|" in printed and "worst" in printed
    cli_profile = load_profile(out)
    assert cli_profile.name == "mine"
    assert "trace.parquet" in cli_profile.provenance["calibrated_to"]
    for argv in (["out=x.yaml"], [f"trace={path}", "bogus=1"]):
        with pytest.raises(SystemExit) as exit_:
            fit_profile_main(argv)
        assert exit_.value.code == 2
    with pytest.raises(ValueError, match="cell has 5 decode steps"):
        fit_profile_from_trace(read_trace(path), template)  # 270 distinct cells


def test_per_cell_fit_uses_medians_and_prefill_steps(tmp_path):
    truth = random_profile(np.random.default_rng(5)).replace(c_prefill_token=2e-5)
    rng = np.random.default_rng(1)
    steps = []
    for i in range(600):
        b, d = int(rng.choice([1, 8, 32])), int(rng.choice([0, 1, 3, 7]))
        prefill = 4096 if i % 20 == 0 else 0
        exact = (truth.step_latency_s(0, 0, 1000, prefill) if prefill
                 else truth.step_latency_s(b, d, 1000, 0))
        noisy = exact * (3.0 if i % 17 == 5 else float(rng.lognormal(0, 0.02)))  # outliers
        steps.append(StepRecord("srv", 0, i, i * 0.02, b, 0, b, 1000, 10**6, prefill,
                                0 if prefill else d, np.array([], np.int8), noisy))
    trace = read_trace(write_trace(tmp_path / "t.parquet", [], steps, {}))
    template = truth.replace(c_fixed=0.0, c_request=0.0, c_draft=0.0, c_prefill_token=0.0)
    fitted, report = fit_profile_from_trace(trace, template)
    assert len(report.points) == 12  # 3 batch sizes x 4 depths
    assert report.median_abs_error < 0.02  # medians ignore the 3x outliers
    assert fitted.c_prefill_token == pytest.approx(2e-5, rel=0.1)


def _plugin_steps(truth: CostProfile, flagged: bool) -> list[StepRecord]:
    """Decode steps as the plugin with its off path runs them, each latency exactly the
    truth's for what ran: off (a plain decode), the re-entry warm-up (SGLang's steps=0
    with the draft extend, recorded at depth 0), depths 1, 3 and 5; flagged or not."""
    kinds = [(0, False), (0, True), (1, False), (3, False), (5, False)]
    steps = []
    for i in range(240):
        b = (2, 8, 32)[i % 3]
        depth, warmup = kinds[(i // 3) % len(kinds)]
        kv = 400 * b
        flags = ({"draft_extend": True, "speculative_path": True} if warmup or depth
                 else {"draft_extend": False, "speculative_path": False})
        latency = truth.step_latency_s(b, depth, kv, 0, **flags)
        steps.append(StepRecord("srv", 0, i, i * 0.02, b, 0, b, kv, 10**6, 0, depth,
                                np.full(b, min(depth, 1), np.int8) if depth
                                else np.array([], np.int8), latency,
                                warmup=warmup if flagged else None))
    return steps


@pytest.mark.parametrize("per_cell, draft_extend", [(True, True), (False, True),
                                                    (True, False)])
def test_a_flagged_plugin_trace_fits_off_and_the_warmup_as_they_ran(tmp_path, per_cell,
                                                                    draft_extend):
    """specctl-fit-profile on a trace the plugin recorded with its off path: flagged, its
    off steps are fitted as plain decodes and its warm-ups as SGLang's steps=0 with the
    extend, whatever ``draft_extend`` (which is about unflagged steps) says: the truth
    comes back; without the flag (an older trace) every depth-0 step is SGLang's steps=0,
    as before, and off is mispriced."""
    truth = load_profile("h200_llama31_8b")
    template = truth.replace(c_fixed=0.0, c_request=0.0, c_token=0.0, c_verify=0.0,
                             c_draft=0.0, c_draft_token=0.0)
    fits = {}
    for flagged in (True, False):
        path = write_trace(tmp_path / f"{flagged}.parquet", [], _plugin_steps(truth, flagged))
        fits[flagged], report = fit_profile_from_trace(read_trace(path), template,
                                                       per_cell=per_cell,
                                                       draft_extend=draft_extend)
        if flagged:
            assert len(report.points) == (15 if per_cell else 240)  # off apart from warm-ups
            assert report.median_abs_error < 1e-9
    for name in ("c_fixed", "c_request", "c_token", "c_verify", "c_draft", "c_draft_token"):
        assert getattr(fits[True], name) == pytest.approx(getattr(truth, name), rel=1e-6)
    off = {flagged: fit.step_latency_s(8, 0, 3200, 0, draft_extend=False,
                                       speculative_path=False) for flagged, fit in fits.items()}
    want = truth.step_latency_s(8, 0, 3200, 0, draft_extend=False, speculative_path=False)
    assert off[True] == pytest.approx(want, rel=1e-6)
    assert abs(off[False] / want - 1) > 0.2  # the old reading


def test_design_matrix_shape_and_eager():
    x = design_matrix([1, 100], [3, 3], cuda_graph_max_bs=64)
    assert x.shape == (2, len(COEFFICIENTS))
    eager = COEFFICIENTS.index("c_eager")
    assert x[:, eager].tolist() == [0.0, 1.0]


# -- the latency formula, term by term, from the module docstring -----------------------


def _documented_terms(b, d, kv, pf, ext, sp, f, cg, pairs=0.0, cached=0.0) -> dict[str, float]:
    """Each coefficient's term as env/cost_model.py's docstring writes the formula."""
    t = b * (d + 1) + pf
    spec, drafts = float(d > 0), max(d - 1, 0)
    extend = float(d > 0 or ext)
    eager = float(cg is not None and b > cg)
    path = float(b > 0 and (d > 0 or sp))  # a decode step on the speculative path
    return {
        "c_fixed": 1.0, "c_request": b, "c_token": t, "c_prefill_token": pf,
        "c_prefill_pair": pairs if pf else 0.0, "c_prefill_cached_token": cached if pf else 0.0,
        "c_moe": 1.0 - (1.0 - f) ** t, "c_kv": kv,
        "c_verify": spec, "c_verify_token": spec * b,
        "c_draft": drafts, "c_draft_token": drafts * b,
        "c_extend": extend, "c_extend_token": extend * t,
        "c_eager": eager, "c_eager_token": eager * b,
        "c_steps0": path, "c_steps0_request": path * b, "c_steps0_kv": path * kv,
    }


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(0, 300), depth=st.integers(0, 7), kv=st.integers(0, 500_000),
    prefill=st.sampled_from([0, 0, 1, 700, 8192]), pairs=st.floats(0.0, 1e8),
    cached=st.sampled_from([0.0, 1.0, 3072.0]), extend=st.booleans(),
    path=st.booleans(), moe=st.sampled_from([0.0, 1.0, 0.125, 0.5]),
    cg=st.sampled_from([None, 0, 8, 64, 160]),
    coefficients=st.lists(st.floats(0.0, 1.0), min_size=len(COEFFICIENTS),
                          max_size=len(COEFFICIENTS)),
)
def test_latency_is_the_documented_sum_of_terms(batch, depth, kv, prefill, pairs, cached, extend,
                                                path, moe, cg, coefficients):
    """Any coefficients, any server: the scalar and the vectorised latency both equal
    sum(c_i * term_i) with the docstring's terms (the shipped profiles leave several
    coefficients at 0, so only random ones reach every term)."""
    server = ServerLimits(256, 10**6, 8192, cuda_graph_max_bs=cg)
    c = dict(zip(COEFFICIENTS, coefficients, strict=True))
    profile = CostProfile("r", server, moe_active_fraction=moe, **c)
    terms = _documented_terms(batch, depth, kv, prefill, extend, path, moe, cg, pairs, cached)
    expected = sum(c[name] * terms[name] for name in COEFFICIENTS)
    args = (batch, depth, kv, prefill, extend, path, pairs, cached)
    assert profile.step_latency_s(*args) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert float(profile.step_latency_array(*args)[0]) == pytest.approx(expected, rel=1e-9,
                                                                        abs=1e-12)
    row = design_matrix(*args, moe_active_fraction=moe, cuda_graph_max_bs=cg)[0]
    np.testing.assert_allclose(row, [terms[n] for n in COEFFICIENTS], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", COEFFICIENTS)
def test_each_coefficient_prices_only_its_own_term(name):
    """One coefficient at 1, the rest 0, over a grid of steps around every threshold."""
    server = ServerLimits(256, 10**6, 8192, cuda_graph_max_bs=8)
    profile = CostProfile("one", server, moe_active_fraction=0.25, **{name: 1.0})
    for b, d, kv, pf, ext, sp in itertools.product(
            [0, 1, 8, 9], [0, 1, 2, 5], [0, 1000], [0, 300], [True, False], [True, False]):
        pairs = prefill_pairs(pf)
        expected = _documented_terms(b, d, kv, pf, ext, sp, 0.25, 8, pairs)[name]
        assert profile.step_latency_s(b, d, kv, pf, ext, sp, pairs) == pytest.approx(
            expected, rel=1e-12, abs=1e-15), (b, d, kv, pf, ext, sp)


def test_the_eager_cost_starts_above_the_largest_cuda_graph():
    """Issue 14: `>` -> `>=` survived, since every shipped profile has c_eager = 0."""
    p = CostProfile("e", ServerLimits(256, 10**6, 8192, cuda_graph_max_bs=16), c_eager=1.0,
                    c_eager_token=0.5)
    assert p.step_latency_s(16, 3) == 0.0 == float(p.step_latency_array(16, 3)[0])
    assert p.step_latency_s(17, 3) == 1.0 + 0.5 * 17 == float(p.step_latency_array(17, 3)[0])
    no_limit = p.replace(server=ServerLimits(256, 10**6, 8192))
    assert no_limit.step_latency_s(10**5, 3) == 0.0 == float(no_limit.step_latency_array(
        10**5, 3)[0])


@pytest.mark.parametrize(("server", "message"), [
    (dict(max_running_requests=0), "server.max_running_requests must be an integer >= 1, got 0"),
    (dict(kv_capacity_tokens=True), "server.kv_capacity_tokens must be an integer >= 1"),
    (dict(chunked_prefill_tokens=2.0), "server.chunked_prefill_tokens must be an integer"),
    (dict(cuda_graph_max_bs=-1), "server.cuda_graph_max_bs must be an integer >= 0, got -1"),
    (dict(cuda_graph_max_bs=False), "server.cuda_graph_max_bs must be an integer >= 0"),
    (dict(cuda_graph_max_bs=8.0), "server.cuda_graph_max_bs must be an integer >= 0"),
])
def test_server_limits_are_checked(server, message):
    fields = dict(max_running_requests=1, kv_capacity_tokens=1, chunked_prefill_tokens=1)
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerLimits(**{**fields, **server})
    assert ServerLimits(1, 1, 1, cuda_graph_max_bs=0).cuda_graph_max_bs == 0


@pytest.mark.parametrize(("changes", "message"), [
    (dict(c_token=-1e-9), "c_token must be finite and >= 0, got -1e-09"),
    (dict(c_kv=float("inf")), "c_kv must be finite and >= 0"),
    (dict(c_fixed=float("nan")), "c_fixed must be finite and >= 0"),
    (dict(c_draft=True), "c_draft must be a number, got True"),
    (dict(c_verify="1"), "c_verify must be a number, got '1'"),
    (dict(moe_active_fraction=1.5), "moe_active_fraction must be in [0, 1], got 1.5"),
    (dict(moe_active_fraction=-0.1), "moe_active_fraction must be in [0, 1], got -0.1"),
])
def test_coefficients_are_checked(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CostProfile("x", ServerLimits(1, 1, 1), **changes)
    ok = CostProfile("x", ServerLimits(1, 1, 1), c_token=0, moe_active_fraction=1)
    assert type(ok.c_token) is float and ok.coefficients["c_token"] == 0.0


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(colour=1), "unknown key 'colour'"),
    (lambda d: d.pop("cost"), "missing key 'cost'"),
    (lambda d: d.pop("name"), "missing key 'name'"),
    (lambda d: d.update(model=[1]), "'model' must be a mapping"),
    (lambda d: d.update(hardware="h"), "'hardware' must be a mapping"),
    (lambda d: d.update(provenance=3), "'provenance' must be a mapping"),
    (lambda d: d.update(server=[1]), "'server' must be a mapping"),
    (lambda d: d.update(cost="c"), "'cost' must be a mapping"),
    (lambda d: d.update(acceptance=[1]), "'acceptance' must be a mapping"),
    (lambda d: d["server"].update(gpus=8), "unknown key 'server.gpus'"),
    (lambda d: d["server"].pop("kv_capacity_tokens"), "server: "),
    (lambda d: d["server"].update(kv_capacity_tokens=0), "server.kv_capacity_tokens must be"),
    (lambda d: d["cost"].update(c_fixed=-1.0), "cost.c_fixed must be finite and >= 0"),
    (lambda d: d["cost"].update({k: 0.0 for k in COEFFICIENTS}),
     "cost: a decode step of one request takes 0.0 s"),
    (lambda d: d["cost"].update(c_prefill_token=0.0, c_token=0.0, c_fixed=0.0, c_moe=0.0,
                                c_extend=0.0, c_extend_token=0.0),
     "cost: a prefill step of 8192 tokens takes 0.0 s"),
])
def test_profile_files_name_the_bad_key(edit, message):
    data = load_profile("h200_llama31_8b").to_dict()
    data["cost"]["c_request"] = 1e-5  # a decode step still takes time without c_fixed
    edit(data)
    with pytest.raises(ProfileError, match=re.escape(message)) as info:
        profile_from_dict(data, "here.yaml")
    assert str(info.value).startswith("here.yaml: ")
    with pytest.raises(ProfileError, match=r"here\.yaml: expected a mapping at the top level"):
        profile_from_dict([data], "here.yaml")


def test_a_profile_file_round_trips_every_field(tmp_path):
    profile = CostProfile("full", ServerLimits(48, 123_456, 2048, cuda_graph_max_bs=32),
                          description="all fields", model={"params": 8}, hardware={"gpu": "x"},
                          acceptance={"model": "fixed"}, provenance={"by": "test"},
                          moe_active_fraction=0.125,
                          **{n: (i + 1) * 1e-5 for i, n in enumerate(COEFFICIENTS)})
    path = save_profile(profile, tmp_path / "sub" / "full.yaml")
    assert sorted(p.name for p in path.parent.iterdir()) == ["full.yaml"]
    back = load_profile(path)
    assert back == profile
    assert (back.description, back.model, back.hardware, back.acceptance, back.provenance) == (
        "all fields", {"params": 8}, {"gpu": "x"}, {"model": "fixed"}, {"by": "test"})
    bare = profile.replace(description="", acceptance=None)
    assert "description" not in bare.to_dict() and "acceptance" not in bare.to_dict()
    with pytest.raises(FileNotFoundError, match="no such profile file"):
        load_profile(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ProfileError, match=r"broken\.yaml: invalid YAML"):
        load_profile(tmp_path / "broken.yaml")


def test_defaults_are_the_documented_ones():
    """kv 0, no prefill, the draft extend and the speculative path on, a dense model."""
    server = ServerLimits(256, 10**6, 8192, cuda_graph_max_bs=8)
    p = CostProfile("d", server, **{n: (i + 1) * 1e-4 for i, n in enumerate(COEFFICIENTS)})
    for b, d in itertools.product([0, 1, 9], [0, 1, 3]):
        assert p.step_latency_s(b, d) == p.step_latency_s(b, d, 0, 0, True, True)
        assert float(p.step_latency_array(b, d)[0]) == pytest.approx(
            float(p.step_latency_array(b, d, 0, 0, True, True)[0]), rel=1e-12)
        np.testing.assert_array_equal(
            design_matrix(b, d), design_matrix(b, d, 0, 0, True, True, moe_active_fraction=0.0,
                                               cuda_graph_max_bs=None))


@pytest.mark.parametrize(("batch", "prefill", "expected"), [(0, 0, 0.0), (0, 1, 1.0),
                                                            (1, 0, 1.0), (0, 2, 1.0)])
def test_a_model_whose_every_token_reads_every_expert(batch, prefill, expected):
    """moe_active_fraction 1: any token reads all experts; a step of no token none."""
    p = CostProfile("m", ServerLimits(8, 100, 8), c_moe=1.0, moe_active_fraction=1.0)
    assert p.step_latency_s(batch, 0, 0, prefill) == expected
    assert float(p.step_latency_array(batch, 0, 0, prefill)[0]) == expected


@pytest.mark.parametrize("cost", [dict(c_eager=1.0), dict(c_verify=1.0), dict(c_draft=1.0)])
def test_a_profile_whose_plain_decode_step_is_free_is_refused(cost):
    """Priced only when batching past the CUDA graphs, or when speculating: a decode
    step of one request without speculation would take no time."""
    data = load_profile("h200_llama31_8b").to_dict()
    data["server"]["cuda_graph_max_bs"] = 1
    data["cost"] = {**{k: 0.0 for k in COEFFICIENTS}, "c_prefill_token": 1e-6, **cost}
    with pytest.raises(ProfileError) as info:
        profile_from_dict(data, "p.yaml")
    assert str(info.value) == (
        "p.yaml: cost: a decode step of one request takes 0.0 s under these coefficients; "
        "set c_fixed (or c_request / c_token and c_prefill_token) to the server's measured "
        "costs (see specctl-fit-profile)")


def test_optional_profile_keys_and_the_default_source():
    data = load_profile("h200_llama31_8b").to_dict()
    for key in ("description", "acceptance", "model", "hardware", "provenance"):
        data.pop(key, None)
    profile = profile_from_dict(data)
    assert (profile.description, profile.acceptance, profile.model, profile.hardware,
            profile.provenance) == ("", None, {}, {}, {})
    with pytest.raises(ProfileError) as info:
        profile_from_dict([])
    assert str(info.value) == "<dict>: expected a mapping at the top level"


@pytest.mark.parametrize("name", ["absent.yaml", "absent.yml", "some/dir/absent.txt"])
def test_a_path_to_no_file_is_not_looked_up_as_a_shipped_name(name):
    with pytest.raises(FileNotFoundError, match="no such profile file"):
        load_profile(name)


def test_saved_files_keep_the_documented_layout(tmp_path):
    path = save_profile(load_profile("h100_llama31_8b"), tmp_path / "a" / "b" / "p.yaml")
    assert list(yaml.safe_load(path.read_text())) == [
        "name", "description", "model", "hardware", "server", "cost", "acceptance",
        "provenance"]


# -- the fit, piece by piece (issue 14: its mutants were never run) ---------------------

POINTS = dict(batch_size=[1, 2, 3], depth=[0, 1, 2], kv_tokens=[0, 10, 20], prefill_tokens=0,
              latency_s=[0.01, 0.02, 0.03])


@pytest.mark.parametrize(("changes", "message"), [
    (dict(depth=[1, 2]), "points.depth has 2 entries, expected 3"),
    (dict(weight=[1.0, 1.0, 1.0, 1.0]), "points.weight has 4 entries, expected 3"),
    (dict(kv_tokens=[0, np.nan, 0]), "points.kv_tokens must be finite"),
    (dict(weight=[1, np.inf, 1]), "points.weight must be finite"),
    (dict(latency_s=[0.01, 0.0, 0.03]), "points.latency_s must be > 0"),
    (dict(latency_s=[0.01, 0.02, -1.0]), "points.latency_s must be > 0"),
    (dict(batch_size=[1, -1, 3]), "points.batch_size must be >= 0"),
    (dict(depth=[0, 1, -2]), "points.depth must be >= 0"),
    (dict(kv_tokens=[-1, 0, 0]), "points.kv_tokens must be >= 0"),
    (dict(prefill_tokens=-1), "points.prefill_tokens must be >= 0"),
    (dict(weight=[1, -0.5, 1]), "points.weight must be >= 0"),
    ({**{k: [] for k in POINTS}}, "no points to fit"),
])
def test_latency_points_are_checked(changes, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        LatencyPoints(**{**POINTS, **changes})


def test_latency_points_broadcast_one_value_and_accept_the_boundaries():
    p = LatencyPoints(**{**POINTS, "batch_size": [0, 0, 0], "depth": [[0, 0, 0]]},
                      weight=0, draft_extend=[0, 1, 2], speculative_path=False)
    assert len(p) == 3
    assert p.depth.tolist() == [0.0, 0.0, 0.0]  # flattened
    assert p.prefill_tokens.tolist() == [0.0, 0.0, 0.0] and p.prefill_tokens.dtype == np.float64
    assert p.weight.tolist() == [0.0, 0.0, 0.0]
    assert p.draft_extend.tolist() == [False, True, True] and p.draft_extend.dtype == bool
    assert p.speculative_path.tolist() == [False, False, False]
    assert p.speculative_path.dtype == bool
    # An absent field before the flags (weight) does not stop their conversion.
    flags = LatencyPoints(**POINTS, draft_extend=[0, 1, 2], speculative_path=[2, 0, 1])
    assert flags.weight is None and flags.draft_extend.tolist() == [False, True, True]
    assert flags.speculative_path.tolist() == [True, False, True]
    two = LatencyPoints([1, 2], 0, 0, 0, [0.1, 0.2])  # one value for two points
    assert two.depth.tolist() == [0.0, 0.0] and two.kv_tokens.tolist() == [0.0, 0.0]
    one = LatencyPoints(4, 1, 0, 0, 1e-300)
    assert (len(one), one.weight, one.draft_extend) == (1, None, None)


def test_latency_points_from_a_mapping():
    p = LatencyPoints.from_mapping({"batch": [1, 2], "depth": [0, 3], "latency_s": [0.1, 0.2]})
    assert p.batch_size.tolist() == [1.0, 2.0]
    assert p.kv_tokens.tolist() == [0.0, 0.0] and p.prefill_tokens.tolist() == [0.0, 0.0]
    given_ = LatencyPoints.from_mapping({"batch_size": [1], "depth": [0], "kv_tokens": [7],
                                         "prefill_tokens": [5], "latency_s": [0.1]})
    assert (given_.kv_tokens.tolist(), given_.prefill_tokens.tolist()) == ([7.0], [5.0])
    with pytest.raises(ValueError, match=r"^unknown point fields: \['batch'\]$"):
        LatencyPoints.from_mapping({"batch": [1], "batch_size": [1], "depth": [0],
                                    "latency_s": [0.1]})
    with pytest.raises(ValueError, match=r"^unknown point fields: \['colour', 'size'\]$"):
        LatencyPoints.from_mapping({"size": 1, "colour": 2, "batch": [1], "depth": [0],
                                    "latency_s": [0.1]})


def test_nnls_stops_after_max_iter_and_on_a_zero_matrix():
    a, b = np.eye(2), np.array([1.0, 2.0])
    np.testing.assert_array_equal(nnls(a, b), [1.0, 2.0])
    np.testing.assert_array_equal(nnls(a, b, max_iter=1), [0.0, 2.0])  # the larger gradient
    np.testing.assert_array_equal(nnls(np.zeros((3, 2)), np.ones(3)), [0.0, 0.0])
    # A negative target: the optimum is x = 0 on the boundary.
    np.testing.assert_array_equal(nnls(a, -b), [0.0, 0.0])


@pytest.mark.parametrize(("a", "b", "expected"), [
    # The unconstrained optimum (-0.25, 1.25) has x0 < 0: x0 = 0, x1 = mean(b) = 2/3.
    ([[3, 1], [1, 1], [3, 1]], [0, 1, 1], [0.0, 2 / 3]),
    # Columns 0 and 2 active: row 2 is fitted exactly (x2 = 1 + x0), then x0 minimises
    # (2 + x0)^2 + (3 - 2 x0)^2: x0 = 0.8; column 1's gradient there is -1.4 < 0.
    ([[1, 1, 0], [2, 1, 0], [2, -3, -2]], [-2, 3, -2], [0.8, 0.0, 1.8]),
])
def test_nnls_steps_back_when_a_variable_would_turn_negative(a, b, expected):
    """Cases (worked by hand) where the unconstrained optimum has a negative entry, so
    Lawson-Hanson's inner loop must step part way and drop a variable."""
    np.testing.assert_allclose(nnls(np.array(a, float), np.array(b, float)), expected,
                               rtol=1e-12, atol=1e-12)


def _design(n: int, **columns) -> np.ndarray:
    design = np.zeros((n, len(COEFFICIENTS)))
    for name, values in columns.items():
        design[:, COEFFICIENTS.index(name)] = values
    return design


def test_fit_coefficients_folds_ties_and_moves_fixed_terms_to_the_target():
    """c_fixed free; c_token tied to it (x2); c_request fixed by the template; c_moe tied
    to the fixed c_request (x3): the target is built from those values, so the fit must
    find c_fixed = 1 exactly, and every tie applied."""
    b, t, m = np.array([1.0, 2.0, 5.0, 7.0]), np.array([3.0, 1.0, 4.0, 9.0]), np.array(
        [0.5, 0.25, 1.0, 0.0])
    template = CostProfile("t", ServerLimits(8, 100, 8), c_request=0.5, c_fixed=9.0,
                           c_eager=4.0)
    target = 1.0 + 0.5 * b + 2.0 * t + 1.5 * m
    design = _design(4, c_fixed=1.0, c_request=b, c_token=t, c_moe=m)
    values = fit_coefficients(
        design, target, template=template, free=("c_fixed",),
        ties={"c_token": ("c_fixed", 2.0), "c_moe": ("c_request", 3.0)})
    assert list(values) == list(COEFFICIENTS)
    assert values["c_fixed"] == pytest.approx(1.0, rel=1e-12)
    assert values["c_token"] == pytest.approx(2.0, rel=1e-12)
    assert (values["c_request"], values["c_moe"], values["c_eager"]) == (0.5, 1.5, 4.0)
    assert values["c_verify"] == 0.0
    # A free coefficient whose column is all zero is 0, the others still fitted.
    values = fit_coefficients(_design(4, c_fixed=1.0), np.full(4, 3.0), template=template,
                              free=("c_eager", "c_fixed"), ties={})
    assert (values["c_eager"], values["c_fixed"]) == (0.0, pytest.approx(3.0, rel=1e-12))
    values = fit_coefficients(_design(4), np.full(4, 3.0), template=template,
                              free=("c_fixed",), ties={})
    assert values["c_fixed"] == 0.0


def test_the_fit_minimises_weighted_relative_errors():
    """One constant c for targets 1 and 2: sum ((c - y) / y)^2 is least at c = 1.2; a
    zero weight leaves the other point alone."""
    template = CostProfile("t", ServerLimits(8, 100, 8))
    design, target = _design(2, c_fixed=1.0), np.array([1.0, 2.0])
    kwargs = dict(template=template, free=("c_fixed",), ties={})
    assert fit_coefficients(design, target, **kwargs)["c_fixed"] == pytest.approx(1.2)
    assert fit_coefficients(design, target, weight=np.array([0.0, 1.0]),
                            **kwargs)["c_fixed"] == pytest.approx(2.0)
    assert fit_coefficients(design, target, weight=np.array([4.0, 1.0]),
                            **kwargs)["c_fixed"] == pytest.approx((4 + 0.5) / (4 + 0.25))
    with pytest.raises(ValueError, match=rf"^design must have shape \(2, {len(COEFFICIENTS)}\)$"):
        fit_coefficients(design[:, 1:], target, **kwargs)
    with pytest.raises(ValueError, match=rf"^design must have shape \(3, {len(COEFFICIENTS)}\)$"):
        fit_coefficients(design, np.ones(3), **kwargs)
    with pytest.raises(ValueError, match=r"^targets must be > 0$"):
        fit_coefficients(design, np.array([1.0, 0.0]), **kwargs)


def test_unidentifiable_names_the_columns_the_others_span():
    template = CostProfile("t", ServerLimits(8, 100, 8))
    target = np.array([1.0, 2.0, 4.0])
    kwargs = dict(template=template, ties={})
    design = _design(3, c_fixed=1.0, c_request=[4.0, 4.0, 4.0], c_token=[1.0, 2.0, 3.0],
                     c_kv=[2.0, 3.0, 4.0])  # c_kv = c_fixed + c_token
    free = ("c_fixed", "c_request", "c_eager", "c_token", "c_kv")
    assert unidentifiable(design, target, free=free, **kwargs) == [
        "c_request", "c_eager", "c_kv"]
    assert unidentifiable(design, target, free=("c_token", "c_kv"), **kwargs) == []
    # Columns are compared by direction, not size: a tiny column still counts...
    tiny = _design(3, c_fixed=1.0, c_request=[1e-7, 2e-7, 3e-7])
    assert unidentifiable(tiny, np.full(3, 1e3), free=("c_fixed", "c_request"),
                          **kwargs) == []
    # ... and one within 1e-9 of the span of the others (relative) does not.
    near = design.copy()
    near[:, COEFFICIENTS.index("c_kv")] += [1e-11, -1e-11, 0.0]
    assert unidentifiable(near, target, free=("c_fixed", "c_token", "c_kv"),
                          **kwargs) == ["c_kv"]
    # A tie folds a column into its partner's: c_kv tied to c_token is no column of its own.
    assert unidentifiable(design, target, free=("c_fixed", "c_token"), template=template,
                          ties={"c_kv": ("c_token", 1.0)}) == []


_UNKNOWN = f"unknown coefficient 'c_magic'; choose from {COEFFICIENTS}"


@pytest.mark.parametrize(("free", "ties", "message"), [
    (("c_magic",), {}, _UNKNOWN),
    (("c_fixed",), {"c_magic": ("c_fixed", 1.0)}, _UNKNOWN),
    (("c_fixed",), {"c_token": ("c_magic", 1.0)}, _UNKNOWN),
    (("c_fixed", "c_token", "c_fixed"), {}, "free coefficients repeat: ('c_fixed', "
     "'c_token', 'c_fixed')"),
    (("c_fixed", "c_token"), {"c_token": ("c_fixed", 1.0)}, "c_token is both free and tied"),
    (("c_fixed",), {"c_extend": ("c_draft", 1.0), "c_draft": ("c_fixed", 1.0)},
     "c_extend is tied to c_draft, which is tied itself"),
    (("c_fixed",), {"c_token": ("c_fixed", -0.5)}, "tie factor of c_token must be >= 0, got -0.5"),
])
def test_a_fit_spec_is_checked(free, ties, message):
    points = LatencyPoints(**POINTS)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fit_profile(points, template=random_profile(np.random.default_rng(0)), free=free,
                    ties=ties)


def test_a_fit_with_no_ties_and_a_zero_tie_factor():
    truth = random_profile(np.random.default_rng(1)).replace(c_extend=0.0, c_extend_token=0.0)
    b, d = np.array(list(itertools.product([1, 4, 16, 32], [0, 1, 2, 5]))).T
    points = LatencyPoints(b, d, b * 100, 0, truth.step_latency_array(b, d, b * 100, 0))
    template = truth.replace(c_fixed=0.0, c_draft=0.0, c_extend=5.0, c_extend_token=7.0)
    fitted, _ = fit_profile(points, template=template, free=("c_fixed", "c_draft"),
                            ties={"c_extend": ("c_draft", 0.0)})
    assert (fitted.c_extend, fitted.c_extend_token) == (0.0, 7.0)  # the tie; the template
    assert fitted.provenance["fit"]["ties"] == {"c_extend": ["c_draft", 0.0]}
    fitted, _ = fit_profile(points, template=template.replace(c_extend_token=0.0),
                            free=("c_fixed", "c_draft"), ties={})
    assert fitted.c_extend == 5.0 and fitted.provenance["fit"]["ties"] == {}


def test_a_fit_keeps_the_templates_provenance_and_records_its_own():
    truth = random_profile(np.random.default_rng(2))
    b, d = np.array(list(itertools.product([1, 8, 32], [0, 1, 3]))).T
    points = LatencyPoints(b, d, b * 100, 0, truth.step_latency_array(b, d, b * 100, 0))
    template = truth.replace(provenance={"calibrated_to": "x"})
    fitted, report = fit_profile(points, template=template, free=("c_fixed", "c_verify"))
    fit = fitted.provenance["fit"]
    assert fitted.provenance["calibrated_to"] == "x" and "fit" not in template.provenance
    assert fit == {**report.summary(), "free": ["c_fixed", "c_verify"],
                   "ties": {"c_extend": ["c_draft", 1.0], "c_extend_token": ["c_token", 0.05]}}
    assert report.free == ("c_fixed", "c_verify") and report.points is points
    assert fitted.c_fixed == pytest.approx(truth.c_fixed, rel=1e-9)


def test_a_fit_prices_the_templates_fixed_terms_per_point():
    """MoE saturation, eager batches past the CUDA graphs and the speculative-path flag
    of each point all enter the design: the fixed terms are then subtracted exactly."""
    server = ServerLimits(256, 10**6, 8192, cuda_graph_max_bs=8)
    truth = CostProfile("t", server, moe_active_fraction=0.25, c_moe=2e-3, c_eager=1e-3,
                        c_eager_token=1e-5, c_steps0=5e-4, c_steps0_request=1e-5,
                        c_fixed=4e-3, c_request=5e-5, c_token=2e-5, c_verify=1e-3,
                        c_draft=8e-4, c_draft_token=1e-5, c_extend=8e-4, c_extend_token=1e-6)
    b, d = np.array(list(itertools.product([1, 4, 16, 32], [0, 1, 2, 5]))).T
    sp = np.arange(len(b)) % 3 != 0
    points = LatencyPoints(b, d, b * 100, 0, truth.step_latency_array(b, d, b * 100, 0, True, sp),
                           speculative_path=sp)
    free = ("c_fixed", "c_request", "c_token", "c_verify", "c_draft")
    template = truth.replace(**dict.fromkeys(free, 0.0))
    fitted, report = fit_profile(points, template=template, free=free, ties={})
    assert report.worst_abs_error < 1e-9
    for name in free:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_a_fit_weights_its_points():
    truth = random_profile(np.random.default_rng(10))
    b, d = np.array(list(itertools.product([1, 4, 16, 32], [0, 1, 3]))).T
    latency = truth.step_latency_array(b, d, b * 100, 0)
    latency[5] *= 3.0  # a bad point, weighted 0: the fit is exact on the others
    weight = np.ones(len(b))
    weight[5] = 0.0
    template = truth.replace(c_fixed=0.0, c_draft=0.0)
    points = LatencyPoints(b, d, b * 100, 0, latency, weight=weight)
    fitted, _ = fit_profile(points, template=template, free=("c_fixed", "c_draft"))
    assert fitted.c_fixed == pytest.approx(truth.c_fixed, rel=1e-9)
    assert fitted.c_draft == pytest.approx(truth.c_draft, rel=1e-9)
    # Only zero-weight points speculate: c_verify cannot be told from them.
    weight = (d == 0).astype(float)
    with pytest.raises(UnidentifiableFitError) as info:
        fit_profile(LatencyPoints(b, d, b * 100, 0, latency, weight=weight), template=template,
                    free=("c_fixed", "c_request", "c_verify"))
    assert info.value.coefficients == ("c_verify",)


def test_an_unidentifiable_fit_names_the_coefficients_the_cells_and_what_is_needed():
    template = random_profile(np.random.default_rng(3))
    b = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    points = LatencyPoints(b, 0, 0, 0, template.step_latency_array(b, 0))
    with pytest.raises(UnidentifiableFitError) as info:
        fit_profile(points, template=template, free=("c_fixed", "c_request", "c_verify",
                                                      "c_draft_token"))
    assert info.value.coefficients == ("c_verify", "c_draft_token")
    assert str(info.value) == (
        "cannot fit c_verify, c_draft_token from 9 point(s) in 9 (batch size, depth) "
        "cell(s) [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0) ...]: the "
        "data does not tell them apart from the other free coefficients. Needed: c_verify: "
        "steps at depth 0 and at depth >= 1; c_draft_token: steps at depth >= 2 at several "
        "batch sizes. Record with SPECCTL_RECORD_EXPLORE=1 under a varying load, or fit "
        "fewer coefficients (free=...; the rest keep the template's values).")
    # Eight cells are all shown; a coefficient without its own hint gets the general one.
    with pytest.raises(UnidentifiableFitError) as info:
        fit_profile(LatencyPoints(b[:8], 1, 0, 0, template.step_latency_array(b[:8], 1)),
                    template=template, free=("c_fixed", "c_steps0"))
    assert ("in 8 (batch size, depth) cell(s) [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), "
            "(6, 1), (7, 1), (8, 1)]: ") in str(info.value)
    assert "Needed: c_steps0: points that vary its term. Record" in str(info.value)


def _flat_report(latency_s, c_fixed=0.01, **points) -> FitReport:
    """Every step predicted at ``c_fixed`` (10 ms), against ``latency_s``."""
    profile = CostProfile("flat", ServerLimits(8, 100, 8), c_fixed=c_fixed)
    n = len(latency_s)
    fields = {"batch_size": np.arange(n) + 1, "depth": 2, "kv_tokens": np.arange(n) * 10,
              "prefill_tokens": 0, **points}
    return FitReport.evaluate(profile, LatencyPoints(latency_s=latency_s, **fields))


def test_a_fit_report_summary_by_hand():
    # Predicted 12.3456789 ms; errors 0, 12.3456789 / 3.12345678 - 1 = 2.9525691...,
    # 12.3456789 / 12.5 - 1 = -0.0123456...: rounded to 5 places, the times to 4.
    p = 0.0123456789
    report = _flat_report([p, 0.00312345678, 0.0125], c_fixed=p, prefill_tokens=[0, 7, 0])
    np.testing.assert_allclose(report.relative_errors, [0.0, 2.9525691468, -0.012345688],
                               rtol=1e-9)
    summary = report.summary()
    assert summary == {
        "points": 3, "median_abs_rel_error": 0.01235, "worst_abs_rel_error": 2.95257,
        "worst_point": {"batch_size": 2, "depth": 2, "kv_tokens": 10, "prefill_tokens": 7,
                        "measured_ms": 3.1235, "predicted_ms": 12.3457}}
    assert all(type(v) is int for k, v in summary["worst_point"].items() if "ms" not in k)
    assert (report.worst_index, report.free) == (1, ())


def test_a_fit_report_prices_the_extend_and_the_path_per_point():
    server = ServerLimits(8, 100, 8)
    profile = CostProfile("e", server, c_fixed=0.01, c_extend=0.002, c_steps0=0.004)
    points = LatencyPoints([1, 1, 1, 1], 0, 0, 0, [0.016] * 4,
                           draft_extend=[True, False, True, False],
                           speculative_path=[True, True, False, False])
    report = FitReport.evaluate(profile, points)
    np.testing.assert_allclose(report.predicted_s, [0.016, 0.014, 0.012, 0.010], rtol=1e-12)
    defaults = FitReport.evaluate(profile, LatencyPoints([1], 0, 0, 0, [0.016]))
    np.testing.assert_allclose(defaults.predicted_s, [0.016], rtol=1e-12)


def test_a_fit_report_prints_one_row_per_point_then_the_notes():
    report = _flat_report([0.008, 0.0125])
    report = FitReport(**{**report.__dict__, "notes": ("note one", "note two")})
    assert str(report).splitlines() == [
        " batch depth       kv prefill measured ms  model ms   error",
        "     1     2        0       0       8.000    10.000 +25.00%",
        "     2     2       10       0      12.500    10.000 -20.00%",
        "2 points: median |error| 22.50%, worst 25.00% (point 0)",
        "note one",
        "note two",
    ]


def _step(i: int, batch: int, depth: int, latency: float, *, rank: int = 0, server: str = "s",
          prefill: int = 0, kv: int = 1000) -> StepRecord:
    return StepRecord(server, rank, i, i * 0.01, batch, 0, batch, kv, 10**6, prefill,
                      0 if prefill else depth, np.array([], np.int8), latency)


def _trace(steps) -> Trace:
    return Trace(RequestColumns.empty(), list(steps))


def test_trace_points_come_from_the_lowest_rank_of_each_server():
    steps = [
        _step(0, 4, 1, 0.010, server="a", rank=1), _step(0, 4, 1, 0.500, server="a", rank=2),
        _step(0, 2, 0, 0.020, server="b", rank=0), _step(1, 2, 0, 0.900, server="b", rank=3),
        _step(1, 0, 0, 0.030, server="a", rank=1),  # no decoding request
        _step(2, 3, 0, 0.0, server="a", rank=1),  # no latency
        _step(3, 0, 0, 0.040, server="a", rank=1, prefill=100),  # a prefill step
    ]
    points = points_from_trace(_trace(steps), per_cell=False, draft_extend=False)
    assert points.batch_size.tolist() == [4.0, 2.0]
    assert points.depth.tolist() == [1.0, 0.0]
    assert points.latency_s.tolist() == [0.010, 0.020]
    assert points.kv_tokens.tolist() == [1000.0, 1000.0]
    assert points.prefill_tokens.tolist() == [0.0, 0.0]
    assert points.draft_extend.tolist() == [False, False]
    assert points_from_trace(_trace(steps), per_cell=False).draft_extend.tolist() == [True] * 2


def test_trace_points_without_decode_steps_are_refused():
    with pytest.raises(ValueError, match=r"^the trace holds no step records$"):
        points_from_trace(_trace([]))
    only = [_step(0, 0, 0, 0.01, prefill=50), _step(1, 2, 1, 0.0), _step(2, 0, 1, 0.01)]
    with pytest.raises(ValueError, match=r"^the trace holds no decode step with a positive "
                       r"latency$"):
        points_from_trace(_trace(only))


def test_a_step_exactly_at_the_non_physical_ratio_is_kept(caplog):
    steps = [_step(i, 2, 1, 0.01) for i in range(5)]
    kept = points_from_trace(_trace([*steps, _step(5, 2, 1, 0.01 * 100)]), per_cell=False)
    assert len(kept) == 6 and not caplog.records
    dropped = points_from_trace(_trace([*steps, _step(5, 2, 1, 1.0000001)]), per_cell=False)
    assert len(dropped) == 5
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "left out 1 decode step(s) more than 100x slower than the median decode "
         "step (not physical)")]


def test_per_cell_points_are_the_medians_of_cells_with_enough_steps():
    steps = [_step(i, 2, 1, 0.01 * (i + 1), kv=100 * i) for i in range(5)]  # 5: kept
    steps += [_step(10 + i, 4, 0, 0.05, kv=7) for i in range(4)]  # 4: too few
    steps += [_step(20 + i, 1, 3, 0.002 * (i + 1), kv=10 * i) for i in range(6)]
    points = points_from_trace(_trace(steps))
    assert (points.batch_size.tolist(), points.depth.tolist()) == ([1.0, 2.0], [3.0, 1.0])
    assert points.latency_s.tolist() == pytest.approx([0.007, 0.03])  # medians
    assert points.kv_tokens.tolist() == [25.0, 200.0]
    assert points.prefill_tokens.tolist() == [0.0, 0.0]
    assert len(points_from_trace(_trace(steps), min_steps=4)) == 3
    with pytest.raises(ValueError, match=r"^no \(batch size, depth\) cell has 7 decode steps$"):
        points_from_trace(_trace(steps), min_steps=7)


def _exact_trace(truth: CostProfile, prefills=(), draft_extend=True):
    """Five exact steps per (batch, depth) cell of a grid, then prefill steps."""
    cells = list(itertools.product([1, 4, 16, 32], [0, 1, 2, 5])) * 5
    steps = [_step(i, b, d, truth.step_latency_s(b, d, 1000, 0, draft_extend))
             for i, (b, d) in enumerate(cells)]
    for k, (tokens, latency) in enumerate(prefills):
        steps.append(_step(len(cells) + k, 0, 0, latency, prefill=tokens, kv=500))
    return _trace(steps)


def test_the_prefill_cost_is_the_median_rest_of_long_prefill_steps():
    truth = random_profile(np.random.default_rng(6)).replace(c_prefill_token=3e-5)
    template = truth.replace(c_fixed=0.0, c_request=0.0, c_prefill_token=7e-4)

    def prefill_s(tokens, scale=1.0):
        rest = truth.replace(c_prefill_token=0.0).step_latency_s(0, 0, 500, tokens)
        return rest + scale * 3e-5 * tokens

    # 1000 tokens is long enough; the median of the three rests per token is 3e-5.
    trace = _exact_trace(truth, [(1000, prefill_s(1000)), (4000, prefill_s(4000, 0.5)),
                                 (2000, prefill_s(2000, 2.0)), (999, 5.0), (3000, 0.0)])
    fitted, report = fit_profile_from_trace(trace, template)
    assert fitted.c_fixed == pytest.approx(truth.c_fixed, rel=1e-6)
    assert fitted.c_prefill_token == pytest.approx(3e-5, rel=1e-6)
    assert report.notes == () and len(report.points) == 16
    # Shorter prefills only: the template's value stays.
    short, _ = fit_profile_from_trace(_exact_trace(truth, [(999, 5.0)]), template)
    assert short.c_prefill_token == 7e-4
    # A prefill faster than the other terms: no negative cost.
    fast, _ = fit_profile_from_trace(_exact_trace(truth, [(1000, 1e-9)]), template)
    assert fast.c_prefill_token == 0.0


def test_a_trace_fit_without_the_draft_extend_prices_prefills_without_it():
    truth = random_profile(np.random.default_rng(7)).replace(c_prefill_token=3e-5)
    rest = truth.replace(c_prefill_token=0.0).step_latency_s(0, 0, 500, 2000, False)
    trace = _exact_trace(truth, [(2000, rest + 3e-5 * 2000)], draft_extend=False)
    fitted, _ = fit_profile_from_trace(trace, truth.replace(c_fixed=0.0), draft_extend=False)
    assert fitted.c_fixed == pytest.approx(truth.c_fixed, rel=1e-6)
    assert fitted.c_prefill_token == pytest.approx(3e-5, rel=1e-6)


def test_a_trace_fit_fits_the_coefficients_and_ties_it_is_given():
    truth = random_profile(np.random.default_rng(9)).replace(c_extend=3e-4)  # not c_draft
    template = truth.replace(c_fixed=0.0, c_draft=0.0)
    fitted, report = fit_profile_from_trace(_exact_trace(truth), template,
                                            free=("c_fixed", "c_draft"), ties={})
    assert report.free == ("c_fixed", "c_draft")
    assert fitted.provenance["fit"]["free"] == ["c_fixed", "c_draft"]
    assert fitted.provenance["fit"]["ties"] == {} and fitted.c_extend == 3e-4  # not tied
    assert fitted.c_draft == pytest.approx(truth.c_draft, rel=1e-6)


def test_a_trace_fit_per_step_and_its_note_on_dropped_steps():
    truth = random_profile(np.random.default_rng(8))
    trace = _exact_trace(truth)
    trace.steps.append(_step(999, 4, 1, 1e3))
    fitted, report = fit_profile_from_trace(trace, truth.replace(c_fixed=0.0), per_cell=False)
    assert len(report.points) == 80 and fitted.c_fixed == pytest.approx(truth.c_fixed, rel=1e-6)
    assert report.notes == ("left out 1 decode step(s) more than 100x slower than the median "
                            "decode step (not physical)",)

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
    design_matrix,
    fit_profile,
    fit_profile_from_trace,
    load_profile,
    nnls,
    profile_from_dict,
    save_profile,
    shipped_profiles,
)
from env.sim.fit_profile import main as fit_profile_main
from env.sim.off_cost import dense_h200_points, fit_off_path
from env.traces.schema import StepRecord
from env.traces.trace_format import read_trace, write_trace

MEASURED = h200.default_measured_dir()  # shipped with the package
NAMES = ["blackwell_tp8", "h100_llama31_8b", "h200_llama31_8b", "h200_llama31_8b_recorded",
         "h200_qwen3_30b_a3b"]


def test_shipped_profiles_load():
    assert shipped_profiles() == NAMES
    for name in NAMES:
        profile = load_profile(name)
        assert profile.name == name
        assert profile.acceptance is not None and "model" in profile.acceptance
        assert profile.provenance.get("calibrated_to")


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
    # Exhaustive search over active sets gives the optimum.
    best = np.sum(b**2)
    for k in range(1, n + 1):
        for subset in itertools.combinations(range(n), k):
            sol = np.linalg.lstsq(a[:, subset], b, rcond=None)[0]
            if np.all(sol >= 0):
                best = min(best, np.sum((a[:, subset] @ sol - b) ** 2))
    assert np.sum((a @ x - b) ** 2) == pytest.approx(best, rel=1e-7, abs=1e-9)


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


def test_design_matrix_shape_and_eager():
    x = design_matrix([1, 100], [3, 3], cuda_graph_max_bs=64)
    assert x.shape == (2, len(COEFFICIENTS))
    eager = COEFFICIENTS.index("c_eager")
    assert x[:, eager].tolist() == [0.0, 1.0]


# -- the latency formula, term by term, from the module docstring -----------------------


def _documented_terms(b, d, kv, pf, ext, sp, f, cg) -> dict[str, float]:
    """Each coefficient's term as env/cost_model.py's docstring writes the formula."""
    t = b * (d + 1) + pf
    spec, drafts = float(d > 0), max(d - 1, 0)
    extend = float(d > 0 or ext)
    eager = float(cg is not None and b > cg)
    path = float(b > 0 and (d > 0 or sp))  # a decode step on the speculative path
    return {
        "c_fixed": 1.0, "c_request": b, "c_token": t, "c_prefill_token": pf,
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
    prefill=st.sampled_from([0, 0, 1, 700, 8192]), extend=st.booleans(),
    path=st.booleans(), moe=st.sampled_from([0.0, 1.0, 0.125, 0.5]),
    cg=st.sampled_from([None, 0, 8, 64, 160]),
    coefficients=st.lists(st.floats(0.0, 1.0), min_size=len(COEFFICIENTS),
                          max_size=len(COEFFICIENTS)),
)
def test_latency_is_the_documented_sum_of_terms(batch, depth, kv, prefill, extend, path, moe,
                                                cg, coefficients):
    """Any coefficients, any server: the scalar and the vectorised latency both equal
    sum(c_i * term_i) with the docstring's terms (the shipped profiles leave several
    coefficients at 0, so only random ones reach every term)."""
    server = ServerLimits(256, 10**6, 8192, cuda_graph_max_bs=cg)
    c = dict(zip(COEFFICIENTS, coefficients, strict=True))
    profile = CostProfile("r", server, moe_active_fraction=moe, **c)
    terms = _documented_terms(batch, depth, kv, prefill, extend, path, moe, cg)
    expected = sum(c[name] * terms[name] for name in COEFFICIENTS)
    args = (batch, depth, kv, prefill, extend, path)
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
        expected = _documented_terms(b, d, kv, pf, ext, sp, 0.25, 8)[name]
        assert profile.step_latency_s(b, d, kv, pf, ext, sp) == pytest.approx(
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

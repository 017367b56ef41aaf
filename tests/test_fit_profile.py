"""specctl-fit-profile on traces that cannot (or only partly) determine a profile, and
profiles that describe no server."""

from __future__ import annotations

import re

import numpy as np
import pytest

from env.scenarios import ScenarioSampler
from env.sim.cost_model import (
    COEFFICIENTS,
    ProfileError,
    UnidentifiableFitError,
    fit_profile_from_trace,
    load_profile,
    prefill_pairs,
    save_profile,
)
from env.sim.fit_profile import main as fit_profile_main
from env.traces.schema import StepRecord
from env.traces.trace_format import TraceWriter, read_trace, write_trace

TRUTH = load_profile("h200_llama31_8b")


def decode_trace(tmp_path, cells, steps_per_cell=20, wild=None):
    """Decode steps cycling through (batch, depth) cells; step ``wild`` takes 1e300 s."""
    rng = np.random.default_rng(0)
    steps = []
    for i in range(steps_per_cell * len(cells)):
        batch, depth = cells[i % len(cells)]
        latency = TRUTH.step_latency_s(batch, depth, 1000, 0) * rng.lognormal(0.0, 0.01)
        steps.append(StepRecord("s", 0, i, i * 0.02, batch, 0, batch, 1000, 10**6, 0, depth,
                                np.array([], np.int8), 1e300 if i == wild else latency))
    return write_trace(tmp_path / "trace.parquet", [], steps, {})


SPREAD = [(b, d) for b in (1, 4, 16, 48) for d in (0, 1, 3, 6)]


def test_a_one_cell_trace_is_refused_naming_what_it_cannot_fit(tmp_path, capsys):
    # Regression: six coefficients were fitted from one point, "median 0.00%", exit 0.
    path = decode_trace(tmp_path, [(8, 3)])
    with pytest.raises(UnidentifiableFitError) as exc:
        fit_profile_from_trace(read_trace(path), TRUTH)
    assert set(exc.value.coefficients) == {"c_request", "c_token", "c_verify", "c_draft",
                                           "c_draft_token"}
    assert "1 point(s) in 1 (batch size, depth) cell(s) [(8, 3)]" in str(exc.value)
    with pytest.raises(SystemExit) as exit_:
        fit_profile_main([f"trace={path}", f"out={tmp_path / 'p.yaml'}"])
    assert exit_.value.code == 2
    assert not (tmp_path / "p.yaml").exists()
    printed = capsys.readouterr()
    assert "median |error|" not in printed.out
    assert printed.err.startswith("specctl-fit-profile: error: trace=")
    assert "cannot fit c_request" in printed.err and printed.err.count("\n") == 1


def test_only_the_coefficients_the_depths_cannot_separate_are_named(tmp_path):
    path = decode_trace(tmp_path, [(b, d) for b in (1, 4, 16) for d in (0, 1)])
    with pytest.raises(UnidentifiableFitError, match="c_draft: steps at depth 1 and at depth"
                       ) as exc:
        fit_profile_from_trace(read_trace(path), TRUTH)
    assert exc.value.coefficients == ("c_draft", "c_draft_token")
    # fitting only what the data determines works
    _, report = fit_profile_from_trace(read_trace(path), TRUTH,
                                       free=("c_fixed", "c_request", "c_token", "c_verify"))
    assert report.median_abs_error < 0.02


@pytest.mark.parametrize("per_cell", [True, False])
def test_a_non_physical_latency_is_left_out_and_counted(tmp_path, per_cell, capsys):
    # Regression: one 1e300 s step entered the fit silently.
    clean_fit, _ = fit_profile_from_trace(read_trace(decode_trace(tmp_path, SPREAD)), TRUTH,
                                          per_cell=per_cell)
    path = decode_trace(tmp_path, SPREAD, wild=7)
    fitted, report = fit_profile_from_trace(read_trace(path), TRUTH, per_cell=per_cell)
    assert report.notes == ("left out 1 decode step(s) more than 100x slower than the median "
                            "decode step (not physical)",)
    assert report.worst_abs_error < 0.05
    assert len(report.points) == (len(SPREAD) if per_cell else 20 * len(SPREAD) - 1)
    for name in ("c_fixed", "c_request", "c_draft"):
        assert getattr(fitted, name) == pytest.approx(getattr(clean_fit, name), rel=0.05)
    assert fit_profile_main([f"trace={path}", f"per_cell={str(per_cell).lower()}"]) == 0
    assert "left out 1 decode step(s)" in capsys.readouterr().out


def test_a_bad_trace_path_is_a_clean_exit(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        fit_profile_main([f"trace={tmp_path / 'missing.parquet'}"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"specctl-fit-profile: error: trace={tmp_path / 'missing.parquet'}: no such file\n")


@pytest.mark.parametrize(
    ("zeroed", "expected"),
    [
        (COEFFICIENTS, "cost: a decode step of one request takes 0.0 s"),
        (tuple(c for c in COEFFICIENTS if c != "c_request"),  # only a per-request cost
         "cost: a prefill step of 8192 tokens takes 0.0 s"),
    ],
)
def test_a_profile_whose_steps_take_no_time_is_refused_on_load(tmp_path, zeroed, expected):
    # Regression: an all-zero-cost profile was a ZeroDivisionError in specctl-eval.
    path = save_profile(TRUTH.replace(**dict.fromkeys(zeroed, 0.0)), tmp_path / "zero.yaml")
    assert TRUTH.server.chunked_prefill_tokens == 8192
    with pytest.raises(ProfileError, match=re.escape(f"{path}: {expected}")):
        load_profile(path)
    env = {"horizon_s": 10.0, "profiles": [str(path)],
           "workloads": [{"name": "azure_conv", "load": [1.0]}]}
    with pytest.raises(ProfileError, match=re.escape(str(path))):
        ScenarioSampler(env, split="eval").evaluation(windows=1)


def test_a_directory_of_two_recording_runs_is_fitted(tmp_path):
    # Regression: a server restarted into its SPECCTL_RECORD directory made the directory
    # (and so specctl-fit-profile) fail with "step_index must strictly increase".
    single = read_trace(decode_trace(tmp_path, SPREAD)).steps
    runs = tmp_path / "runs"
    for run in ("20261201T100000Z-aaaaaa", "20261201T110000Z-bbbbbb"):
        with TraceWriter(runs / "trace", server="s", rank=0, run_id=run) as writer:
            for step in single:
                writer.add_step(step)
    assert fit_profile_main([f"trace={runs}"]) == 0


@pytest.mark.parametrize("longest", [1024, 4096])
def test_long_prompts_fit_the_prefill_attention_term_when_asked(tmp_path, longest, capsys):
    """prefill_pairs=true: whole prompts from 128 to 4,096 tokens identify the per-pair
    prefill term; up to 1,024 they do not, and the fit is refused saying why. Without
    the key the term stays the template's (0)."""
    truth = TRUTH.replace(c_prefill_pair=5e-9)
    steps = list(read_trace(decode_trace(tmp_path, SPREAD)).steps)
    lengths = [n for n in (128, 256, 512, 1024, 2048, 4096) if n <= longest] * 3
    for k, n in enumerate(lengths):
        latency = truth.step_latency_s(0, 0, 1000, n, prefill_pairs=prefill_pairs(n))
        steps.append(StepRecord("s", 0, len(steps), 100.0 + k, 1, 0, 1, 1000, 10**6, n, 0,
                                np.array([], np.int8), latency))
    trace = write_trace(tmp_path / "mixed.parquet", [], steps, {})
    out = tmp_path / "fitted.yaml"
    assert fit_profile_main([f"trace={trace}", f"out={out}"]) == 0
    assert load_profile(out).c_prefill_pair == 0.0
    asked = [f"trace={trace}", f"out={out}", "prefill_pairs=true"]
    if longest == 4096:
        assert fit_profile_main(asked) == 0
        assert load_profile(out).c_prefill_pair == pytest.approx(5e-9, rel=0.1)
        assert "c_prefill_pair = " in capsys.readouterr().out
    else:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            fit_profile_main(asked)
        assert exit_.value.code == 2
        assert "prefill_pairs=true needs whole prompts from under 512 to at least 2048" in (
            capsys.readouterr().err)


def test_a_trace_with_recorded_pairs_fits_them_whatever_its_prompts(tmp_path, capsys):
    """The plugin's prefill_pairs column: prompts after cached prefixes and mixed lengths,
    none of which the reckoned pairs would take, fit the term."""
    truth = TRUTH.replace(c_prefill_pair=5e-9)
    steps = list(read_trace(decode_trace(tmp_path, SPREAD)).steps)
    for k, (new, done) in enumerate([(512, 3072), (256, 0), (3000, 1000), (1024, 0)] * 3):
        pairs = prefill_pairs(new, done)
        latency = truth.step_latency_s(0, 0, 1000, new, prefill_pairs=pairs)
        steps.append(StepRecord("s", 0, len(steps), 100.0 + k, 1, 0, 1, 1000, 10**6, new, 0,
                                np.array([], np.int8), latency, prefill_pairs=pairs))
    trace = write_trace(tmp_path / "recorded.parquet", [], steps, {})
    out = tmp_path / "fitted.yaml"
    assert fit_profile_main([f"trace={trace}", f"out={out}", "prefill_pairs=true"]) == 0
    assert load_profile(out).c_prefill_pair == pytest.approx(5e-9, rel=0.05)

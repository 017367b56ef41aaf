"""env.load_fit: the KV and prefill terms are recovered from steps made with known coefficients."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env.cost_model import CostProfile, ServerLimits
from env.load_fit import StepArrays, fit_load_profile, load_points

SERVER = ServerLimits(max_running_requests=64, kv_capacity_tokens=200_000,
                      chunked_prefill_tokens=8192)
#: At depth 0 the columns of c_request (batch), c_token (batch + prompt) and
#: c_prefill_token (prompt) are dependent: c_token carries the prompt's per-token cost.
BASE = ("c_fixed", "c_request", "c_token", "c_kv")


def synthetic_steps(truth: CostProfile, rng: np.random.Generator, n: int = 4000,
                    warmups: bool = False) -> StepArrays:
    """Plain decode steps whose KV use varies apart from the batch size, plus prefills."""
    batch = rng.integers(1, 49, n)
    kv = batch * rng.integers(200, 1300, n)  # long and short contexts at every batch size
    prefill = np.where(rng.random(n) < 0.15, rng.choice([16, 100, 300, 1000, 3000], n), 0)
    batch = np.where(prefill > 0, 0, batch)
    depth = np.zeros(n, dtype=np.int64)
    if warmups:
        # A speculative step every 200 steps, preceded by a depth-0 warm-up that costs
        # three times a plain decode: the fit must leave such steps out.
        depth[100::200] = 3
    latency = truth.step_latency_array(batch, depth, kv, prefill,
                                       draft_extend=prefill > 0)
    if warmups:
        latency[99::200] *= 3.0
    return StepArrays(batch, depth, kv.astype(float), prefill, latency)


@settings(max_examples=15, deadline=None)
@given(fixed=st.floats(2e-3, 8e-3), request=st.floats(1e-5, 2e-4),
       token=st.floats(1e-6, 2e-5), kv=st.floats(1e-8, 4e-7), prefill=st.floats(0.0, 2e-5),
       seed=st.integers(0, 2**16))
def test_fit_recovers_kv_and_prefill_coefficients(fixed, request, token, kv, prefill, seed):
    truth = CostProfile("truth", SERVER, c_fixed=fixed, c_request=request, c_token=token,
                        c_kv=kv, c_prefill_token=prefill)
    steps = synthetic_steps(truth, np.random.default_rng(seed))
    fitted, report = fit_load_profile(steps, CostProfile("template", SERVER), BASE, ties={})
    # Group medians over KV bins are not exact points: judge the prediction, and the KV
    # term at the scale it matters (a batch of 48 with 1,000 cached tokens each).
    assert report.summary()["median_abs_rel_error"] < 0.02
    kv_cost_true, kv_cost_fit = truth.c_kv * 48_000, fitted.c_kv * 48_000
    assert abs(kv_cost_fit - kv_cost_true) < 0.1 * kv_cost_true + 2e-4
    pf_true = (truth.c_prefill_token + truth.c_token) * 3000
    pf_fit = (fitted.c_prefill_token + fitted.c_token) * 3000
    assert abs(pf_fit - pf_true) < 0.05 * pf_true


def test_warm_up_steps_next_to_speculation_are_left_out():
    truth = CostProfile("truth", SERVER, c_fixed=5e-3, c_request=5e-5, c_token=1e-5,
                        c_kv=1e-7, c_verify=2e-3)
    rng = np.random.default_rng(3)
    steps = synthetic_steps(truth, rng, warmups=True)
    points = load_points(steps)
    # every depth-0 decode point is a plain decode: none carries the warm-up's tripled cost
    decode0 = (points.depth == 0) & (points.prefill_tokens == 0)
    predicted = truth.step_latency_array(points.batch_size[decode0], 0,
                                         points.kv_tokens[decode0], 0, draft_extend=False)
    assert np.all(points.latency_s[decode0] < 1.5 * predicted)
    unguarded = load_points(steps, switch_guard=0)
    d0 = (unguarded.depth == 0) & (unguarded.prefill_tokens == 0)
    assert len(unguarded.latency_s[d0]) >= len(points.latency_s[decode0])


def test_step_arrays_reject_ragged_columns():
    with pytest.raises(ValueError, match="kv_tokens has 2 entries, expected 3"):
        StepArrays(np.ones(3), np.zeros(3), np.ones(2), np.zeros(3), np.ones(3))


def test_measured_runs_reads_offswitch_layout_and_names_skipped(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts/h200"))
    from measured_runs import read_run_dir

    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    (tmp_path / "moe_nospec.json").write_text(json.dumps(
        {"model": "models_moe", "sweep": {"8": summary}, "headline": summary}))
    (tmp_path / "dense_acc3.5_replay.json").write_text(json.dumps(
        {"model": "models", "acceptance": 3.5, "headline_ppo": summary}))
    (tmp_path / "notes.json").write_text("{}")
    cells, skipped = read_run_dir(tmp_path)
    keys = sorted(c.key() for c in cells)
    assert keys == ["nospec headline 40s no_spec", "nospec one_batch C=8 no_spec",
                    "spec_off@3.5 headline 40s ppo"]
    assert {c.model for c in cells if c.server == "nospec"} == {"moe"}
    assert list(skipped) == ["notes.json"]
    (tmp_path / "dense_off.json").write_text(json.dumps({"sweep_off": {"1": {"oops": 1}}}))
    with pytest.raises(ValueError, match=r"dense_off\.json:sweep_off\.1"):
        read_run_dir(tmp_path)

"""Tests of env.sim.prefill_fit: the per-token and per-pair prefill terms from a trace."""

from __future__ import annotations

import numpy as np
import pytest

from env.sim.cost_model import CostProfile, ServerLimits, prefill_pairs
from env.sim.load_fit import StepArrays
from env.sim.prefill_fit import (
    cached_tokens,
    fit_prefill_terms,
    prefill_points,
    whole_prompt_steps,
)

CHUNK = 8192
TRUE = {"c_prefill_token": 10e-6, "c_prefill_pair": 5e-9}


def _server_profile(**coefficients: float) -> CostProfile:
    return CostProfile("t", ServerLimits(48, 500_000, CHUNK), c_fixed=5e-3, c_request=2e-5,
                       c_kv=4e-8, **coefficients)


def _steps(seed: int = 0) -> StepArrays:
    """Decode steps between lone prompts and one-length batches of prompts, priced by the
    true terms; then a long prompt in two chunks (its rest has pairs a whole-prompt
    estimate gets wrong, so the fit must leave both chunk steps out)."""
    rng = np.random.default_rng(seed)
    truth = _server_profile(**TRUE)
    rows = []  # batch, kv, prefill, latency
    for prompt, requests in [(256, 1), (512, 1), (1024, 1), (2048, 1), (3968, 1), (256, 16),
                             (512, 8)] * 3:
        tokens = prompt * requests
        rows.append((8, 3000, 0, truth.step_latency_s(8, 0, 3000)))
        pairs = requests * prefill_pairs(prompt)
        latency = truth.step_latency_s(0, 0, 3000, tokens, prefill_pairs=pairs)
        rows.append((requests, 3000, tokens, latency * rng.uniform(0.99, 1.01)))
    rows.append((1, 3000, CHUNK, 10.0))  # absurd latencies: used, they would wreck the fit
    rows.append((1, 3000, 1808, 10.0))
    batch, kv, prefill, latency = (np.array(col) for col in zip(*rows, strict=True))
    return StepArrays(batch_size=batch, depth=np.zeros_like(batch), kv_tokens=kv,
                      prefill_tokens=prefill, latency_s=latency)


def test_the_fit_recovers_both_prefill_terms_and_keeps_every_other():
    start = _server_profile(c_prefill_token=30e-6)
    fitted, report = fit_prefill_terms(start, _steps())
    assert fitted.c_prefill_token == pytest.approx(TRUE["c_prefill_token"], rel=0.05)
    assert fitted.c_prefill_pair == pytest.approx(TRUE["c_prefill_pair"], rel=0.05)
    assert report.median_abs_error < 0.02
    assert {k: v for k, v in fitted.coefficients.items() if k not in TRUE} == {
        k: v for k, v in start.coefficients.items() if k not in TRUE}


def test_chunked_prompts_are_left_out_and_prompts_in_a_step_share_its_tokens():
    steps = _steps()
    use = whole_prompt_steps(steps, CHUNK)
    assert not use[-2:].any(), "a full chunk and the step after it"
    assert use[steps.prefill_tokens > 0][:-2].all()
    points = prefill_points(steps, CHUNK)
    four_k = points.prefill_tokens == 4096  # 16 prompts of 256 tokens, 8 of 512
    assert sorted(points.prefill_pairs[four_k]) == pytest.approx(
        [16 * prefill_pairs(256), 8 * prefill_pairs(512)])


def test_too_few_prompt_lengths_is_a_clear_error():
    steps = _steps()
    one_length = StepArrays(*(getattr(steps, f)[:6] for f in (
        "batch_size", "depth", "kv_tokens", "prefill_tokens", "latency_s")))
    with pytest.raises(ValueError, match="prompts of several lengths"):
        fit_prefill_terms(_server_profile(), one_length)


def test_a_group_carrying_its_neighbours_time_is_trimmed():
    """Every 1,024-token step twice as slow (a neighbour's time on it): the second fit
    leaves that group out and recovers the terms; the report says so."""
    steps = _steps()
    slow = (steps.prefill_tokens == 1024) & (steps.batch_size == 1)
    latency = np.where(slow, 2.0 * steps.latency_s, steps.latency_s)
    steps = StepArrays(steps.batch_size, steps.depth, steps.kv_tokens, steps.prefill_tokens,
                       latency)
    fitted, report = fit_prefill_terms(_server_profile(), steps)
    assert 1024 not in report.points.prefill_tokens
    assert any("left out" in note for note in report.notes)
    assert fitted.c_prefill_token == pytest.approx(TRUE["c_prefill_token"], rel=0.05)
    assert fitted.c_prefill_pair == pytest.approx(TRUE["c_prefill_pair"], rel=0.05)


def test_recorded_pairs_let_chunked_prompts_and_cached_prefixes_in():
    """A trace with each prefill step's pairs (the plugin records them) serves as it is:
    a 12,000-token prompt in two chunks, and prompts after a cached prefix, enter the fit
    with their own pairs, which no reckoning from tokens and requests could give."""
    truth = _server_profile(**TRUE)
    rows = []  # batch, kv, prefill, pairs, latency
    for _ in range(3):
        for new, done in [(CHUNK, 0), (12_000 - CHUNK, CHUNK), (512, 3072), (256, 0),
                          (2048, 0), (1024, 2048)]:
            pairs = prefill_pairs(new, done)
            rows.append((1, 4000, new, pairs,
                         truth.step_latency_s(0, 0, 4000, new, prefill_pairs=pairs)))
    batch, kv, prefill, pairs, latency = (np.array(col) for col in zip(*rows, strict=True))
    steps = StepArrays(batch_size=batch, depth=np.zeros_like(batch), kv_tokens=kv,
                       prefill_tokens=prefill, latency_s=latency, prefill_pairs=pairs)
    points = prefill_points(steps, CHUNK)
    assert CHUNK in points.prefill_tokens and 12_000 - CHUNK in points.prefill_tokens
    assert sorted(points.prefill_pairs) == pytest.approx(sorted(set(pairs.tolist())))
    fitted, _ = fit_prefill_terms(_server_profile(), steps)
    for name, value in TRUE.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name
    unknown = StepArrays(batch, np.zeros_like(batch), kv, prefill, latency)
    assert CHUNK not in prefill_points(unknown, CHUNK).prefill_tokens


def test_cached_tokens_are_read_back_from_a_steps_pairs():
    """One prompt: exact; prompts of one new length: their cached tokens summed; whole
    prompts: none; prompts of unequal lengths read as a little cached prefix."""
    assert cached_tokens(65, 1, prefill_pairs(65, 511)) == 511
    assert cached_tokens(8 * 513, 8, 8 * prefill_pairs(513, 2559)) == 8 * 2559
    assert cached_tokens(15 * 256, 15, 15 * prefill_pairs(256)) == 0
    assert cached_tokens(400, 2, prefill_pairs(100) + prefill_pairs(300)) == 50
    assert cached_tokens(0, 0, 0.0) == 0


def test_the_cached_token_term_is_fitted_where_prompts_follow_cached_prefixes():
    """A server that pays per cached token of a prompt (on top of its pairs): lone prompts
    and batches of eight after cached prefixes of several lengths recover all three terms;
    a trace without cached prefixes leaves the term as it was."""
    true = {**TRUE, "c_prefill_cached_token": 6e-6}
    truth = _server_profile(**true)
    rows = []  # batch, kv, prefill, pairs, latency
    for _ in range(3):
        for new, done, requests in [(64, 512, 1), (64, 2560, 1), (512, 1536, 1), (1024, 512, 1),
                                    (1024, 2560, 1), (512, 2560, 8), (256, 0, 1), (2048, 0, 1),
                                    (3968, 0, 1)]:
            pairs = requests * prefill_pairs(new, done)
            rows.append((requests, 9000, new * requests, pairs, truth.step_latency_s(
                0, 0, 9000, new * requests, prefill_pairs=pairs,
                prefill_cached_tokens=requests * done)))
    batch, kv, prefill, pairs, latency = (np.array(col) for col in zip(*rows, strict=True))
    steps = StepArrays(batch_size=batch, depth=np.zeros_like(batch), kv_tokens=kv,
                       prefill_tokens=prefill, latency_s=latency, prefill_pairs=pairs)
    fitted, report = fit_prefill_terms(_server_profile(), steps)
    assert "c_prefill_cached_token" in report.free
    for name, value in true.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name
    fitted, report = fit_prefill_terms(_server_profile(c_prefill_cached_token=1e-6), _steps())
    assert "c_prefill_cached_token" not in report.free
    assert fitted.c_prefill_cached_token == 1e-6

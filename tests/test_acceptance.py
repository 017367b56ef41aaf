"""Tests of the acceptance models and tables."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env.sim.acceptance import (
    AcceptanceLogError,
    AcceptanceTable,
    ParametricAcceptance,
    SGLangSimulatedAcceptance,
    SpecBenchAcceptance,
    TraceAcceptance,
    acceptance_from_config,
    expected_accepted,
)
from env.traces.schema import RequestRecord, StepRecord
from env.traces.trace_format import RequestColumns, Trace, read_trace, write_trace


@pytest.fixture(scope="module")
def spec_bench() -> SpecBenchAcceptance:
    return SpecBenchAcceptance()


# From env/sim/data/SOURCES.md / the upstream Spec-Bench statistics.
CATEGORY_MEANS = {
    "writing": 3.51, "roleplay": 3.82, "reasoning": 3.66, "math": 4.14, "coding": 4.51,
    "extraction": 4.24, "stem": 3.62, "humanities": 3.50, "translation": 2.84,
    "summarization": 3.31, "qa": 3.11, "math_reasoning": 3.92, "rag": 3.21,
}  # fmt: skip
HISTOGRAM = {1: 2632, 2: 4511, 3: 5047, 4: 6440, 5: 2583, 6: 4312}


def test_spec_bench_statistics(spec_bench):
    assert spec_bench.mean_accept_length() == pytest.approx(3.58, abs=0.005)
    means = spec_bench.category_means()
    assert set(means) == set(CATEGORY_MEANS)
    for category, mean in CATEGORY_MEANS.items():
        assert means[category] == pytest.approx(mean, abs=0.005), category
    counts = np.bincount(spec_bench.accept_lengths)
    assert {k: int(counts[k]) for k in HISTOGRAM} == HISTOGRAM
    assert len(spec_bench.turns) == 560
    assert int(spec_bench.turns.lengths.sum()) == 91_342


def test_spec_bench_replay_reproduces_log(spec_bench):
    for turn in range(len(spec_bench.turns)):
        np.testing.assert_array_equal(
            spec_bench.turns.replay(turn, 7), spec_bench.turn_accept_lengths(turn)
        )
    # Over the whole log: tokens / steps is the logged mean accept length.
    assert expected_accepted(spec_bench, 7) + 1 == pytest.approx(spec_bench.mean_accept_length())
    assert expected_accepted(spec_bench, 5) == expected_accepted(spec_bench, 7)  # max k is 5
    assert expected_accepted(spec_bench, 3) < expected_accepted(spec_bench, 5)


def test_sawtooth_and_counterfactual_by_hand(tmp_path):
    log = {
        "question_id": 1,
        "category": "qa",
        "choices": [
            {"accept_lengths": [3, 1, 2, 4], "decoding_steps": [3, 1], "new_tokens": [6, 4]}
        ],
    }
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(log) + "\n")
    model = SpecBenchAcceptance(path)
    # Turn 0: steps of 3, 1, 2 tokens -> A = [2, 1, 0 | 0 | 1, 0]; turn 1: [3, 2, 1, 0].
    np.testing.assert_array_equal(model.turns.row(0), [2, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(model.turns.row(1), [3, 2, 1, 0])
    # Depth 1: min(A[p], 1) + 1 from p = 0: 2 (p=0), 1 (p=2), 1 (p=3), 2 (p=4).
    np.testing.assert_array_equal(model.turns.replay(0, 1), [2, 1, 1, 2])
    np.testing.assert_array_equal(model.turns.replay(1, 2), [3, 1])
    np.testing.assert_array_equal(model.turns.replay(1, 0), [1, 1, 1, 1])
    capped = SpecBenchAcceptance(path, max_depth=2)
    np.testing.assert_array_equal(capped.turns.row(1), [2, 2, 1, 0])


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (
            {"accept_lengths": [3, 1], "decoding_steps": [3], "new_tokens": [4]},
            "line 2, field 'choices[0].accept_lengths': has 2 steps, but sum(decoding_steps) = 3",
        ),
        (
            {"accept_lengths": [3, 1], "decoding_steps": [2], "new_tokens": [5]},
            "line 2, field 'choices[0].accept_lengths': sums to 4 tokens, but sum(new_tokens) = 5",
        ),
        (
            {"accept_lengths": [3, 0], "decoding_steps": [2], "new_tokens": [3]},
            "line 2, field 'choices[0].accept_lengths': entry 1 must be >= 1, got 0",
        ),
        (
            {"accept_lengths": [3, 1], "decoding_steps": [1, 1], "new_tokens": [1, 3]},
            "line 2, field 'choices[0].accept_lengths': turn 0: its 1 steps sum to 3 tokens",
        ),
        (
            {"accept_lengths": [3, 1], "decoding_steps": [2]},
            "line 2, field 'choices[0].new_tokens': missing field",
        ),
    ],
)
def test_spec_bench_errors(tmp_path, choice, expected):
    good = {
        "category": "qa",
        "choices": [{"accept_lengths": [1], "decoding_steps": [1], "new_tokens": [1]}],
    }
    bad = {"category": "qa", "choices": [choice]}
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(AcceptanceLogError) as exc:
        SpecBenchAcceptance(path)
    assert str(exc.value).startswith(f"{path}: {expected}"), str(exc.value)


def test_spec_bench_bad_json(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("{oops\n")
    with pytest.raises(AcceptanceLogError, match="line 1: malformed JSON"):
        SpecBenchAcceptance(path)


def test_spec_bench_draw_by_class(spec_bench):
    rng = np.random.default_rng(1)
    n = 400
    lengths = rng.integers(50, 600, size=n)
    classes = np.array(["coding"] * (n // 2) + ["translation"] * (n // 2), dtype=object)
    table = spec_bench.draw(lengths, classes, rng)
    np.testing.assert_array_equal(table.lengths, lengths)
    coding = AcceptanceTable.from_rows([table.row(i) for i in range(n // 2)])
    translation = AcceptanceTable.from_rows([table.row(i) for i in range(n // 2, n)])
    assert coding.mean_accepted(7) > translation.mean_accepted(7) + 1.0
    # Each coding request starts with the prefix of some coding turn.
    coding_turns = [
        spec_bench.turns.row(t) for t in np.flatnonzero(spec_bench.turn_category == "coding")
    ]
    for i in range(5):
        row = table.row(i)
        assert any(
            np.array_equal(row[: min(len(row), len(t))], t[: min(len(row), len(t))])
            for t in coding_turns
        )
    # Unknown classes and no classes draw from every turn.
    other = spec_bench.draw(lengths, np.array(["unknown"] * n, dtype=object), rng)
    assert other.values.size == lengths.sum()
    filtered = SpecBenchAcceptance(categories=["math"])
    assert filtered.categories == ["math"]
    with pytest.raises(ValueError, match="unknown categories"):
        SpecBenchAcceptance(categories=["nope"])


def test_parametric_matches_chain_formula_monte_carlo():
    model = ParametricAcceptance([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    survival = np.cumprod([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    for depth in (0, 1, 3, 7):
        assert model.expected_accept_length(depth) == pytest.approx(1 + survival[:depth].sum())
    rng = np.random.default_rng(0)
    table = model.draw(np.full(2000, 500), None, rng)
    k = model.sample(rng, 400_000)
    for j in range(1, 8):
        assert np.mean(k >= j) == pytest.approx(survival[j - 1], abs=0.004)
    for depth in (1, 2, 3, 5, 7):
        mc = table.mean_accepted(depth)
        assert mc == pytest.approx(model.expected_accepted(depth), rel=0.01), depth


def test_sawtooth_structure_and_renewal_formula():
    alphas = [0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55]
    saw = ParametricAcceptance(alphas, structure="sawtooth")
    iid = ParametricAcceptance(alphas)
    rng = np.random.default_rng(3)
    table = saw.draw(np.full(3000, 400), None, rng)
    row = table.row(0).astype(int)
    # Inside a run the value drops by one per position; a new run starts after a 0.
    steps = np.diff(row)
    assert np.all((steps == -1) | (row[:-1] == 0))
    assert saw.expected_accepted(7) == pytest.approx(iid.expected_accepted(7))
    for depth in (1, 2, 3, 5):
        assert saw.expected_accepted(depth) < iid.expected_accepted(depth)
        assert table.mean_accepted(depth) == pytest.approx(saw.expected_accepted(depth), rel=0.01)


@settings(max_examples=40, deadline=None)
@given(
    target=st.floats(1.05, 3.9),
    depth=st.integers(3, 7),
    decay=st.floats(0.8, 1.0),
)
def test_calibrated_hits_target(target, depth, decay):
    # The most a decay can reach: every rate at its largest, a = 1 (independent of the
    # calibration's search). Only targets above it may be refused, and they must be.
    ceiling = ParametricAcceptance(
        np.minimum(decay ** np.arange(7), 1.0)).expected_accept_length(depth)
    if target > ceiling:
        with pytest.raises(ValueError, match=r"out of reach with decay .*achievable"):
            ParametricAcceptance.calibrated(target, depth, decay=decay)
        return
    model = ParametricAcceptance.calibrated(target, depth, decay=decay)
    assert model.expected_accept_length(depth) == pytest.approx(target, abs=1e-9)
    assert np.all(np.diff(model.alphas) <= 1e-12)  # non-increasing rates
    assert model.max_depth == 7


def test_calibrated_out_of_reach():
    with pytest.raises(ValueError, match="out of reach"):
        ParametricAcceptance.calibrated(4.5, depth=3)


@pytest.mark.parametrize(
    ("mean", "expected"),
    # The measured H200 run (mean 3.5) shows 1.0 / 2.0 / ~2.5 accepted at steps 1 / 2 / >= 3.
    [
        (3.5, {1: 1.0, 2: 2.0, 3: 2.5, 5: 2.5, 7: 2.5}),
        (2.3, {1: 1.0, 2: 1.3, 7: 1.3}),
        (9.0, {3: 3.0, 7: 7.0}),
    ],
)
def test_sglang_simulated(mean, expected):
    model = SGLangSimulatedAcceptance(mean)
    table = model.draw(np.full(500, 400), None, np.random.default_rng(0))
    for depth, value in expected.items():
        assert model.expected_accepted(depth) == pytest.approx(value)
        # Replay truncates each request's last step, hence the tolerance.
        assert table.mean_accepted(depth) == pytest.approx(value, rel=0.02)
    assert set(np.unique(table.values).tolist()) <= {
        int(np.floor(min(mean, 8))) - 1,
        int(np.floor(min(mean, 8))),
    }


def test_large_draws_fill_every_position(spec_bench):
    """~4M positions at once (what a long training episode draws): every position gets an
    int8 value within the model's depth (no timing here: draws are part of what
    benchmarks/bench_simulator.py times)."""
    lengths = np.random.default_rng(0).integers(1, 422, size=20_000)
    models = [
        spec_bench,
        ParametricAcceptance.calibrated(2.9, 3),
        SGLangSimulatedAcceptance(3.5),
    ]
    for model in models:
        table = model.draw(lengths, None, np.random.default_rng(1))
        assert table.values.size == lengths.sum() and table.values.dtype == np.int8
        assert table.values.min() >= 0 and table.values.max() <= model.max_depth


def synthetic_trace(truth: AcceptanceTable, depths: list[int], rng) -> Trace:
    """Decode every request of ``truth`` in lock step, cycling through ``depths``."""
    n = len(truth)
    p = np.zeros(n, dtype=int)
    lengths = truth.lengths
    steps = []
    index = 0
    while (p < lengths).any():
        active = np.flatnonzero(p < lengths)
        depth = depths[index % len(depths)]
        a = np.minimum(truth.values[truth.offsets[active] + p[active]], depth)
        commit = np.minimum(a + 1, lengths[active] - p[active])
        accepted = (commit - 1).astype(np.int8)
        steps.append(
            StepRecord(
                "s",
                0,
                index,
                index * 0.01,
                active.size,
                0,
                active.size,
                0,
                10**6,
                0,
                depth,
                accepted if depth else np.array([], np.int8),
                0.01,
                [f"r{i}" for i in active],
            )
        )
        # TP rank 1 reports the same step; it must be ignored.
        steps.append(
            StepRecord(
                "s",
                1,
                index,
                index * 0.01,
                active.size,
                0,
                active.size,
                0,
                10**6,
                0,
                depth,
                np.array([], np.int8),
                0.01,
                [f"r{i}" for i in active],
            )
        )
        p[active] += commit
        index += 1
    requests = [
        RequestRecord(f"r{i}", 0.0, 10, int(lengths[i]), "easy" if i % 2 else "hard")
        for i in range(n)
    ]
    return Trace(requests=_req(requests), steps=steps)


def _req(records):
    return RequestColumns.from_records(records)


def test_trace_acceptance_recovers_rates_and_exact_values(tmp_path):
    rng = np.random.default_rng(7)
    truth_model = ParametricAcceptance([0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5])
    truth = truth_model.draw(rng.integers(50, 200, size=1000), None, rng)
    trace = synthetic_trace(truth, [2, 5, 0, 7, 3], rng)
    # Through the file format too (rank 1 has no acceptance reported).
    path = write_trace(tmp_path / "t.parquet", trace.requests.records(), trace.steps)
    fitted = TraceAcceptance(read_trace(path))
    assert fitted.dropped_requests == 0
    # Standard error at position 7 (fewest trials) is about 0.017.
    np.testing.assert_allclose(fitted.alphas, truth_model.alphas, atol=0.05)
    # One row per recorded request, as long as its output.
    assert len(fitted.table) == len(truth)
    for r in range(20):
        i = int(fitted.request_ids[r][1:])
        assert fitted.table.row(r).size == truth.row(i).size
    table = fitted.draw(np.array([30, 60]), np.array(["easy", "hard"], dtype=object), rng)
    assert table.lengths.tolist() == [30, 60]


def test_trace_acceptance_replays_like_a_greedy_truth():
    # A truth with the saw-tooth structure the fit assumes (greedy decoding), and
    # runs much longer than the depths used (no cap artefacts at depth 7).
    rng = np.random.default_rng(11)
    truth_model = ParametricAcceptance([0.75] * 40, structure="sawtooth")
    truth = truth_model.draw(rng.integers(50, 200, size=600), None, rng)
    fitted = TraceAcceptance(synthetic_trace(truth, [2, 5, 0, 7, 3], rng))
    for depth in (1, 3, 7):
        assert fitted.expected_accepted(depth) == pytest.approx(
            truth.mean_accepted(depth), rel=0.05
        ), depth


def test_trace_acceptance_exact_observations_are_kept():
    # One request, depth 3 throughout: A = [1, 0, 2, 1, 0, 3, 2, 1, 0].
    truth = AcceptanceTable.from_rows([np.array([1, 0, 2, 1, 0, 3, 2, 1, 0])])
    trace = synthetic_trace(truth, [3], np.random.default_rng(0))
    fitted = TraceAcceptance(trace, seed=1)
    row = fitted.table.row(0)
    # Steps start at 0 (accepted 1 < 3: exact), 2 (2: exact), 5 (3: censored >= 3).
    assert row[0] == 1 and row[2] == 2
    assert row[5] >= 3
    np.testing.assert_array_equal(row[:5], [1, 0, 2, 1, 0])


def test_trace_acceptance_needs_request_ids():
    steps = [StepRecord("s", 0, 0, 0.0, 1, 0, 1, 0, 10, 0, 2, np.array([1], np.int8), 0.01)]
    trace = Trace(requests=_req([]), steps=steps)
    with pytest.raises(ValueError, match="no decode step carries request_ids"):
        TraceAcceptance(trace)


@pytest.mark.parametrize(
    "model",
    [
        ParametricAcceptance([0.8, 0.7, 0.6], structure="sawtooth"),
        SGLangSimulatedAcceptance(3.5, max_depth=5),
        SpecBenchAcceptance(categories=["qa", "rag"], max_depth=6),
    ],
)
def test_config_round_trip(model):
    rebuilt = acceptance_from_config(model.to_config())
    assert type(rebuilt) is type(model)
    assert rebuilt.max_depth == model.max_depth
    for depth in (1, 3):
        assert rebuilt.expected_accepted(depth) == pytest.approx(model.expected_accepted(depth))


def test_config_errors_and_calibration_form():
    model = acceptance_from_config(
        {
            "model": "parametric",
            "mean_accept_length": 2.9,
            "depth": 3,
            "decay": 0.98,
            "note": "documentation is allowed",
        }
    )
    assert model.expected_accept_length(3) == pytest.approx(2.9)
    with pytest.raises(ValueError, match="unknown keys"):
        acceptance_from_config({"model": "sglang_simulated", "mean_accept_length": 3, "x": 1})
    with pytest.raises(ValueError, match="must be one of"):
        acceptance_from_config({"model": "magic"})


def test_table_validation():
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 3 does not match 2 values"):
        AcceptanceTable(np.array([0, 3]), np.array([1, 0], np.int8))
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        AcceptanceTable(np.array([0, 2, 1]), np.array([1], np.int8))
    with pytest.raises(ValueError, match=r"offsets\[0\] == 0"):
        AcceptanceTable(np.array([1, 2]), np.array([1, 0], np.int8))
    with pytest.raises(ValueError, match="values must be >= 0"):
        AcceptanceTable(np.array([0, 2]), np.array([1, -1], np.int8))
    table = AcceptanceTable.from_rows([np.array([2, 1, 0]), np.array([], np.int8)])
    assert table.lengths.tolist() == [3, 0]
    assert table.replay_counts(7).tolist() == [1, 0]
    assert expected_accepted(table, 1) == pytest.approx((3 - 2) / 2)


@pytest.mark.parametrize("depth", [1, 3, 7])
def test_batch_wide_sglang_acceptance_is_one_draw_per_step_with_sglangs_mean(depth):
    """``batch_wide``: every request of a verify step accepts the same count (SGLang's
    simulation), with the same mean per depth as the per-request model."""
    from env.sim.cost_model import load_profile
    from env.sim.simulator import SchedulerConfig, Simulator
    from env.traces.workloads import ClosedLoop

    model = SGLangSimulatedAcceptance(3.5, batch_wide=True)
    sim = Simulator(load_profile("h200_llama31_8b"), model,
                    ClosedLoop(16, 64, 400, requests_per_client=2), SchedulerConfig(), seed=0)
    per_step = []
    while not sim.done:
        sim.advance()
        if sim.done:
            break
        drafts = sim.decode(depth).accepted_drafts
        assert len(set(drafts.tolist())) == 1, drafts  # one draw for the whole batch
        per_step.append(int(drafts[0]))
    assert np.mean(per_step) == pytest.approx(model.expected_accepted(depth), abs=0.05)
    assert acceptance_from_config(model.to_config()).batch_wide
    assert not acceptance_from_config(SGLangSimulatedAcceptance(3.5).to_config()).batch_wide

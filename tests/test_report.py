"""The sweep table reads in 80 columns and in a log file: nothing is cut short."""

from __future__ import annotations

import io

import numpy as np
from rich.console import Console

from agents.report import sweep_table

POLICIES = ["no_spec", "static_3", "table", "sglang_adaptive", "goodput_greedy",
            "goodput_online", "oracle", "ppo", "static_1", "static_7"]
CONCURRENCY = [1, 2, 4, 8, 16, 32, 70, 100, 150, 250]


def test_every_cell_is_printed_whole_in_80_columns():
    rng = np.random.default_rng(0)
    results = {p: {str(c): {"throughput_tok_s": float(rng.uniform(10, 99_999))}
                   for c in CONCURRENCY} for p in POLICIES}
    results["oracle"]["70"]["throughput_tok_s"] = None  # a missing cell shows as "-"
    out = io.StringIO()
    tables = sweep_table(results, "output tok/s", console=Console(file=out, width=80))
    text = out.getvalue()
    assert len(tables) > 1  # ten policies do not fit one 80-column table
    assert "…" not in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    for policy, cells in results.items():
        for part in policy.split("_", 1):
            assert part in text
        for cell in cells.values():
            value = cell["throughput_tok_s"]
            if value is not None:
                assert (f"{value:,.0f}" if value >= 100 else f"{value:.1f}") in text


def test_a_wide_console_keeps_one_table():
    results = {p: {"1": {"throughput_tok_s": 1234.0}} for p in POLICIES}
    out = io.StringIO()
    assert len(sweep_table(results, "t", console=Console(file=out, width=200))) == 1

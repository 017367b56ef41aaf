"""specctl-eval's bookkeeping: per-cell targets, empty windows, file names."""

from __future__ import annotations

from agents.evaluate import _file_stem, target_checks


def _row(tok_s: float, fraction: float, off: float = 0.0) -> dict:
    return {"throughput_tok_s": tok_s, "oracle_fraction": fraction, "off_share": off,
            "mean_tpot_ms": 10.0, "scenarios": 1}


def _document() -> dict:
    cells = {
        # held out, exact profile: 0.96 of the oracle but 0.98x the best baseline: missed
        "moe/azure_code/exact": {"ppo": _row(98, 0.96), "goodput_online": _row(100, 0.98),
                                 "oracle": _row(102, 1.0)},
        # in distribution, exact: 0.97 >= 0.967: met
        "h200/azure_conv/exact": {"ppo": _row(97, 0.97), "no_spec": _row(90, 0.9),
                                  "oracle": _row(100, 1.0)},
        # missing profile: 0.91 >= 0.90: met
        "h200/azure_conv/none": {"ppo": _row(91, 0.91), "oracle": _row(100, 1.0)},
        # swapped: reported only
        "h200/azure_conv/swapped": {"ppo": _row(50, 0.5), "oracle": _row(100, 1.0)},
    }
    scenarios = [{"scenario": "s", "modulated": False, "runs": {
        "oracle": {"throughput_tok_s": 1.0, "off_share": 1.0},
        "no_spec": {"throughput_tok_s": 1.0, "off_share": 1.0, "oracle_fraction": 1.0},
        "ppo": {"throughput_tok_s": 1.0, "off_share": 0.8}}},
        # The myopic oracle stays off, but a fixed depth is 1.5x no speculation: it pays.
        {"scenario": "t", "modulated": False, "runs": {
            "oracle": {"throughput_tok_s": 1.0, "off_share": 1.0},
            "no_spec": {"throughput_tok_s": 1.0, "off_share": 1.0, "oracle_fraction": 0.66},
            "ppo": {"throughput_tok_s": 1.5, "off_share": 0.0}}}]
    return {"cells": cells, "scenarios": scenarios, "left_out_empty": ["empty window"]}


def test_per_cell_targets_depend_on_held_out_and_profile_mode():
    checks = target_checks(_document(), held_out_families=["moe"])
    cells = checks["cells"]
    assert cells["moe/azure_code/exact"]["met"] is False
    assert cells["moe/azure_code/exact"]["best_baseline"] == "goodput_online"
    assert cells["moe/azure_code/exact"]["vs_best_baseline"] == 0.98
    assert cells["h200/azure_conv/exact"]["met"] is True
    assert cells["h200/azure_conv/none"]["met"] is True
    assert cells["h200/azure_conv/swapped"]["met"] is None
    assert (checks["cells_met"], checks["cells_with_target"]) == (2, 3)
    # The oracle was off on the whole of both windows, but only in the first was no
    # speculation as good as the reference: speculation never paid there alone.
    assert checks["never_pays"] == {"scenarios": 1, "mean_off_share": 0.8,
                                    "at_least_90pct_off": 0,
                                    "oracle_off_but_speculation_pays": 1}
    assert checks["left_out_empty_windows"] == 1


def test_plot_names_of_profile_paths_have_no_folders():
    assert _file_stem("dir/sub/x.yaml") == "x"
    assert _file_stem("blackwell_tp8") == "blackwell_tp8"

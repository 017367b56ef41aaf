"""specctl-eval's bookkeeping: per-cell targets, empty windows, file names."""

from __future__ import annotations

import pytest

from agents.evaluate import (
    LATENCY_PAYS_MARGIN,
    NEVER_PAYS_MARGIN,
    _file_stem,
    speculation_pays_in_latency,
    target_checks,
)


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
                                    "oracle_off_but_speculation_pays": 1,
                                    "oracle_off_but_speculation_pays_in_latency": 0,
                                    "speculation_pays_in_latency_windows": [],
                                    "missed_windows": [{"scenario": "s", "off_share": 0.8,
                                                        "vs_no_spec": 1.0}]}
    assert checks["left_out_empty_windows"] == 1


def test_plot_names_of_profile_paths_have_no_folders():
    assert _file_stem("dir/sub/x.yaml") == "x"
    assert _file_stem("blackwell_tp8") == "blackwell_tp8"


def test_the_reference_is_the_best_of_the_oracle_and_the_fixed_depths_run(monkeypatch):
    """Every oracle fraction is over the best of the per-step oracle and the fixed depths
    run (the myopic oracle can lose to a fixed depth); a window the oracle served nothing
    in is left out and named. The runs are set here, not simulated."""
    from types import SimpleNamespace

    import agents.evaluate as evaluate

    scenarios = [SimpleNamespace(label=label, family="h200", prior_mode="exact",
                                 workload_name="w", profile=SimpleNamespace(name="p"),
                                 varying_load=False) for label in ("full", "empty")]
    tok_s = {"full": {"oracle": 100.0, "no_spec": 90.0, "static_3": 120.0, "ppo": 110.0},
             "empty": {"oracle": 0.0, "no_spec": 0.0, "static_3": 0.0, "ppo": 0.0}}

    def run_all(function, tasks, workers, desc):
        return [{"throughput_tok_s": tok_s[scenarios[i].label][p], "decisions": 500,
                 "steps_chosen": [100, 0, 0, 400, 0, 0, 0, 0], "mean_tpot_ms": 5.0,
                 "slo_goodput_tok_s": 1.0} for *_, i, p, _ in tasks]

    monkeypatch.setattr(evaluate, "_scenarios", lambda *args: scenarios)
    monkeypatch.setattr(evaluate, "run_all", run_all)
    document = evaluate.evaluate_workloads({}, ["oracle", "no_spec", "static_3", "ppo"], None)
    assert document["left_out_empty"] == ["empty"]
    [detail] = document["scenarios"]
    fractions = {p: run["oracle_fraction"] for p, run in detail["runs"].items()}
    assert fractions == {"oracle": 100 / 120, "no_spec": 90 / 120, "static_3": 1.0,
                         "ppo": 110 / 120}
    assert detail["runs"]["ppo"]["off_share"] == 100 / 500
    assert document["workloads"]["w"]["ppo"]["oracle_fraction"] == 110 / 120


def _window(label: str, family: str, static_tok_s: float, static_tpot: float | None,
            ppo_off: float) -> dict:
    """An oracle-off window where no speculation matches the reference (10 ms TPOT)."""
    return {"scenario": label, "family": family, "modulated": False, "runs": {
        "oracle": {"throughput_tok_s": 100.0, "off_share": 1.0},
        "no_spec": {"throughput_tok_s": 100.0, "off_share": 1.0, "oracle_fraction": 1.0,
                    "mean_tpot_ms": 10.0},
        "static_3": {"throughput_tok_s": static_tok_s, "off_share": 0.0,
                     "oracle_fraction": static_tok_s / 100.0, "mean_tpot_ms": static_tpot},
        "ppo": {"throughput_tok_s": 100.0, "off_share": ppo_off}}}


@pytest.mark.parametrize(("tok_s", "tpot", "pays"), [
    (100.0, 10.0 * (1 - LATENCY_PAYS_MARGIN) - 0.01, True),   # same throughput, faster tokens
    (100.0 * (1 - NEVER_PAYS_MARGIN), 7.0, True),             # at the throughput margin
    (100.0, 10.0 * (1 - LATENCY_PAYS_MARGIN) + 0.01, False),  # a TPOT gain inside the margin
    (100.0 * (1 - NEVER_PAYS_MARGIN) - 0.1, 7.0, False),      # faster tokens, fewer of them
    (100.0, None, False),                                      # nothing finished: unknown
])
def test_speculation_pays_in_latency_needs_both_throughput_and_a_tpot_gain(tok_s, tpot, pays):
    assert speculation_pays_in_latency(_window("w", "f", tok_s, tpot, 1.0)["runs"]) is pays


def test_no_spec_and_an_unknown_no_spec_tpot_never_pay_in_latency():
    runs = _window("w", "f", 100.0, 5.0, 1.0)["runs"]
    runs["static_0"] = dict(runs["no_spec"], mean_tpot_ms=1.0)  # off under another name
    del runs["static_3"]
    assert not speculation_pays_in_latency(runs)
    runs = _window("w", "f", 100.0, 5.0, 1.0)["runs"]
    runs["no_spec"]["mean_tpot_ms"] = None
    assert not speculation_pays_in_latency(runs)


def test_windows_where_speculation_pays_in_latency_leave_the_never_pays_set_and_are_named():
    """Arrival-bound windows: the oracle is off and no speculation serves as much as any
    depth, but depth 3 cuts the time per token by 20%; turning speculation off there is
    no success and speculating no failure."""
    document = {"cells": {}, "scenarios": [
        _window("latency", "a", 100.0, 8.0, ppo_off=0.0),
        _window("never-a", "a", 80.0, 12.0, ppo_off=0.95),
        _window("never-b", "b", 100.0, 9.8, ppo_off=0.5),   # 2% faster tokens: noise
        _window("never-b2", "b", 100.0, 12.0, ppo_off=0.92)]}
    checks = target_checks(document)
    assert checks["never_pays"] == {"scenarios": 3, "mean_off_share": pytest.approx(0.79),
                                    "at_least_90pct_off": 2,
                                    "oracle_off_but_speculation_pays": 0,
                                    "oracle_off_but_speculation_pays_in_latency": 1,
                                    "speculation_pays_in_latency_windows": ["latency"],
                                    "missed_windows": [{"scenario": "never-b",
                                                        "off_share": 0.5,
                                                        "vs_no_spec": 1.0}]}
    assert checks["never_pays_by_family"] == {
        "a": {"scenarios": 1, "at_least_90pct_off": 1},
        "b": {"scenarios": 2, "at_least_90pct_off": 1}}


def test_missed_never_pays_windows_are_listed_costliest_first_and_reported(tmp_path):
    """A miss that costs (0.9x no speculation) comes before one that does not (1.0x); a
    window off on >= 90% of steps is no miss; the report names the costly count."""
    from agents.evaluate import write_report

    cheap = _window("cheap", "a", 80.0, 12.0, ppo_off=0.3)
    costly = _window("costly", "a", 80.0, 12.0, ppo_off=0.6)
    costly["runs"]["ppo"]["throughput_tok_s"] = 90.0
    kept = _window("kept", "a", 80.0, 12.0, ppo_off=0.9)
    checks = target_checks({"cells": {}, "scenarios": [cheap, costly, kept]})
    assert checks["never_pays"]["missed_windows"] == [
        {"scenario": "costly", "off_share": 0.6, "vs_no_spec": 0.9},
        {"scenario": "cheap", "off_share": 0.3, "vs_no_spec": 1.0}]
    write_report({"workloads": {}, "checks": checks}, tmp_path, "t")
    report = (tmp_path / "report.md").read_text()
    assert "off on under 90% of steps: 2, 1 of them below 0.98x" in report
    assert report.index("* costly: off 0.60, 0.900x") < report.index("* cheap: off 0.30, 1.000x")

"""scripts/h200/compare.py and measured_runs.py: rankings with ties, layouts, one simulated cell."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts/h200"))

import compare
from measured_runs import Cell, read_run_dir

REPO_ROOT = Path(__file__).resolve().parents[1]


def row(policy: str, measured: float, simulated: float) -> dict:
    return {"policy": policy, "measured_tok_s": measured, "simulated_tok_s": simulated}


def test_ranking_joins_policies_within_one_percent():
    rows = [row("a", 1000.0, 900.0), row("b", 995.0, 1000.0), row("c", 800.0, 700.0)]
    assert compare.ranked(rows, "measured_tok_s") == ["a=b", "c"]
    assert compare.ranked(rows, "simulated_tok_s") == ["b", "a", "c"]


def test_rankings_compare_policies_of_one_run_and_load():
    rows = [{**row(p, m, s), "workload": "headline", "group": "run/dense spec_off@3.5",
             "cell": f"spec_off@3.5 headline 40s {p}"}
            for p, m, s in (("static_3", 2400.0, 2400.0), ("static_0", 2000.0, 2100.0))]
    rows.append({**row("no_spec", 9999.0, 1.0), "workload": "headline",
                 "group": "run/dense nospec", "cell": "nospec headline 40s no_spec"})
    ranks = compare.rankings(rows)
    assert ranks == {"run/dense spec_off@3.5 headline 40s": (["static_3", "static_0"],
                                                             ["static_3", "static_0"])}


def test_separated_pairs_count_only_orders_measured_beyond_repeat_noise():
    def closed(policy: str, measured: float, simulated: float) -> dict:
        return {**row(policy, measured, simulated), "workload": "closed",
                "group": "run/moe spec_off@2.5", "cell": f"spec_off@2.5 closed C=16 {policy}"}

    rows = [closed("static_3", 1000.0, 1100.0),  # 3% above ppo: within noise, not counted
            closed("ppo", 970.0, 1150.0),
            closed("static_0", 700.0, 800.0)]  # 30% / 28% below: two pairs, same order
    assert compare.separated_pairs(rows, noise=0.06) == (2, 2)
    rows[2] = closed("static_0", 700.0, 1200.0)  # now simulated above both
    assert compare.separated_pairs(rows, noise=0.06) == (0, 2)
    assert compare.separated_pairs(rows, noise=0.5) == (0, 0)


def test_phases_layout_closed_loops_and_unrecognised_files(tmp_path):
    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    (tmp_path / "moe_acc25_closed.json").write_text(json.dumps(
        {"static_3": {"1": summary, "16": summary}}))
    (tmp_path / "moe_acc11_skipextend_closed.json").write_text(json.dumps({"static_0": {}}))
    cells, skipped = read_run_dir(tmp_path)
    assert sorted(c.key() for c in cells) == ["spec_sglang0@2.5 closed C=1 static_3",
                                              "spec_sglang0@2.5 closed C=16 static_3"]
    assert all(c.radix_cache and c.max_running == 64 and c.seconds == 5.0 for c in cells)
    assert list(skipped) == ["moe_acc11_skipextend_closed.json"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_run_dir(tmp_path / "missing")


def test_one_batch_cell_is_simulated_with_the_cells_server_limits():
    from omegaconf import OmegaConf

    from env.sim.cost_model import CostProfile, ServerLimits

    profile = CostProfile("p", ServerLimits(64, 100_000, 8192), c_fixed=5e-3, c_request=1e-4)
    client = OmegaConf.create({"start_interval_s": 0.0, "client_overhead_s": 0.0})
    base = dict(model="dense", server="nospec", acceptance=None, workload="one_batch",
                seconds=None, policy="no_spec", radix_cache=False, source="x",
                throughput_tok_s=1.0, mean_tpot_ms=1.0)
    small = compare.simulate(Cell(**base, concurrency=8, max_running=4), profile, profile, client)
    large = compare.simulate(Cell(**base, concurrency=8, max_running=8), profile, profile, client)
    # a decode step of b requests takes c_fixed + c_request * b: 5.4 ms at 4, 5.8 ms at 8
    assert large["mean_tpot_ms"] == pytest.approx(5.8, rel=1e-6)
    assert small["mean_tpot_ms"] == pytest.approx(5.4, rel=1e-6)
    assert large["throughput_tok_s"] > small["throughput_tok_s"]
    assert large["window_tok_s"] is None, "a one-batch cell has no sending window"
    # A closed loop of one client for 1 s: steps of 5.1 ms, 128 tokens a request, every
    # request done before the next is sent; the window holds about 1 s of them (196 tokens
    # a second), while the throughput also counts the drain of the request the loop was in.
    loop = Cell(**{**base, "workload": "closed", "seconds": 1.0}, concurrency=1, max_running=8)
    closed = compare.simulate(loop, profile, profile, client)
    assert closed["window_tok_s"] == pytest.approx(1 / 5.1e-3, rel=0.02)


def test_cells_take_the_profile_of_the_tokens_they_decoded():
    from env.sim.cost_model import CostProfile, ServerLimits

    limits = ServerLimits(48, 100_000, 8192)
    plain, replay, off = (CostProfile(n, limits) for n in ("plain", "replay", "off"))
    base = dict(model="moe", workload="one_batch", concurrency=8, seconds=None,
                policy="static_0", radix_cache=False, max_running=48, source="x",
                throughput_tok_s=1.0, mean_tpot_ms=1.0)
    sweep = Cell(**base, server="spec_off", acceptance=None)
    simulated = Cell(**base, server="spec_off", acceptance=1.1, tokens="token100")
    real_draft = Cell(**base, server="spec_off", acceptance=1.1, tokens="real")
    profiles = {"moe": replay, "moe.real": plain}
    assert compare.profile_for(sweep, profiles) is plain
    assert compare.profile_for(real_draft, profiles) is plain
    assert compare.profile_for(simulated, profiles) is replay
    # a server-kind key wins over both
    assert compare.profile_for(sweep, {**profiles, "moe.spec_off": off}) is off
    assert compare.profile_for(Cell(**{**base, "model": "dense"}, server="nospec",
                                    acceptance=None), profiles) is None


def test_token_mode_and_unrepresentative_configurations_are_read_from_the_files(tmp_path):
    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    (tmp_path / "moe_acc1.1_replay_realtokens.json").write_text(json.dumps({
        "acceptance": 1.1, "policy_sha256": "ab", "simulate_acc_token_mode": "real-draft-token",
        "headline_ppo": summary}))
    (tmp_path / "moe_acc1.1_replay_run2.json").write_text(json.dumps({
        "acceptance": 1.1, "policy_sha256": "ab", "headline_static_0": summary}))
    (tmp_path / "dense_acc3.5_replay_run2.json").write_text(json.dumps({
        "acceptance": 3.5, "headline_ppo": summary, "headline_static_3": summary}))
    (tmp_path / "dense_off_run1.json").write_text(json.dumps({"sweep_off": {"8": summary}}))
    cells, skipped = read_run_dir(tmp_path)
    assert not skipped
    by_source = {c.source: c for c in cells}
    real = by_source["moe_acc1.1_replay_realtokens.json:headline_ppo"]
    assert (real.tokens, real.apart) == ("real", None)
    token100 = by_source["moe_acc1.1_replay_run2.json:headline_static_0"]
    assert (token100.tokens, token100.apart) == ("token100", "token-100")
    # the dense model's step cost does not depend on the tokens; a PPO cell whose policy
    # is not recorded is no replay of what ran
    assert by_source["dense_acc3.5_replay_run2.json:headline_static_3"].apart is None
    assert by_source["dense_acc3.5_replay_run2.json:headline_ppo"].apart == "policy gone"
    assert by_source["dense_off_run1.json:sweep_off.8"].apart == "first off path"
    (tmp_path / "moe_acc1.1_replay_realtokens.json").write_text(json.dumps({
        "acceptance": 1.1, "simulate_acc_token_mode": "random", "headline_ppo": summary}))
    with pytest.raises(ValueError, match=r"realtokens\.json: simulate_acc_token_mode 'random'"):
        read_run_dir(tmp_path)


def test_counts_keep_apart_cells_out_of_the_representative_ones():
    def r(use, err, apart=None):
        return {"use": use, "apart": apart, "tok_s_error": err, "tpot_error": 0.0}

    rows = [r("held-out", 0.05), r("held-out", 0.2), r("fit-run", 0.0),
            r("held-out", 0.0, "token-100"), r("fit-run", 0.3, "token-100")]
    assert compare.counts(rows) == {"held-out": (1, 2), "fit-run": (1, 1),
                                    "apart: token-100": (1, 2)}


def test_repeated_server_starts_are_ranked_apart():
    assert compare.run_suffix("dense_acc3.5_replay_run2.json") == "_run2"
    assert compare.run_suffix("dense_acc3.5_replay.json") == ""
    assert compare.run_suffix("moe_off_run3_notes.json") == ""


def test_repeated_sweeps_are_one_cell_at_their_median_and_replays_name_their_prior(tmp_path):
    def summary(tpot):
        return {"throughput_tok_s": 1000.0 / tpot, "mean_tpot_ms": tpot}

    (tmp_path / "dense_off_run3.json").write_text(json.dumps({"sweep_off": {
        "48": summary(8.2), "48#1": summary(6.7), "48#2": summary(6.9), "1": summary(4.8)}}))
    (tmp_path / "moe_acc2.5_replay_run2.json").write_text(json.dumps({
        "acceptance": 2.5, "profile": "h200_qwen3_30b_a3b",
        "headline_static_3": summary(26.5)}))
    cells, skipped = read_run_dir(tmp_path)
    assert not skipped
    by_key = {c.key(): c for c in cells}
    c48 = by_key["spec_off one_batch C=48 static_0"]
    assert c48.mean_tpot_ms == pytest.approx(6.9)
    assert "median of 3" in c48.source
    assert by_key["spec_off one_batch C=1 static_0"].mean_tpot_ms == 4.8
    assert by_key["spec_off@2.5 headline 40s static_3"].prior == "h200_qwen3_30b_a3b"
    (tmp_path / "dense_off_run3.json").write_text(json.dumps({"sweep_off": {"48#x": {}}}))
    with pytest.raises(ValueError, match="sweep key '48#x'"):
        read_run_dir(tmp_path)


def test_replay_policies_reports_the_depths_a_policy_chose():
    import replay_policies

    from env.sim.cost_model import load_profile

    server = load_profile("h200_qwen3_30b_a3b")
    off = replay_policies.replay(server, server, 1.1, "static_0")
    three = replay_policies.replay(server, server, 1.1, "static_3")
    assert off["depth_share"] == {0: 1.0} and three["depth_share"] == {3: 1.0}
    # Speculation that never pays: off serves more and faster.
    assert off["throughput_tok_s"] > three["throughput_tok_s"]
    assert off["mean_tpot_ms"] < three["mean_tpot_ms"]


def test_a_run_file_can_be_given_the_prior_it_was_handed(tmp_path):
    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    (tmp_path / "moe_acc2.5_replay_run2.json").write_text(json.dumps({
        "acceptance": 2.5, "profile": "h200_qwen3_30b_a3b", "policy_sha256": "ab",
        "headline_ppo": summary}))
    missing = tmp_path / "prior_then.yaml"
    with pytest.raises(FileNotFoundError, match="prior_then"):
        compare.main([str(tmp_path), "--profile", "moe=h200_qwen3_30b_a3b", "--out",
                      str(tmp_path / "out"), "--prior-file",
                      f"moe_acc2.5_replay_run2.json={missing}"])


def test_load_cells_layouts_closed_loops_and_sglangs_own_rule(tmp_path):
    """load_cells.py's files: closed loops per server and policy, SGLang's rule apart."""
    def summary(tpot):
        return {"throughput_tok_s": 1000.0 / tpot, "mean_tpot_ms": tpot}

    loops = {"1": summary(4.0), "64": summary(7.0)}
    (tmp_path / "moe_nospec_run6.json").write_text(json.dumps(
        {"closed_seconds": 10.0, "closed": loops}))
    (tmp_path / "moe_acc2.5_load_run6.json").write_text(json.dumps(
        {"acceptance": 2.5, "simulate_acc_token_mode": "real-draft-token",
         "closed_seconds": 8.0, "policy_sha256": "ab", "closed_static_3": loops,
         "closed_ppo": {"16": summary(9.0)}}))
    (tmp_path / "moe_acc2.5_sglang_run6.json").write_text(json.dumps(
        {"acceptance": 2.5, "simulate_acc_token_mode": "real-draft-token",
         "closed_seconds": 10.0, "headline_sglang_adaptive": summary(30.0),
         "closed_sglang_adaptive": {"16": summary(8.0)}}))
    # SGLang's rule on the old radix-on server: not this layout (skipped, not misread)
    (tmp_path / "moe_acc25_sglang_adaptive.json").write_text(json.dumps({"closed": loops}))
    cells, skipped = read_run_dir(tmp_path)
    by_key = {c.key(): c for c in cells}
    assert sorted(by_key) == [
        "nospec closed C=1 no_spec", "nospec closed C=64 no_spec",
        "spec_off@2.5 closed C=1 static_3", "spec_off@2.5 closed C=16 ppo",
        "spec_off@2.5 closed C=64 static_3",
        "spec_sglang0@2.5 closed C=16 sglang_adaptive",
        "spec_sglang0@2.5 headline 40s sglang_adaptive"]
    assert by_key["spec_off@2.5 closed C=1 static_3"].seconds == 8.0
    assert by_key["nospec closed C=64 no_spec"].mean_tpot_ms == 7.0
    assert all(not c.radix_cache and c.max_running == 48 and c.tokens == "real"
               and c.apart is None for c in cells)
    assert list(skipped) == ["moe_acc25_sglang_adaptive.json"]
    (tmp_path / "moe_nospec_run6.json").write_text(json.dumps({"closed": {"C1": loops["1"]}}))
    with pytest.raises(ValueError, match="closed-loop key 'C1'"):
        read_run_dir(tmp_path)


def test_a_closed_loop_cell_sends_for_its_seconds_then_drains():
    from omegaconf import OmegaConf

    from env.sim.cost_model import CostProfile, ServerLimits

    profile = CostProfile("p", ServerLimits(64, 100_000, 8192), c_fixed=5e-3, c_request=1e-4)
    client = OmegaConf.create({"start_interval_s": 0.0, "client_overhead_s": 0.0})
    cell = Cell(model="dense", server="nospec", acceptance=None, workload="closed",
                concurrency=4, seconds=1.0, policy="no_spec", radix_cache=False,
                max_running=48, source="x", throughput_tok_s=1.0, mean_tpot_ms=1.0)
    loop, horizon = compare.workload_of(cell, client)
    assert horizon is None and loop.send_until_s == 1.0
    # 128 tokens at 5.4 ms a step: each client's requests take 0.69 s, so it sends two
    # (at 0 and 0.69 s) and the run ends at 1.38 s with 4 * 2 * 128 tokens
    result = compare.simulate(cell, profile, profile, client)
    assert result["throughput_tok_s"] == pytest.approx(4 * 2 * 128 / (2 * 128 * 5.4e-3),
                                                       rel=0.02)


def test_each_recording_server_starts_from_an_empty_folder(tmp_path, monkeypatch):
    """A warm GPU machine keeps RUN between calls; run 8's first traces held every earlier
    server's files because each server recorded into the same folder."""
    import offswitch
    import session

    monkeypatch.setattr(offswitch, "RUN", tmp_path)
    earlier = tmp_path / "trace-load" / "trace-earlier-server-r0-00000.parquet"
    earlier.parent.mkdir()
    earlier.write_bytes(b"x")
    env = offswitch.plugin_env("trace-load")
    assert Path(env["SPECCTL_RECORD"]) == tmp_path / "trace-load"
    assert (tmp_path / "trace-load").is_dir() and not earlier.exists()
    timing = session.fresh(tmp_path / "hooks")
    (timing / "hooks.1.json").write_text("{}")
    assert list(session.fresh(tmp_path / "hooks").iterdir()) == []


def test_the_headline_replay_takes_a_lighter_rate(monkeypatch):
    """HEADLINE_RATE(S): the same trace window compressed into 40 s at another mean rate
    (runs 37-39: at 15 requests/s the MoE's queue never drains); bad values name the
    variable."""
    import offswitch
    import session

    monkeypatch.delenv("HEADLINE_RATE", raising=False)
    monkeypatch.delenv("HEADLINE_RATES", raising=False)
    assert session.headline_rate() == session.HEADLINE_RATE
    assert offswitch.headline_rates() == [(None, "")]
    default = session.headline_workload()
    light = session.headline_workload(rate=6.0)
    assert len(light[0]) < 0.6 * len(default[0])
    assert max(light[0]) < 40.0 and min(light[0]) >= 0.0
    monkeypatch.setenv("HEADLINE_RATE", "6")
    assert session.headline_workload() == light
    monkeypatch.setenv("HEADLINE_RATES", "8,6")
    assert offswitch.headline_rates() == [(8.0, "_r8"), (6.0, "_r6")]
    monkeypatch.setenv("HEADLINE_RATES", "8,6,8")
    assert offswitch.headline_rates() == [(8.0, "_r8"), (6.0, "_r6"), (8.0, "_r8_2")]
    for bad, variable in (("8,x", "HEADLINE_RATES"), ("8,0", "HEADLINE_RATES")):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(SystemExit, match=variable):
            offswitch.headline_rates()
    monkeypatch.setenv("HEADLINE_RATE", "fast")
    with pytest.raises(SystemExit, match="HEADLINE_RATE='fast'"):
        session.headline_rate()


def test_a_policy_served_again_is_read_as_a_later_serving(tmp_path):
    """Policies served several times on one server, interleaved: each serving is a cell of
    its own (``serving``), under a key that says which."""
    import load_cells

    result = {"closed_static_0": {}}
    assert load_cells.loop_key(result, "ppo") == "closed_ppo"
    assert load_cells.loop_key(result, "static_0") == "repeat_closed_static_0"
    result["repeat_closed_static_0"] = {}
    assert load_cells.loop_key(result, "static_0") == "repeat3_closed_static_0"
    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    (tmp_path / "moe_acc2.5_load_run9.json").write_text(json.dumps(
        {"acceptance": 2.5, "simulate_acc_token_mode": "real-draft-token",
         "closed_seconds": 10.0,
         "closed_static_0": {"64": summary},
         "repeat_closed_static_0": {"64": {**summary, "throughput_tok_s": 90.0}},
         "repeat3_closed_static_0": {"64": {**summary, "throughput_tok_s": 80.0}}}))
    cells, _ = read_run_dir(tmp_path)
    assert sorted((c.key(), c.serving, c.throughput_tok_s) for c in cells) == [
        ("spec_off@2.5 closed C=64 static_0", 1, 100.0),
        ("spec_off@2.5 closed C=64 static_0 #2", 2, 90.0),
        ("spec_off@2.5 closed C=64 static_0 #3", 3, 80.0)]


def test_a_repeat_key_must_name_a_later_serving(tmp_path):
    (tmp_path / "moe_acc2.5_load_run9.json").write_text(json.dumps(
        {"acceptance": 2.5, "repeat1_closed_ppo": {"1": {"throughput_tok_s": 1.0,
                                                         "mean_tpot_ms": 1.0}}}))
    with pytest.raises(ValueError, match=r"moe_acc2.5_load_run9.json: key 'repeat1_closed_ppo'"):
        read_run_dir(tmp_path)


def closed_rows(servings: dict[str, list[tuple[float, float]]]) -> list[dict]:
    """Rows of one closed-loop group: per policy, (measured, simulated) of each serving."""
    return [{**row(policy, m, s), "workload": "closed", "group": "run/moe spec_off@2.5",
             "cell": f"spec_off@2.5 closed C=16 {policy}"}
            for policy, runs in servings.items() for m, s in runs]


def test_rankings_and_separated_pairs_take_the_median_of_servings():
    rows = closed_rows({"a": [(1000.0, 900.0), (700.0, 900.0), (990.0, 900.0)],
                        "b": [(800.0, 1000.0)]})
    assert compare.rankings(rows) == {"run/moe spec_off@2.5 closed C=16": (["a", "b"],
                                                                          ["b", "a"])}
    assert compare.separated_pairs(rows, noise=0.06) == (0, 1)


def test_established_pairs_need_every_serving_of_one_above_every_serving_of_the_other():
    rows = closed_rows({
        "static_3": [(1000.0, 1010.0), (1020.0, 1010.0)],
        "ppo": [(990.0, 1030.0), (1010.0, 1030.0)],  # overlaps static_3: order open
        "static_0": [(700.0, 750.0), (720.0, 750.0)],  # below both: established twice
        "static_1": [(800.0, 820.0)]})  # served once: not counted
    pairs = compare.established_pairs(rows)
    # ppo vs static_3: measured gaps -3.0% .. +1.0%, simulated +1.9%: within +-1% of them
    assert pairs == {"established": 2, "agree": 2, "open": 1, "consistent": 1}
    rows[2] = {**rows[2], "simulated_tok_s": 1250.0}  # ppo simulated 19% above: outside
    rows[3] = {**rows[3], "simulated_tok_s": 1250.0}
    rows[4] = {**rows[4], "simulated_tok_s": 1200.0}  # static_0 simulated above static_3
    rows[5] = {**rows[5], "simulated_tok_s": 1200.0}
    assert compare.established_pairs(rows) == {"established": 2, "agree": 1, "open": 1,
                                               "consistent": 0}


def test_window_throughput_counts_only_tokens_streamed_before_the_deadline():
    from measured_runs import window_throughput

    # done before: all 10; straddling (first at 8 s, done at 12 s): 1 + 9 * (10-8)/(12-8);
    # first token after the deadline: none
    tokens = window_throughput([1.0, 8.0, 10.5], [5.0, 12.0, 11.0], [10, 10, 10], 10.0)
    assert tokens == pytest.approx((10 + 1 + 9 * 0.5) / 10.0)
    with pytest.raises(ValueError, match="positive"):
        window_throughput([1.0], [2.0], [3], 0.0)


def test_closed_loops_with_per_request_times_get_a_window_throughput(tmp_path):
    loop = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0,
            "per_request": [[0.0, 0.5, 4.0, 8], [4.0, 4.5, 12.0, 16]]}
    (tmp_path / "moe_acc2.5_load_run10.json").write_text(json.dumps(
        {"acceptance": 2.5, "closed_seconds": 10.0, "closed_ppo": {"1": loop},
         "closed_static_3": {"1": {"throughput_tok_s": 90.0, "mean_tpot_ms": 5.0}}}))
    cells = {c.policy: c for c in read_run_dir(tmp_path)[0]}
    assert cells["ppo"].window_tok_s == pytest.approx((8 + 1 + 15 * 5.5 / 7.5) / 10.0)
    assert cells["static_3"].window_tok_s is None


def test_established_pairs_on_the_window_metric_skip_rows_without_it():
    rows = closed_rows({"a": [(1000.0, 1000.0)] * 2, "b": [(900.0, 950.0)] * 2})
    for r, window in zip(rows, (500.0, 510.0, 400.0, None), strict=True):
        r["measured_window_tok_s"] = window
        r["simulated_window_tok_s"] = 505.0 if r["policy"] == "a" else 410.0
    # b has one serving with the window metric left: no pair has two servings each
    assert compare.established_pairs(rows, "window_tok_s")["established"] == 0
    rows[3]["measured_window_tok_s"] = 390.0
    assert compare.established_pairs(rows, "window_tok_s") == {
        "established": 1, "agree": 1, "open": 0, "consistent": 0}


def test_prefix_workload_shares_group_prefixes_and_nothing_else():
    import prefix_workload as pw

    arrivals, shared, outputs = pw.prefix_workload(True, seconds=5.0)
    arrivals_u, unique, _ = pw.prefix_workload(False, seconds=5.0)
    assert arrivals == arrivals_u and len(arrivals) == len(outputs) > 20
    assert [len(b) for b in shared] == [len(b) for b in unique]
    every = [b for blocks in unique for b in blocks]
    assert len(set(every)) == len(every), "unique prompts share no block"
    prefixes = {tuple(b[:pw.SHARED_BLOCKS]) for b in shared}
    assert 1 < len(prefixes) <= pw.GROUPS
    assert pw.token_ids(shared[0][:2]) == pw.token_ids(shared[0][:1]) + pw.token_ids(shared[0][1:2])
    assert pw.token_ids([5]) != pw.token_ids([6])
    assert len(pw.token_ids(shared[0])) == pw.prompt_tokens(shared[0])


def test_prefix_runs_are_read_with_the_radix_cache_on_and_simulated_with_it(tmp_path):
    from omegaconf import OmegaConf

    from env.sim.cost_model import CostProfile, ServerLimits

    summary = {"throughput_tok_s": 600.0, "mean_tpot_ms": 6.0}
    (tmp_path / "dense_prefix_run10.json").write_text(json.dumps(
        {"radix_cache": True, "seconds": 3.0, "unique_prefix": summary,
         "shared_prefix": summary}))
    cells = {c.workload: c for c in read_run_dir(tmp_path)[0]}
    assert cells["shared_prefix"].key() == "nospec shared_prefix 3s no_spec"
    assert all(c.radix_cache and c.apart is None for c in cells.values())
    # prefill dear enough that 10 whole 3,584-token prompts a second saturate the server
    profile = CostProfile("p", ServerLimits(48, 700_000, 8192), c_fixed=5e-3,
                          c_request=1e-5, c_prefill_token=4e-5)
    client = OmegaConf.create({"start_interval_s": 0.0, "client_overhead_s": 0.0})
    unique, shared = (compare.simulate(cells[w], profile, profile, client)
                      for w in ("unique_prefix", "shared_prefix"))
    assert shared["mean_tpot_ms"] < 0.8 * unique["mean_tpot_ms"]
    assert shared["throughput_tok_s"] > unique["throughput_tok_s"]
    without = compare.simulate(replace(cells["shared_prefix"], radix_cache=False), profile,
                               profile, client)
    assert without["mean_tpot_ms"] == pytest.approx(unique["mean_tpot_ms"], rel=0.05)


def test_a_prefix_run_at_another_rate_is_simulated_at_its_rate(tmp_path):
    """``PREFIX_RATE`` runs: the file's rate reaches the cell and the simulated arrivals."""
    from omegaconf import OmegaConf

    from env.sim.cost_model import CostProfile, ServerLimits

    summary = {"throughput_tok_s": 600.0, "mean_tpot_ms": 6.0}
    for name, rate in (("dense_prefix_run10.json", None), ("dense_prefix_run12.json", 2.0)):
        data = {"radix_cache": True, "seconds": 10.0, "unique_prefix": summary}
        if rate is not None:
            data["rate"] = rate
        (tmp_path / name).write_text(json.dumps(data))
    cells = {c.source.split(":")[0]: c for c in read_run_dir(tmp_path)[0]}
    default, slow = cells["dense_prefix_run10.json"], cells["dense_prefix_run12.json"]
    assert (default.rate, slow.rate) == (None, 2.0)
    assert slow.key() == "nospec unique_prefix 2/s 10s no_spec"
    profile = CostProfile("p", ServerLimits(48, 700_000, 8192), c_fixed=5e-3, c_request=1e-5,
                          c_prefill_token=1e-6)
    client = OmegaConf.create({"start_interval_s": 0.0, "client_overhead_s": 0.0})
    tok_s = {c.rate: compare.simulate(c, profile, profile, client)["throughput_tok_s"]
             for c in (default, slow)}
    import prefix_workload as pw

    # an unsaturated server's throughput follows the arrival rate (10/s by default)
    assert tok_s[2.0] == pytest.approx(tok_s[None] * 2.0 / pw.RATE, rel=0.25)


@pytest.mark.parametrize("pool", [False, True])
def test_leases_of_one_configuration_are_ranked_apart_unless_pooled(tmp_path, pool):
    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    for run in ("run9", "run10"):
        (tmp_path / f"moe_acc2.5_load_{run}.json").write_text(json.dumps(
            {"acceptance": 2.5, "simulate_acc_token_mode": "real-draft-token",
             "closed_seconds": 1.0, "policy_sha256": "ab",
             "closed_static_0": {"1": summary}, "closed_static_1": {"1": summary}}))
    out = tmp_path / "out"
    compare.main([str(tmp_path), "--profile", "moe=h200_qwen3_30b_a3b", "--out", str(out)]
                 + (["--pool-leases"] if pool else []))
    rows = json.loads((out / "fidelity_moe.json").read_text())["cells"]
    assert len(rows) == 4
    assert len(compare.ranking_groups(rows)) == (1 if pool else 2)


def test_pooled_leases_keep_different_trained_policies_apart():
    """Two leases' ``ppo`` cells ran different exported policies: not one policy's samples."""
    rows = closed_rows({"ppo": [(1000.0, 1000.0), (900.0, 1000.0)], "static_3": [(950.0, 950.0)]})
    rows[0]["policy_sha256"], rows[1]["policy_sha256"] = "aa" * 32, "bb" * 32
    assert sorted(compare.samples(rows, "measured_tok_s")) == ["ppo:aaaaaaaa", "ppo:bbbbbbbb",
                                                               "static_3"]
    rows[1]["policy_sha256"] = "aa" * 32
    assert compare.samples(rows, "measured_tok_s")["ppo:aaaaaaaa"] == [1000.0, 900.0]


def test_ppo_cells_run_the_policy_their_run_recorded(tmp_path, capsys):
    import hashlib

    from controller.default_policy import default_policy_path

    known = compare.known_policies()
    shipped = hashlib.sha256(default_policy_path().read_bytes()).hexdigest()
    assert known[shipped] == str(default_policy_path())
    kept = REPO_ROOT / "docs/results/h200/policy_fb769766.npz"
    assert known[hashlib.sha256(kept.read_bytes()).hexdigest()] == str(kept)

    def cell(policy, sha):
        return Cell(model="moe", server="spec_off", acceptance=2.5, workload="closed",
                    concurrency=1, seconds=10.0, policy=policy, radix_cache=False,
                    max_running=48, source="f.json:closed_ppo.1", throughput_tok_s=1.0,
                    mean_tpot_ms=1.0, policy_sha256=sha)

    by_sha = {hashlib.sha256(kept.read_bytes()).hexdigest(): str(kept)}
    assert compare.policy_of(cell("ppo", next(iter(by_sha))), by_sha, None) == str(kept)
    assert compare.policy_of(cell("static_3", next(iter(by_sha))), by_sha, None) is None
    assert compare.policy_of(cell("ppo", None), by_sha, "x.npz") == "x.npz"
    assert compare.policy_of(cell("ppo", "0123456789"), by_sha, None) is None
    assert "policy 01234567 is not kept" in capsys.readouterr().err


def test_a_plugin_runs_loops_are_listed_in_the_order_they_ran(tmp_path):
    """``plugin_servings``: per serving, in the order served, its loops in the order run,
    with the warm-up's seconds; files of other phases have none."""
    from measured_runs import plugin_servings

    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    loops = {"1": summary, "16": summary}
    name = "dense_acc3.5_load_run15.json"
    (tmp_path / name).write_text(json.dumps(
        {"acceptance": 3.5, "closed_seconds": 10.0, "warmup_seconds": 5.0,
         "closed_static_3": loops, "closed_ppo": loops, "repeat_closed_static_3": loops}))
    assert plugin_servings(tmp_path / name) == (5.0, [
        [f"{name}:closed_static_3.1", f"{name}:closed_static_3.16"],
        [f"{name}:closed_ppo.1", f"{name}:closed_ppo.16"],
        [f"{name}:repeat_closed_static_3.1", f"{name}:repeat_closed_static_3.16"]])
    (tmp_path / "dense_nospec_run15.json").write_text(json.dumps({"closed": loops}))
    assert plugin_servings(tmp_path / "dense_nospec_run15.json") is None
    cells, _ = read_run_dir(tmp_path)
    assert {c.source for c in cells} >= {s for serving in plugin_servings(tmp_path / name)[1]
                                         for s in serving}


def test_a_servings_loops_carry_the_controllers_state(tmp_path, monkeypatch):
    """Replayed in order, a loop starts from the feature builder the loops before it left
    (acceptance measured by SGLang's start-up request and static 3's serving), where alone
    it starts cold; a static policy's own loop is the same either way."""
    from omegaconf import OmegaConf

    from env.features import FeatureSpec
    from env.sim.cost_model import load_profile

    profile = load_profile("h200_llama31_8b")
    client = OmegaConf.create({"start_interval_s": 0.0, "client_overhead_s": 0.0})
    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    name = "dense_acc3.5_load_run15.json"
    (tmp_path / name).write_text(json.dumps(
        {"acceptance": 3.5, "closed_seconds": 1.0, "warmup_seconds": 0.5,
         "closed_static_3": {"1": summary}, "closed_ppo": {"1": summary}}))
    cells, _ = read_run_dir(tmp_path)
    by_source = {c.source: c for c in cells}
    confidence = FeatureSpec().names().index("accept_confidence_1")
    seen: list[float] = []
    original = compare.simulate

    def spy(cell, *args, features=None, **kwargs):
        # how sure of the first draft's acceptance the stream was when this loop began
        seen.append(features.observation(1).vector[confidence])
        return original(cell, *args, features=features, **kwargs)

    monkeypatch.setattr(compare, "simulate", spy)
    out = compare.simulate_servings(tmp_path / name, by_source, profile, profile, client,
                                    lambda cell: None)
    monkeypatch.undo()
    assert sorted(out) == [f"{name}:closed_ppo.1", f"{name}:closed_static_3.1"]
    # the server's start-up request from nothing, then static 3's warm-up and loop, then
    # the policy's: each warmer
    assert seen[0] == 0.0 and 0.0 < seen[1] < seen[2] < seen[3] <= seen[4]
    alone = compare.simulate(by_source[f"{name}:closed_static_3.1"], profile, profile, client)
    assert alone["throughput_tok_s"] == pytest.approx(
        out[f"{name}:closed_static_3.1"]["throughput_tok_s"])



def test_ppo_cells_replay_the_goodput_guard_their_run_served(tmp_path, monkeypatch):
    """Runs before the guard served none and record none; later ones record what was
    served (``session.served_policy``), and the replay runs that."""
    from env.guard import NO_GUARD, GuardSpec

    loops = {"16": {"throughput_tok_s": 100.0, "mean_tpot_ms": 9.0}}
    common = {"acceptance": 2.5, "simulate_acc_token_mode": "real-draft-token",
              "closed_seconds": 8.0, "policy_sha256": "ab", "closed_ppo": loops}
    served = GuardSpec(margin=0.2).to_dict()
    (tmp_path / "moe_acc2.5_load_run6.json").write_text(json.dumps(common))
    (tmp_path / "moe_acc2.5_load_run30.json").write_text(json.dumps({**common,
                                                                      "guard": served}))
    cells = {c.source.split(":")[0]: c for c in read_run_dir(tmp_path)[0]}
    before, after = cells["moe_acc2.5_load_run6.json"], cells["moe_acc2.5_load_run30.json"]
    assert before.guard is None and compare.served_guard(before) == NO_GUARD
    assert compare.served_guard(after) == GuardSpec(margin=0.2)

    chosen = []

    def make_policy(name, **kwargs):  # what simulate hands the policy, then stop
        chosen.append(kwargs["guard"])
        raise RuntimeError("stop")

    monkeypatch.setattr(compare, "make_policy", make_policy)
    profile = compare.load_profile("h200_qwen3_30b_a3b")
    client = compare.OmegaConf.load(REPO_ROOT / "docs/results/h200/fidelity/client.yaml")
    # ``ppo_noguard``: the shipped policy served with its guard off on the same server
    noguard = replace(after, policy=compare.NO_GUARD_NAME)
    for cell, guard in ((before, None), (after, None), (before, GuardSpec()),
                        (noguard, None), (noguard, GuardSpec())):
        with pytest.raises(RuntimeError, match="stop"):
            compare.simulate(cell, profile, profile, client, guard=guard)
    assert chosen == [NO_GUARD, GuardSpec(margin=0.2), GuardSpec(), NO_GUARD, NO_GUARD]


def test_session_writes_the_shipped_policy_without_its_guard_for_an_ab(tmp_path, monkeypatch):
    import session

    from controller.policy_file import ExportedPolicy
    from env.guard import NO_GUARD

    monkeypatch.setattr(session, "RUN", tmp_path)
    monkeypatch.setattr(session, "CANDIDATES", [0, 1, 3])
    from controller.default_policy import default_policy_path

    paths = session.write_policies()
    shipped, noguard = (ExportedPolicy.load(paths[k]) for k in ("ppo", "ppo_noguard"))
    # the shipped file's own guard (margin -0.02 since the thirteenth session)
    assert shipped.guard == ExportedPolicy.load(default_policy_path()).guard != NO_GUARD
    assert noguard.guard == NO_GUARD
    # a constant depth is what the static policies measure: no guard turns them off
    assert all(ExportedPolicy.load(paths[f"static_{k}"]).guard == NO_GUARD for k in (0, 1, 3))
    assert noguard.probe == shipped.probe
    assert all((a == b).all() for a, b in zip(noguard.weights, shipped.weights, strict=True))


def test_a_run_records_the_guard_specctl_serve_serves(tmp_path, monkeypatch):
    import hashlib

    import session

    from controller.default_policy import default_policy_path
    from controller.policy_file import ExportedPolicy
    from env.guard import NO_GUARD

    path = default_policy_path()
    files_guard = ExportedPolicy.load(path).guard.to_dict()
    monkeypatch.delenv("SPECCTL_SERVE_OVERRIDES", raising=False)
    record = session.served_policy(path)
    assert record == {"policy_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                      "guard": files_guard, "static_guard": NO_GUARD.to_dict()}
    monkeypatch.setenv("SPECCTL_SERVE_OVERRIDES", "probe.enabled=false guard.enabled=false "
                                                  "guard.margin=0.3")
    assert session.served_policy(path)["guard"] == {**files_guard,
                                                    "enabled": False, "margin": 0.3}


def test_constant_policies_served_with_the_guard_are_reported_apart(tmp_path):
    """Runs 26-27 served the static policies with the default guard (it ran MoE@1.1's
    static_1 off on 97% of steps): those cells are not the constant depth simulated."""
    loops = {"16": {"throughput_tok_s": 100.0, "mean_tpot_ms": 9.0}}
    common = {"acceptance": 1.1, "simulate_acc_token_mode": "real-draft-token",
              "closed_seconds": 10.0, "policy_sha256": "ab", "closed_ppo": loops,
              "closed_static_1": loops}
    guard = {"enabled": True}
    for run, extra in ((25, {}), (27, {"guard": guard}),
                       (28, {"guard": guard, "static_guard": {"enabled": False}})):
        (tmp_path / f"moe_acc1.1_load_run{run}.json").write_text(json.dumps({**common, **extra}))
    apart = {c.source: c.apart for c in read_run_dir(tmp_path)[0]}
    assert apart["moe_acc1.1_load_run27.json:closed_static_1.16"] == "guarded static"
    assert apart["moe_acc1.1_load_run25.json:closed_static_1.16"] is None  # before the guard
    assert apart["moe_acc1.1_load_run28.json:closed_static_1.16"] is None  # served unguarded
    assert apart["moe_acc1.1_load_run27.json:closed_ppo.16"] is None


def test_a_servings_features_are_its_first_ppo_variants_policy_files():
    """One controller stream computed every serving's features, as the first PPO policy's
    file says (the shipped one: latency_model 3); the static policies take none of their own."""
    base = {"model": "moe", "server": "spec_off", "acceptance": 1.1, "workload": "closed",
            "concurrency": 16, "seconds": 10.0, "radix_cache": False, "max_running": 48,
            "throughput_tok_s": 1.0, "mean_tpot_ms": 1.0}
    cells = {"s": Cell(**base, policy="static_1", source="s"),
             "g": Cell(**base, policy=compare.NO_GUARD_NAME, source="g")}
    shipped = compare.make_policy("ppo").feature_spec(compare.FeatureSpec())
    assert shipped != compare.FeatureSpec()  # else this test shows nothing
    assert compare._servings_spec(cells, [["s"], ["g"]], lambda cell: None) == shipped
    assert compare._servings_spec(cells, [["s"]], lambda cell: None) == compare.FeatureSpec()


def test_extra_policies_are_served_by_name_and_bad_entries_name_the_variable(
        tmp_path, monkeypatch):
    """EXTRA_POLICIES: a candidate file served beside the shipped one (the GPU A/B of the
    local cost correction); a malformed entry or a missing file fails before any server."""
    import session

    monkeypatch.delenv("EXTRA_POLICIES", raising=False)
    assert session.extra_policies() == {}
    candidate = REPO_ROOT / "docs/results/local_cost/policy_bc78eef5.npz"
    monkeypatch.setenv("EXTRA_POLICIES", f" local={candidate} ,")
    assert session.extra_policies() == {"local": candidate}
    monkeypatch.setattr(session, "RUN", tmp_path)
    monkeypatch.setattr(session, "CANDIDATES", [0, 3])
    paths = session.write_policies()
    assert paths["local"].read_bytes() == candidate.read_bytes()
    # what a run file records of it (offswitch.py's extra_policies)
    assert session.served_policy(paths["local"])["policy_sha256"] == hashlib.sha256(
        candidate.read_bytes()).hexdigest()
    assert {"static_0", "static_3", "ppo"} <= set(paths)
    for bad, message in (("local", "not name=path"), ("=x.npz", "not name=path"),
                         (f"local={tmp_path}/none.npz", "no file")):
        monkeypatch.setenv("EXTRA_POLICIES", bad)
        with pytest.raises(SystemExit, match=f"EXTRA_POLICIES: .*{message}"):
            session.extra_policies()


def test_the_compile_log_times_each_dynamo_compile(tmp_path):
    """compile_log.install: a torch.compile compile is written as one timed JSON line (the
    callbacks Dynamo calls around a compile, called here as Dynamo would)."""
    from compile_log import install
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler

    starts, ends = len(callback_handler.start_callbacks), len(callback_handler.end_callbacks)
    install(str(tmp_path))
    try:
        args = CallbackArgs(CallbackTrigger.DYNAMO, "3/1")
        callback_handler.start_callbacks[-1](args)
        callback_handler.end_callbacks[-1](args)
    finally:
        for registered in callback_handler.start_callbacks[starts:]:
            callback_handler.remove_start_callback(registered)
        for registered in callback_handler.end_callbacks[ends:]:
            callback_handler.remove_end_callback(registered)
    lines = [json.loads(line) for file in tmp_path.glob("compiles-*.jsonl")
             for line in file.read_text().splitlines()]
    dynamo = [line for line in lines if line["kind"] == "dynamo"]
    assert [line["name"] for line in dynamo] == ["3/1"]
    assert 0 <= dynamo[0]["seconds"] < 60 and dynamo[0]["start"] > 1.7e9


def test_first_use_stalls_finds_the_slow_decode_step_and_the_compile_inside_it(
        tmp_path, capsys):
    """first_use_stalls.py: a decode step 120 ms over its (depth, batch) median is a stall,
    reported with the compile that started during it; prefills and ordinary steps are not;
    a bad compile-log line names the file and line."""
    import numpy as np
    from first_use_stalls import main, read_compiles

    from env.traces.schema import StepRecord
    from env.traces.trace_format import write_trace

    t0_unix = 1_796_290_000.0
    steps = []
    for i in range(20):
        latency = 0.130 if i == 7 else 0.010
        prefill = 256 if i == 3 else 0
        steps.append(StepRecord("srv", 0, i, 1.0 + 0.05 * i, 4, 0, 4, 100, 10_000, prefill,
                                0, np.array([], np.int8), 0.5 if prefill else latency))
    write_trace(tmp_path / "trace" / "t.parquet", steps=steps, meta={"t0_unix": t0_unix})
    log = tmp_path / "compiles.jsonl"
    log.write_text("\n".join(json.dumps(entry) for entry in (
        {"kind": "triton", "name": "m.assign_extend_cache_locs", "start": t0_unix + 1.36,
         "seconds": 0.11},
        {"kind": "triton", "name": "m.far_away", "start": t0_unix + 30.0, "seconds": 0.2},
        {"kind": "error", "name": "triton: not installed", "start": t0_unix + 1.37,
         "seconds": 0.0})) + "\n")
    main([str(tmp_path / "trace"), str(log)])
    out = capsys.readouterr().out
    assert "depth 0 batch 4: 130 ms; compiles: assign_extend_cache_locs 110 ms" in out
    assert "far_away" not in out and "not installed" not in out
    assert "1 stalled decode steps in the first 60 s (0.13 s); compiles during them: 0.11 s" in out
    log.write_text('{"kind": "triton"}\n')
    with pytest.raises(SystemExit, match=r"compiles\.jsonl, line 1"):
        read_compiles(log)


def test_replays_at_a_rate_are_read_with_their_rate_and_simulated_at_it(tmp_path):
    def summary(tpot):
        return {"throughput_tok_s": 1000.0 / tpot, "mean_tpot_ms": tpot}

    # offswitch.py's HEADLINE_RATES files, as docs/results keeps them (_r8, _r8_2, _runN)
    (tmp_path / "moe_acc2.5_replay_r8_run41.json").write_text(json.dumps({
        "acceptance": 2.5, "profile": "h200_qwen3_30b_a3b", "headline_rate": 8.0,
        "headline_static_0": summary(23.8), "headline_local": summary(22.0)}))
    (tmp_path / "moe_nospec_replay_r6_2_run40.json").write_text(json.dumps({
        "model": "models_moe", "headline_rate": 6.0, "headline": summary(20.1)}))
    cells, skipped = read_run_dir(tmp_path)
    assert not skipped
    by_key = {c.key(): c for c in cells}
    assert by_key["spec_off@2.5 headline 8/s 40s static_0"].rate == 8.0
    assert by_key["nospec headline 6/s 40s no_spec"].rate == 6.0
    # the simulator replays the rate the run did: more requests at 8/s than at 6/s
    light = compare.workload_of(replace(by_key["spec_off@2.5 headline 8/s 40s static_0"],
                                        rate=6.0), None)[0]
    heavy = compare.workload_of(by_key["spec_off@2.5 headline 8/s 40s static_0"], None)[0]
    assert len(heavy.arrival_s) > len(light.arrival_s)
    # a headline of a name without an extra_policies entry is not simulable
    assert compare.simulable("static_0") and compare.simulable("ppo")
    local = by_key["spec_off@2.5 headline 8/s 40s local"]
    assert not compare.simulable(local.policy) and not local.extra_policy


def test_an_extra_policy_cell_runs_its_recorded_file_and_guard_as_ppo(tmp_path):
    """EXTRA_POLICIES names (offswitch.py's extra_policies: a candidate served beside the
    shipped file) are read with their own file and guard and simulated as ppo with them."""
    from controller.default_policy import default_policy_path

    def summary(tpot):
        return {"throughput_tok_s": 1000.0 / tpot, "mean_tpot_ms": tpot}

    candidate = Path(__file__).resolve().parents[1] / "docs/results/drop_warmup/policy_c45d9410.npz"
    sha = hashlib.sha256(candidate.read_bytes()).hexdigest()
    guard = {"enabled": True, "margin": 0.05, "confidence": 0.5, "max_profile_error": 0.5}
    shipped = hashlib.sha256(default_policy_path().read_bytes()).hexdigest()
    (tmp_path / "moe_acc2.5_replay_r8_run46.json").write_text(json.dumps({
        "acceptance": 2.5, "profile": "h200_qwen3_30b_a3b", "headline_rate": 8.0,
        "policy_sha256": shipped, "guard": None,
        "extra_policies": {"dw": {"policy_sha256": sha, "guard": guard}},
        "headline_ppo": summary(22.0), "headline_dw": summary(21.5)}))
    cells, _ = read_run_dir(tmp_path)
    by_policy = {c.policy: c for c in cells}
    dw, ppo = by_policy["dw"], by_policy["ppo"]
    assert dw.extra_policy and dw.policy_sha256 == sha and dw.guard == guard
    assert not ppo.extra_policy and ppo.policy_sha256 == shipped and ppo.guard is None
    known = compare.known_policies()
    assert compare.policy_of(dw, known, None) == str(candidate)
    assert compare.served_guard(dw).margin == 0.05
    # simulated as the ppo cell of the same file and guard is
    as_ppo = replace(dw, policy="ppo", extra_policy=False)
    profile = compare.load_profile("h200_qwen3_30b_a3b")
    run = {name: compare.simulate(c, profile, profile, None, policy_path=str(candidate),
                                  sim_overrides={"min_switch_steps": 0})
           for name, c in (("dw", dw), ("ppo", as_ppo))}
    assert run["dw"] == run["ppo"]


def test_plugin_cells_carry_the_steps_their_server_offered(tmp_path):
    """offswitch.py's / load_cells.py's plugin servers offered 0, 1, 3, 5 (their adaptive
    config); a file that records its candidates is read as recorded; servers without the
    plugin's controller offer nothing to mask."""
    import offswitch
    from measured_runs import OFFSWITCH_CANDIDATES

    assert list(OFFSWITCH_CANDIDATES) == offswitch.CANDIDATES
    summary = {"throughput_tok_s": 100.0, "mean_tpot_ms": 5.0}
    (tmp_path / "moe_acc2.5_replay_r6_run48.json").write_text(json.dumps({
        "acceptance": 2.5, "profile": "h200_qwen3_30b_a3b", "headline_rate": 6.0,
        "headline_ppo": summary}))
    (tmp_path / "dense_acc3.5_replay_run2.json").write_text(json.dumps({
        "acceptance": 3.5, "candidates": [0, 3], "headline_ppo": summary}))
    (tmp_path / "moe_acc2.5_sglang_run6.json").write_text(json.dumps({
        "acceptance": 2.5, "headline_sglang_adaptive": summary}))
    (tmp_path / "moe_nospec_replay_r6_run47.json").write_text(json.dumps({
        "headline_rate": 6.0, "headline": summary}))
    cells, _ = read_run_dir(tmp_path)
    by_file = {c.source.split(":")[0]: c.candidates for c in cells}
    assert by_file == {"moe_acc2.5_replay_r6_run48.json": (0, 1, 3, 5),
                       "dense_acc3.5_replay_run2.json": (0, 3),
                       "moe_acc2.5_sglang_run6.json": None,
                       "moe_nospec_replay_r6_run47.json": None}


def test_a_ppo_cell_runs_only_the_steps_its_server_offered():
    """The shipped file's first choice on the MoE @ 2.5 replay at 6 req/s with the
    warm-up is depth 2, which the plugin's servers never ran (runs 37-50 offered 0, 1, 3,
    5): simulated over every depth it runs 2 on most decisions, over the server's steps
    never (replay_policies.py masks the same way by default)."""
    import replay_policies

    from env.sim.cost_model import load_profile

    server = load_profile(REPO_ROOT / "docs/results/h200/fidelity/moe_real_spec.yaml")
    prior = load_profile("h200_qwen3_30b_a3b")
    cell = Cell(model="moe", server="spec_off", acceptance=2.5, workload="headline",
                concurrency=None, seconds=40.0, policy="ppo", radix_cache=False,
                max_running=48, source="", throughput_tok_s=1.0, mean_tpot_ms=1.0,
                rate=6.0, candidates=(0, 1, 3, 5))
    warm = {"reentry_warmup": True}
    served = compare.simulate(cell, server, prior, None, sim_overrides=warm)["steps_chosen"]
    every = compare.simulate(replace(cell, candidates=None), server, prior, None,
                             sim_overrides=warm)["steps_chosen"]
    assert served[2] == served[4] == served[6] == served[7] == 0 and sum(served) > 0
    assert every[2] > 0.5 * sum(every)
    assert set(replay_policies.replay(server, prior, 2.5, "ppo")["depth_share"]) <= {0, 1, 3, 5}


@pytest.mark.parametrize("server", ["spec_off", "spec_sglang0", "nospec"])
def test_the_plugins_servers_are_simulated_with_its_switch_hold(monkeypatch, server):
    """A spec_off cell is the plugin's server: its default hold between depth switches
    (SPECCTL_MIN_SWITCH_STEPS), unless the overrides say otherwise; other servers none."""
    from sglang_hooks.config import PluginConfig

    assert PluginConfig().min_switch_steps == compare.PLUGIN_MIN_SWITCH_STEPS
    seen = []

    class Recording(compare.Simulator):
        def __init__(self, profile, acceptance, workload, config, seed=0):
            seen.append(config.min_switch_steps)
            super().__init__(profile, acceptance, workload, config, seed=seed)

    monkeypatch.setattr(compare, "Simulator", Recording)
    cell = Cell(model="moe", server=server, acceptance=2.5, workload="one_batch",
                concurrency=2, seconds=None, policy="static_0", radix_cache=False,
                max_running=48, source="", throughput_tok_s=1.0, mean_tpot_ms=1.0)
    profile = compare.load_profile("h200_qwen3_30b_a3b")
    client = compare.OmegaConf.create({"start_interval_s": 0.0, "client_overhead_s": 0.0})
    compare.simulate(cell, profile, profile, client)
    compare.simulate(cell, profile, profile, client, sim_overrides={"min_switch_steps": 0})
    assert seen == [4 if server == "spec_off" else 0, 0]

"""Randomised servers, the profile handed to the controller, and the low-acceptance
training episodes that put the two together."""

from __future__ import annotations

import numpy as np
import pytest

from env.scenarios import LowAcceptanceEpisodes, ScenarioSampler
from env.sim.acceptance import DriftingAcceptance, acceptance_from_config
from env.sim.cost_model import load_profile
from env.sim.random_servers import (
    KV_VERIFY,
    OPTIMISTIC_FACTOR,
    PRIOR_MODES,
    SPECULATIVE_COEFFICIENTS,
    UNPERTURBED_COEFFICIENTS,
    handed_profile,
    perturbed,
    random_server,
)


def test_random_servers_span_the_regimes():
    rng = np.random.default_rng(0)
    lengths, speedups, moe = [], [], 0
    for _ in range(300):
        profile, acceptance = random_server(rng)
        lengths.append(acceptance.expected_accept_length_at(7))
        moe += profile.moe_active_fraction > 0
        b = 1
        on = (1 + acceptance.expected_accepted(3)) / profile.step_latency_s(b, 3, 500)
        off = 1 / profile.step_latency_s(b, 0, 500, 0, False, False)
        speedups.append(on / off)
    assert min(lengths) < 1.2 and max(lengths) > 5.0
    assert 50 < moe < 250
    # Speculation pays on some servers and loses on others, even at batch 1.
    assert min(speedups) < 0.8 and max(speedups) > 2.0


def test_handed_profile_modes():
    rng = np.random.default_rng(1)
    truth = load_profile("h200_llama31_8b")
    other = load_profile("blackwell_tp8")
    assert handed_profile(truth, "exact", rng) is truth
    assert handed_profile(truth, "none", rng) is None
    assert handed_profile(truth, "swapped", rng, [truth, other]) is other
    off = handed_profile(truth, "perturbed", rng)
    ratios = np.array([off.coefficients[k] / v for k, v in truth.coefficients.items() if v])
    assert ((ratios >= 0.5) & (ratios <= 1.5)).all() and np.ptp(ratios) > 0.3
    with pytest.raises(ValueError, match="cost prior mode"):
        handed_profile(truth, "magic", rng)
    assert set(PRIOR_MODES) == {"exact", "perturbed", "swapped", "none", "optimistic"}


def test_optimistic_profile_prices_only_speculation_too_cheaply():
    truth = load_profile("h200_llama31_8b").replace(c_steps0=1e-3)
    off = (48, 0, 24_000, 0, False, False)
    factors = []
    for seed in range(30):
        cheap = handed_profile(truth, "optimistic", np.random.default_rng(seed))
        factor = cheap.c_verify / truth.c_verify
        factors.append(factor)
        assert OPTIMISTIC_FACTOR[0] <= factor <= OPTIMISTIC_FACTOR[1]
        for name, value in truth.coefficients.items():  # one factor, speculative terms only
            want = value * factor if name in SPECULATIVE_COEFFICIENTS else value
            assert getattr(cheap, name) == pytest.approx(want, rel=1e-12), name
        assert cheap.step_latency_s(*off) == truth.step_latency_s(*off)
        assert cheap.step_latency_s(48, 3, 24_000) < truth.step_latency_s(48, 3, 24_000)
    assert max(factors) - min(factors) > 0.2


def test_a_perturbed_profile_draws_as_many_numbers_as_the_shipped_policy_was_trained_with():
    """The scenarios of training and evaluation are drawn from one stream: a coefficient
    added to the cost model must not take a number from it (that moved every later
    scenario once, docs: UNPERTURBED_COEFFICIENTS). 17 factors, in the coefficients'
    order; the terms left out are kept as they are."""
    truth = load_profile("h100_llama31_8b").replace(c_prefill_pair=1e-9,
                                                    c_prefill_cached_token=1e-6)
    rng = np.random.default_rng(3)
    off = perturbed(truth, rng)
    reference = np.random.default_rng(3)
    factors = reference.uniform(0.5, 1.5, size=17)
    assert rng.random() == reference.random()  # the stream continues where it would have
    drawn = [name for name in truth.coefficients if name not in UNPERTURBED_COEFFICIENTS]
    assert len(drawn) == 17
    for name, factor in zip(drawn, factors, strict=True):
        assert getattr(off, name) == pytest.approx(getattr(truth, name) * factor), name
    assert (off.c_prefill_pair, off.c_prefill_cached_token) == (1e-9, 1e-6)


def test_perturbed_spread_zero_is_identity():
    truth = load_profile("h100_llama31_8b")
    assert perturbed(truth, np.random.default_rng(0), 0.0).coefficients == truth.coefficients


def test_drifting_acceptance_drifts_and_differs_by_class():
    alphas = np.full(7, 0.6)
    still = DriftingAcceptance(alphas, drift_sigma=0.0, class_sigma=0.0)
    rng = np.random.default_rng(2)
    table = still.draw(np.full(4000, 50), None, rng)
    assert table.values.mean() == pytest.approx(still.expected_accepted(7), rel=0.03)
    drifting = DriftingAcceptance(alphas, drift_sigma=0.1, class_sigma=0.0)
    means = [drifting.draw(np.full(400, 50), None, np.random.default_rng(s)).values.reshape(
        400, 50).mean(axis=1) for s in range(3)]
    # Within a draw, the first and last hundred requests accept differently.
    assert max(abs(m[:100].mean() - m[-100:].mean()) for m in means) > 0.2
    by_class = DriftingAcceptance(alphas, drift_sigma=0.0, class_sigma=0.5)
    classes = np.array(["a", "b"] * 1000, dtype=object)
    values = by_class.draw(np.full(2000, 50), classes, np.random.default_rng(3)).values
    per_request = values.reshape(2000, 50).mean(axis=1)
    assert abs(per_request[0::2].mean() - per_request[1::2].mean()) > 0.1
    config = by_class.to_config()
    assert acceptance_from_config(config).to_config() == config


def test_random_server_first_accept_range():
    rng = np.random.default_rng(4)
    low = [random_server(rng, first_accept=(0.02, 0.3))[1] for _ in range(200)]
    assert max(a.alphas[0] for a in low) <= 0.3
    assert max(a.expected_accept_length_at(7) for a in low) < 1.5
    with pytest.raises(ValueError, match="first_accept"):
        random_server(rng, first_accept=(0.5, 0.2))


def _sampler(modes: dict | None = None, **low):
    cfg = {"horizon_s": 2.0, "profiles": ["h200_llama31_8b", "blackwell_tp8"],
           "workloads": [{"name": "fixed", "kind": "closed", "concurrency": [1, 64]}],
           "cost_prior_modes": modes or {"exact": 1.0}}
    if low:
        cfg["low_acceptance"] = low
    return ScenarioSampler(cfg)


def test_low_acceptance_episodes_are_low_acceptance_random_servers_with_wrong_profiles():
    sampler = _sampler(share=1.0, first_accept=[0.02, 0.3], prior_modes={"swapped": 1.0})
    rng = np.random.default_rng(5)
    scenarios = [sampler.sample(rng) for _ in range(40)]
    assert {s.family for s in scenarios} == {"random"}
    assert {s.prior_mode for s in scenarios} == {"swapped"}
    assert all(s.prior is not None and s.prior.coefficients != s.profile.coefficients
               for s in scenarios)
    # Swapped for a named server's profile and for another random server's.
    assert {s.prior.name == "random" for s in scenarios} == {True, False}
    assert max(s.acceptance.expected_accept_length_at(7) for s in scenarios) < 1.5
    both = _sampler(share=0.5, prior_modes={"none": 1.0})
    rng = np.random.default_rng(6)
    drawn = [both.sample(rng) for _ in range(200)]
    low = sum(s.prior_mode == "none" for s in drawn)
    assert 60 < low < 140 and {s.prior_mode for s in drawn} == {"none", "exact"}


def test_options_off_leave_the_training_draw_unchanged():
    # low_acceptance.share 0 and an optimistic weight of 0: the default training episodes.
    modes = {"exact": 0.3, "perturbed": 0.3, "swapped": 0.15, "none": 0.25}
    plain, off = _sampler(modes), _sampler({**modes, "optimistic": 0.0}, share=0.0)
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    drawn = [(s.label, s.prior_mode) for s in (plain.sample(a) for _ in range(40))]
    assert drawn == [(s.label, s.prior_mode) for s in (off.sample(b) for _ in range(40))]
    assert {mode for _, mode in drawn} == set(modes)


@pytest.mark.parametrize(("section", "says"), [
    ({"share": 1.5}, r"env.low_acceptance.share: must be within \[0, 1\]"),
    ({"first_accept": [0.4, 0.1]}, "env.low_acceptance.first_accept"),
    ({"prior_modes": {"wrong": 1.0}}, "unknown mode 'wrong'"),
    ({"prior_modes": {"none": 0.0}}, "not all 0"),
    ({"shares": 0.1}, "unknown key 'shares'"),
])
def test_low_acceptance_bad_settings_name_the_field(section, says):
    with pytest.raises(ValueError, match=says):
        LowAcceptanceEpisodes.from_config(section)


def test_kv_verify_servers_pay_per_cached_token_on_the_speculative_path_only():
    plain = random_server(np.random.default_rng(8))[0]
    kv = random_server(np.random.default_rng(8), kv_verify_share=1.0)[0]
    lo, hi = KV_VERIFY
    assert plain.c_steps0_kv == 0.0 and lo <= kv.c_steps0_kv <= hi
    # The same server otherwise (drawn last), so off costs the same at any context,
    # while a speculative step at 200k cached tokens costs the KV term more.
    assert {k: v for k, v in kv.coefficients.items() if k != "c_steps0_kv"} == {
        k: v for k, v in plain.coefficients.items() if k != "c_steps0_kv"}
    assert kv.step_latency_s(32, 0, 200_000, 0, False, False) == pytest.approx(
        plain.step_latency_s(32, 0, 200_000, 0, False, False))
    extra = kv.step_latency_s(32, 3, 200_000) - plain.step_latency_s(32, 3, 200_000)
    assert extra == pytest.approx(kv.c_steps0_kv * 200_000, rel=1e-6)
    shares = [random_server(np.random.default_rng(i), kv_verify_share=0.3)[0].c_steps0_kv > 0
              for i in range(200)]
    assert 30 < sum(shares) < 90
    with pytest.raises(ValueError, match="kv_verify_share"):
        random_server(np.random.default_rng(8), kv_verify_share=1.5)


def test_kv_verify_share_reaches_training_servers_not_evaluation_ones():
    cfg = {"horizon_s": 2.0, "profiles": ["h200_llama31_8b"], "random_server_share": 1.0,
           "random_kv_verify_share": 1.0,
           "workloads": [{"name": "fixed", "kind": "closed", "concurrency": [1]}]}
    rng = np.random.default_rng(9)
    assert all(ScenarioSampler(cfg).sample(rng).profile.c_steps0_kv > 0 for _ in range(10))
    # Evaluation's random servers (random-0, random-1) are the same with or without it.
    evaluated = ScenarioSampler(cfg, split="eval").evaluation(1, 0, ("exact",), 2)
    default = ScenarioSampler({**cfg, "random_kv_verify_share": 0.0},
                              split="eval").evaluation(1, 0, ("exact",), 2)
    assert [s.profile.coefficients for s in evaluated] == [
        s.profile.coefficients for s in default]
    with pytest.raises(ValueError, match="random_kv_verify_share"):
        ScenarioSampler({**cfg, "random_kv_verify_share": -0.1})

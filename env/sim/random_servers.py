"""Randomised servers: the world a policy must work in, not three known machines.

:func:`random_server` draws a cost profile and an acceptance model over wide
ranges: dense or MoE (expert reads growing with the tokens a step touches, so a
verify step of ``batch * (depth + 1)`` tokens reads more experts than a decode
step), tensor-parallel communication folded into the per-token cost, cheap or
expensive verify paths, SGLang's speculative-path cost that a real off switch
saves (``c_steps0``), and acceptance from about 1.0 to 5+ tokens per step with
per-position decay, drift within an episode and differences between request
classes. :func:`random_scheduler_overrides` draws what re-entering speculation
after an off period costs. :func:`handed_profile` is the profile the controller
is given: exact, perturbed, another server's, none, or one pricing speculation too cheaply.

The ranges bracket the shipped profiles (an 8B model on one H200/H100, a 1T MoE
on eight PCIe Blackwell GPUs, a 30B-A3B MoE on one H200), so those are points
inside the distribution rather than its whole support.
"""

from __future__ import annotations

import math

import numpy as np

from env.sim.acceptance import DriftingAcceptance
from env.sim.cost_model import CostProfile, ServerLimits

#: How the profile handed to the controller relates to the server's true costs.
PRIOR_MODES = ("exact", "perturbed", "swapped", "none", "optimistic")

#: The coefficients only speculation pays (verify, draft, draft extend, the speculative
#: path's own overhead).
SPECULATIVE_COEFFICIENTS = ("c_verify", "c_verify_token", "c_draft", "c_draft_token",
                            "c_extend", "c_extend_token", "c_steps0", "c_steps0_request",
                            "c_steps0_kv")
#: An ``optimistic`` profile's factor on every speculative coefficient.
OPTIMISTIC_FACTOR = (0.2, 0.6)


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


#: The first draft position's acceptance of a random server (per-position rate).
FIRST_ACCEPT = (0.02, 0.95)
#: ``c_steps0_kv`` (seconds per cached token, speculative path only) of a random server
#: that pays one: the real H200 MoE's fits are 0.84-1.1 us (docs/FIDELITY.md).
KV_VERIFY = (3e-8, 2e-6)


def random_server(rng: np.random.Generator, max_depth: int = 7, name: str = "random",
                  first_accept: tuple[float, float] = FIRST_ACCEPT,
                  kv_verify_share: float = 0.0,
                  ) -> tuple[CostProfile, DriftingAcceptance]:
    """A random server: its cost profile (with limits) and its acceptance model, the first
    draft position accepting uniformly within ``first_accept`` (later ones decaying).

    With probability ``kv_verify_share`` its speculative steps also pay per cached token
    (``c_steps0_kv`` log-uniform within ``KV_VERIFY``), as the real H200 MoE's do: their
    cost then grows with the context, apart from off's. At 0 nothing more is drawn, so
    the stream (and every server drawn from it) is unchanged."""
    if not 0.0 <= kv_verify_share <= 1.0:
        raise ValueError(f"kv_verify_share must lie in [0, 1], got {kv_verify_share}")
    lo, hi = (float(v) for v in first_accept)
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"first_accept must be 0 <= lo <= hi <= 1, got {list(first_accept)}")
    moe = rng.random() < 0.4
    c_token = _log_uniform(rng, 1e-6, 2.5e-4)
    c_draft = _log_uniform(rng, 1.5e-4, 1.5e-3)
    on_path = rng.random() < 0.75
    profile = CostProfile(
        name=name,
        server=ServerLimits(
            max_running_requests=int(rng.choice([48, 64, 128, 256])),
            kv_capacity_tokens=int(_log_uniform(rng, 1.5e5, 8e5)),
            chunked_prefill_tokens=8192,
            cuda_graph_max_bs=int(rng.choice([64, 160, 256])),
        ),
        c_fixed=_log_uniform(rng, 3e-3, 1.5e-2),
        c_request=_log_uniform(rng, 1e-5, 3e-4),
        c_token=c_token,
        c_moe=_log_uniform(rng, 2e-3, 5e-2) if moe else 0.0,
        moe_active_fraction=float(rng.uniform(0.02, 0.1)) if moe else 0.0,
        c_kv=_log_uniform(rng, 1e-8, 6e-8),
        c_verify=_log_uniform(rng, 5e-5, 1.2e-2),
        c_verify_token=_log_uniform(rng, 1e-5, 5e-3) if rng.random() < 0.5 else 0.0,
        c_draft=c_draft,
        c_draft_token=_log_uniform(rng, 1e-7, 2e-5),
        c_extend=c_draft,
        c_extend_token=0.05 * c_token,
        c_prefill_token=_log_uniform(rng, 5e-6, 1e-4),
        c_steps0=_log_uniform(rng, 1e-4, 2e-3) if on_path else 0.0,
        c_steps0_request=_log_uniform(rng, 1e-5, 3e-4) if on_path else 0.0,
        description="randomised server (env.sim.random_servers)",
    )
    first = float(rng.uniform(lo, hi))
    decay = float(rng.uniform(0.8, 1.0))
    alphas = np.minimum(first * decay ** np.arange(max_depth), 1.0)
    acceptance = DriftingAcceptance(alphas, drift_sigma=float(rng.uniform(0.0, 0.08)),
                                    class_sigma=float(rng.uniform(0.0, 0.4)))
    if kv_verify_share > 0.0 and rng.random() < kv_verify_share:
        profile = profile.replace(c_steps0_kv=_log_uniform(rng, *KV_VERIFY))
    return profile.replace(acceptance=acceptance.to_config()), acceptance


def random_scheduler_overrides(rng: np.random.Generator) -> dict[str, float]:
    """Re-entry costs after an off period: the first speculative step's kept share of
    accepted drafts, and a lasting loss (zero half of the time)."""
    return {
        "cold_recovery_accept_fraction": float(rng.uniform(0.0, 1.0)),
        "stale_accept_loss": float(rng.uniform(0.0, 0.3)) if rng.random() < 0.5 else 0.0,
    }


#: Coefficients :func:`perturbed` leaves as they are: terms added after the evaluation's
#: scenarios and the shipped policy's training were drawn, zero in every training profile
#: (a factor would multiply 0), and out of the draw so that every later random number, and
#: so every scenario, stays the same. (``c_prefill_pair`` was drawn for from the eighth
#: session's 12:15 commit to the ninth's fix: one more number per perturbed profile, which
#: moved every later draw; evaluations and trainings of that span are on that stream.)
UNPERTURBED_COEFFICIENTS = frozenset({"c_prefill_pair", "c_prefill_cached_token"})


def perturbed(profile: CostProfile, rng: np.random.Generator, spread: float = 0.5) -> CostProfile:
    """Every coefficient (but :data:`UNPERTURBED_COEFFICIENTS`) scaled by its own factor,
    uniform in ``[1 - spread, 1 + spread]``."""
    names = [name for name in profile.coefficients if name not in UNPERTURBED_COEFFICIENTS]
    factors = rng.uniform(1.0 - spread, 1.0 + spread, size=len(names))
    return profile.replace(**{name: profile.coefficients[name] * float(f)
                              for name, f in zip(names, factors, strict=True)})


def handed_profile(truth: CostProfile, mode: str, rng: np.random.Generator,
                   others: list[CostProfile] | None = None,
                   spread: float = 0.5) -> CostProfile | None:
    """The cost profile the controller is given for a server whose costs are ``truth``.

    ``exact``: the truth; ``perturbed``: each coefficient off by up to ``spread``;
    ``swapped``: another server's (one of ``others``, else a random one); ``none``;
    ``optimistic``: speculation priced too cheaply, every speculative coefficient times
    one factor within ``OPTIMISTIC_FACTOR``, the error of a profile fitted where speculation
    was cheaper (the H200 MoE's first profile priced depth 3 at half what the server
    measured). ``perturbed`` rarely errs so far in one direction.
    """
    if mode == "exact":
        return truth
    if mode == "perturbed":
        return perturbed(truth, rng, spread)
    if mode == "swapped":
        candidates = [p for p in (others or []) if p.coefficients != truth.coefficients]
        if candidates:
            return candidates[int(rng.integers(len(candidates)))]
        return random_server(rng)[0]
    if mode == "none":
        return None
    if mode == "optimistic":
        factor = float(rng.uniform(*OPTIMISTIC_FACTOR))
        return truth.replace(**{name: getattr(truth, name) * factor
                                for name in SPECULATIVE_COEFFICIENTS})
    raise ValueError(f"cost prior mode must be one of {PRIOR_MODES}, got {mode!r}")

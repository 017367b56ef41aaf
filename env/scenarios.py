"""Episode scenarios: which server, which workload, how much load.

A :class:`Scenario` is everything a simulator run needs. :class:`ScenarioSampler`
draws them for training (random windows of the training part of each trace)
and enumerates them for evaluation (fixed windows of the held-out part).

Load is given relative to the server, not the trace: ``load = 1`` scales a
trace's arrival rate to the server's nominal capacity for that trace's request
mix (see :func:`nominal_capacity_req_s`), so the same ``load`` list means
"light to overloaded" on an 8B model on one H200 and on a 1T MoE on eight GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from env.factory import (
    _plain,
    make_acceptance,
    make_closed_loop,
    make_profile,
    make_scheduler_config,
    make_workload,
)
from env.sim.acceptance import AcceptanceModel
from env.sim.cost_model import CostProfile
from env.sim.random_servers import (
    PRIOR_MODES,
    handed_profile,
    random_scheduler_overrides,
    random_server,
)
from env.sim.simulator import SchedulerConfig
from env.traces.workloads import ClosedLoop, Workload

log = logging.getLogger(__name__)

#: The profile entry that stands for a freshly drawn random server.
RANDOM = "random"


@dataclass(frozen=True)
class Scenario:
    """One episode's setting."""

    label: str
    profile: CostProfile
    acceptance: AcceptanceModel
    workload: Workload | ClosedLoop
    config: SchedulerConfig
    horizon_s: float
    seed: int
    workload_name: str = ""
    #: True when the arrival rate is modulated to rise and fall within the episode.
    varying_load: bool = False
    #: Server family (the profile entry's label: a profile name, ``random``...).
    family: str = ""
    #: The cost profile the controller is handed (None: none) and how it relates
    #: to the true one (``env.sim.random_servers.PRIOR_MODES``).
    prior: CostProfile | None = None
    prior_mode: str = "exact"


@dataclass(frozen=True)
class LowAcceptanceEpisodes:
    """Training episodes on random servers where speculation (almost) never pays.

    Why: the policy speculated on such servers when handed another server's profile or
    none (issue 9: ``moe_h200_acc1.1`` swapped), states the ordinary draw visits rarely,
    since most swapped episodes run servers where speculation pays. ``share`` of the
    training episodes (0 = none, the draw unchanged) run a random server whose first draft
    position accepts within ``first_accept`` and are handed a profile drawn by
    ``prior_modes`` (a swapped one is a training profile's or another random server's).
    """

    share: float = 0.0
    first_accept: tuple[float, float] = (0.02, 0.3)
    prior_modes: dict[str, float] = field(default_factory=lambda: {"swapped": 0.5, "none": 0.5})

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None,
                    key: str = "env.low_acceptance") -> LowAcceptanceEpisodes:
        """From the env config's section (None: none); bad values name ``key``'s field."""
        cfg = dict(cfg or {})
        unknown = sorted(set(cfg) - {"share", "first_accept", "prior_modes"})
        if unknown:
            raise ValueError(f"{key}: unknown key {unknown[0]!r}; expected share, "
                             "first_accept, prior_modes")
        default = cls()
        share = float(cfg.get("share", default.share))
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{key}.share: must be within [0, 1], got {share}")
        first = cfg.get("first_accept", default.first_accept)
        if len(first) != 2 or not 0.0 <= float(first[0]) <= float(first[1]) <= 1.0:
            raise ValueError(f"{key}.first_accept: expected [lo, hi] with 0 <= lo <= hi <= 1, "
                             f"got {list(first)}")
        modes = dict(cfg.get("prior_modes") or default.prior_modes)
        unknown = sorted(set(modes) - set(PRIOR_MODES))
        if unknown:
            raise ValueError(f"{key}.prior_modes: unknown mode {unknown[0]!r}; use {PRIOR_MODES}")
        weights = {m: float(w) for m, w in modes.items()}
        if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"{key}.prior_modes: weights must be >= 0 and not all 0, "
                             f"got {weights}")
        return cls(share, (float(first[0]), float(first[1])), weights)


@dataclass(frozen=True)
class _Server:
    """A server family's parts for one scenario."""

    family: str
    profile: CostProfile
    acceptance: AcceptanceModel
    config: SchedulerConfig


def nominal_capacity_req_s(profile: CostProfile, prompt_tokens: np.ndarray,
                           output_tokens: np.ndarray, config: SchedulerConfig) -> float:
    """Requests per second the server sustains without speculation for this request mix.

    Each request costs its prefill (prompt tokens in chunk-sized steps) plus its
    share of full decode batches (``max_running_requests`` or as many as the KV
    cache holds at the mix's mean context).
    """
    prompt = float(np.mean(prompt_tokens))
    output = float(np.mean(output_tokens))
    context = prompt + output / 2.0
    batch = int(max(1, min(config.max_running_requests,
                           config.kv_capacity_tokens // max(context, 1.0))))
    chunk = config.chunked_prefill_tokens
    prefill_s = (prompt / chunk) * profile.step_latency_s(0, 0, 0, min(prompt, chunk))
    decode_s = output * profile.step_latency_s(batch, 0, int(batch * context), 0) / batch
    return 1.0 / (prefill_s + decode_s)


@lru_cache(maxsize=16)
def _cached_profile(name: str) -> CostProfile:
    return make_profile(name)


@lru_cache(maxsize=16)
def _cached_trace(name: str, path: str | None, cap: int | None) -> Workload | None:
    return make_workload({"name": name, "path": path, "max_output_tokens": cap})


class ScenarioSampler:
    """Draws (training) or enumerates (evaluation) scenarios from an env config.

    Config keys (see ``configs/env/default.yaml``): ``profiles`` (entries: a
    profile name or YAML path, ``random`` for a randomised server, or ``{profile,
    acceptance, label}``), ``random_server_share`` (training: the probability of
    a random server, whatever the list holds), ``acceptance``, ``workloads``
    (list of ``{name, path, kind: open|closed, load, concurrency, modulate_depth,
    modulate_period_s, horizon_s}``; a workload's ``horizon_s`` replaces the global one
    for its windows: long-context traces need longer ones), ``horizon_s``,
    ``held_out_fraction``, ``max_depth``,
    ``sim``, ``randomise_reentry``, and the profile handed to the controller:
    ``cost_prior`` (``profile`` | ``none``), ``cost_prior_modes`` (training:
    weight per mode of ``PRIOR_MODES``), ``cost_prior_spread``; ``low_acceptance``
    (training: :class:`LowAcceptanceEpisodes`).
    """

    def __init__(self, cfg: Mapping[str, Any], split: str = "train") -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.cfg = _plain(cfg)
        self.split = split
        self.max_depth = int(self.cfg.get("max_depth", 7))
        self.horizon_s = float(self.cfg["horizon_s"])
        self.held_out = float(self.cfg.get("held_out_fraction", 0.2))
        self.profiles = list(self.cfg["profiles"])
        self.random_share = float(self.cfg.get("random_server_share", 0.0))
        self.workloads = list(self.cfg["workloads"])
        #: (workload, KV capacity) pairs whose too-long requests were already reported.
        self._reported: set[tuple[str, int]] = set()
        modes = self.cfg.get("cost_prior_modes") or {"exact": 1.0}
        unknown = sorted(set(modes) - set(PRIOR_MODES))
        if unknown:
            raise ValueError(f"cost_prior_modes: unknown mode {unknown[0]!r}; use {PRIOR_MODES}")
        self.prior_modes = list(modes)
        weights = np.array([float(modes[m]) for m in self.prior_modes])
        if (weights < 0).any() or weights.sum() <= 0:
            raise ValueError("cost_prior_modes: weights must be >= 0 and not all 0")
        self.prior_weights = weights / weights.sum()
        self.use_prior = self.cfg.get("cost_prior", "profile") == "profile"
        self.prior_spread = float(self.cfg.get("cost_prior_spread", 0.5))
        self.low_acceptance = LowAcceptanceEpisodes.from_config(self.cfg.get("low_acceptance"))
        #: Training: the share of random servers whose speculative steps pay per cached
        #: token (env.sim.random_servers.random_server's kv_verify_share).
        self.kv_verify_share = float(self.cfg.get("random_kv_verify_share", 0.0))
        if not 0.0 <= self.kv_verify_share <= 1.0:
            raise ValueError(f"random_kv_verify_share must lie in [0, 1], got "
                             f"{self.kv_verify_share}")
        if not self.profiles or not self.workloads:
            raise ValueError("env config needs at least one profile and one workload")
        for spec in self.workloads:
            if spec.get("kind", "open") not in ("open", "closed"):
                raise ValueError(f"workload {spec.get('name')!r}: kind must be open or closed")
            horizon = spec.get("horizon_s")
            if horizon is not None and not float(horizon) > 0:
                raise ValueError(f"workload {spec.get('name')!r}: horizon_s must be > 0 "
                                 f"simulated seconds, got {horizon!r}")

    # -- parts ---------------------------------------------------------------------

    def _trace(self, spec: Mapping) -> Workload | None:
        return _cached_trace(spec["name"], spec.get("path"), spec.get("max_output_tokens"))

    def _servable_part(self, spec: Mapping, trace: Workload, config: SchedulerConfig) -> Workload:
        """This split's requests the server can hold; the rest reported once per workload.

        Leaving them out also keeps them out of the nominal capacity: one prompt
        longer than the KV cache would otherwise scale every window's load.
        """
        lo, hi = self._split_range(trace)
        part, rejected = _servable(trace.window(lo, hi - lo), config)
        if not len(part):
            raise ValueError(
                f"workload {spec['name']!r} ({trace.source or 'shipped'}): no request of its "
                f"{self.split} split fits the server's KV cache of {config.kv_capacity_tokens} "
                "slots"
            )
        key = (str(spec["name"]), config.kv_capacity_tokens)
        if key not in self._reported:
            self._reported.add(key)
            _, too_long = _servable(trace, config)
            if too_long:
                log.warning("workload %r (%s): %d of %d requests need more KV slots than the "
                            "server's %d and are left out (%d of them in this %s split)",
                            spec["name"], trace.source or "shipped", too_long, len(trace),
                            config.kv_capacity_tokens, rejected, self.split)
        return part

    def _split_range(self, trace: Workload) -> tuple[float, float]:
        cut = trace.duration_s * (1.0 - self.held_out)
        return (0.0, cut) if self.split == "train" else (cut, trace.duration_s)

    def server(self, entry: Any, rng: np.random.Generator,
               first_accept: tuple[float, float] | None = None,
               kv_verify_share: float = 0.0) -> _Server:
        """The parts of a profile entry (``rng`` draws random servers and re-entry costs;
        ``first_accept`` and ``kv_verify_share``: a random server's first-position
        acceptance range and chance of a per-cached-token speculative cost)."""
        sim_cfg = dict(self.cfg.get("sim") or {})
        if self.cfg.get("randomise_reentry"):
            sim_cfg.update(random_scheduler_overrides(rng))
        if entry == RANDOM:
            kwargs = {} if first_accept is None else {"first_accept": first_accept}
            profile, acceptance = random_server(rng, self.max_depth,
                                                kv_verify_share=kv_verify_share, **kwargs)
            return _Server(RANDOM, profile, acceptance,
                           make_scheduler_config(sim_cfg, profile, self.max_depth))
        if isinstance(entry, Mapping):
            unknown = sorted(set(entry) - {"profile", "acceptance", "label"})
            if unknown or "profile" not in entry:
                raise ValueError(f"profiles entry {entry}: expected keys profile, acceptance, "
                                 "label")
            name, accept_cfg = str(entry["profile"]), entry.get("acceptance")
            label = str(entry.get("label") or name)
        else:
            name, accept_cfg, label = str(entry), self.cfg.get("acceptance"), None
        profile = _cached_profile(name)
        label = label or profile.name  # a YAML path's family is the profile it holds
        acceptance = make_acceptance(accept_cfg, profile, self.max_depth)
        return _Server(label, profile, acceptance,
                       make_scheduler_config(sim_cfg, profile, self.max_depth))

    def _handed(self, server: _Server, mode: str, rng: np.random.Generator,
                extra_others: Sequence[CostProfile] = ()):
        if not self.use_prior:
            return None, "none"
        others = [_cached_profile(str(e["profile"] if isinstance(e, Mapping) else e))
                  for e in self.profiles if e != RANDOM] + list(extra_others)
        return handed_profile(server.profile, mode, rng, others, self.prior_spread), mode

    def horizon_for(self, spec: Mapping) -> float:
        """Simulated seconds per window of this workload: its own ``horizon_s`` if set."""
        horizon = spec.get("horizon_s")
        return self.horizon_s if horizon is None else float(horizon)

    def open_loop(self, spec: Mapping, server: _Server, load: float, start_fraction: float,
                  modulate_depth: float, seed: int, prior: tuple = (None, "none")) -> Scenario:
        """A window of the trace, scaled to ``load`` x the server's nominal capacity."""
        profile, acceptance, config = server.profile, server.acceptance, server.config
        trace = self._trace(spec)
        if trace is None:
            raise ValueError(f"workload {spec['name']!r} has no trace for open-loop replay")
        lo, hi = self._split_range(trace)
        part = self._servable_part(spec, trace, config)
        capacity = nominal_capacity_req_s(profile, part.prompt_tokens, part.output_tokens, config)
        multiplier = load * capacity / part.mean_rate
        horizon = self.horizon_for(spec)
        span = min(horizon * multiplier, hi - lo)
        start = lo + start_fraction * max(0.0, hi - lo - span)
        window, rejected = _servable(trace.window(start, span).scaled(multiplier), config)
        if modulate_depth > 0:
            period = float(spec.get("modulate_period_s", horizon / 2))
            window = window.modulated(period, modulate_depth)
        label = (f"{spec['name']} load={load:g} mod={modulate_depth:g} {server.family} "
                 f"prior={prior[1]} @{start:.0f}s"
                 + (f" ({rejected} too long for this server)" if rejected else ""))
        return Scenario(label, profile, acceptance, window, config,
                        horizon_s=min(horizon, span / multiplier), seed=seed,
                        workload_name=spec["name"], varying_load=modulate_depth > 0,
                        family=server.family, prior=prior[0], prior_mode=prior[1])

    def closed_loop(self, spec: Mapping, server: _Server, concurrency: int,
                    seed: int, prior: tuple = (None, "none")) -> Scenario:
        """``concurrency`` clients with lengths from the trace's split (or fixed)."""
        profile, acceptance, config = server.profile, server.acceptance, server.config
        trace = self._trace(spec)
        if trace is None:
            loop = make_closed_loop(spec, concurrency, profile=profile)
        else:
            lengths = self._servable_part(spec, trace, config)
            loop = ClosedLoop(concurrency=concurrency, lengths_from=lengths)
        label = f"{spec['name']} C={concurrency} {server.family} prior={prior[1]}"
        return Scenario(label, profile, acceptance, loop, config, self.horizon_for(spec), seed,
                        workload_name=spec["name"], family=server.family, prior=prior[0],
                        prior_mode=prior[1])

    # -- drawing -----------------------------------------------------------------------

    def sample(self, rng: np.random.Generator) -> Scenario:
        """A random scenario: a server (random with ``random_server_share``, else uniform
        over ``profiles``), a workload and its settings, and the handed profile."""
        low = self.low_acceptance
        if low.share > 0 and rng.random() < low.share:  # no draw at share 0: stream unchanged
            server = self.server(RANDOM, rng, first_accept=low.first_accept,
                                 kv_verify_share=self.kv_verify_share)
            modes = list(low.prior_modes)
            weights = np.array([low.prior_modes[m] for m in modes])
            mode = modes[rng.choice(len(modes), p=weights / weights.sum())]
            # Another random server's profile too: not only the three named servers' prices.
            prior = self._handed(server, mode, rng, extra_others=[random_server(rng)[0]])
        else:
            if rng.random() < self.random_share:
                entry = RANDOM
            else:
                entry = self.profiles[rng.integers(len(self.profiles))]
            server = self.server(entry, rng, kv_verify_share=self.kv_verify_share)
            prior = self._handed(server, self.prior_modes[rng.choice(len(self.prior_modes),
                                                                     p=self.prior_weights)], rng)
        spec = self.workloads[rng.integers(len(self.workloads))]
        seed = int(rng.integers(2**31))
        if spec.get("kind", "open") == "closed":
            concurrency = _choice(rng, spec["concurrency"])
            return self.closed_loop(spec, server, int(concurrency), seed, prior)
        load = float(_choice(rng, spec.get("load", [1.0])))
        depth = float(_choice(rng, spec.get("modulate_depth", [0.0])))
        return self.open_loop(spec, server, load, float(rng.random()), depth, seed, prior)

    def evaluation(self, windows: int = 3, seed: int = 0, prior_modes: Sequence[str] = ("exact",),
                   random_servers: int = 0) -> list[Scenario]:
        """Every (server, workload setting, handed-profile mode) with ``windows`` evenly
        spaced windows each. ``random`` entries (and ``random_servers``) add that many
        random servers drawn from a stream of their own (seeded by ``seed``), so
        evaluation servers are not the training episodes' draws."""
        entries = [e for e in self.profiles if e != RANDOM]
        n_random = max(int(random_servers), sum(1 for e in self.profiles if e == RANDOM))
        servers = [self.server(e, np.random.default_rng([seed, 1, i]))
                   for i, e in enumerate(entries)]
        for i in range(n_random):
            rng = np.random.default_rng([seed, 2, i])
            server = self.server(RANDOM, rng)
            servers.append(_Server(f"random-{i}", server.profile.replace(name=f"random-{i}"),
                                   server.acceptance, server.config))
        scenarios = []
        for server in servers:
            for mode in prior_modes:
                prior = self._handed(server, mode, np.random.default_rng([seed, 3]))
                for spec in self.workloads:
                    if spec.get("kind", "open") == "closed":
                        for c in spec["concurrency"]:
                            scenarios.append(self.closed_loop(spec, server, int(c), seed, prior))
                        continue
                    for load in spec.get("load", [1.0]):
                        for depth in spec.get("modulate_depth", [0.0]):
                            for w in range(windows):
                                fraction = (w + 0.5) / windows
                                scenarios.append(self.open_loop(
                                    spec, server, float(load), fraction, float(depth), seed + w,
                                    prior))
        return scenarios


def _servable(workload: Workload, config: SchedulerConfig) -> tuple[Workload, int]:
    """The requests this server can hold at all, and how many it would reject.

    A real server refuses a prompt longer than its KV cache (SGLang aborts it at
    admission); replaying such a request could never finish, so it is left out and
    counted in the scenario's label.
    """
    need = workload.prompt_tokens.astype(np.int64) + workload.output_tokens + config.max_depth + 1
    fits = need <= config.kv_capacity_tokens
    rejected = int((~fits).sum())
    return (workload.select(fits) if rejected else workload), rejected


def _choice(rng: np.random.Generator, values: Sequence | float) -> Any:
    if isinstance(values, list | tuple):
        return values[int(rng.integers(len(values)))]
    return values

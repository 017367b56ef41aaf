"""Building simulator parts from configuration (Hydra or plain mappings).

Every command (bench, train, eval) and the gymnasium environment describe a
scenario with the same keys, so one set of builders lives here:

* ``profile``: a shipped cost-profile name (``h200_llama31_8b``...) or a YAML path;
* ``acceptance``: ``null`` for the profile's own ``acceptance:`` section, or a
  mapping for :func:`env.sim.acceptance.acceptance_from_config`;
* ``workload``: ``{name, path, prompt_tokens, output_tokens, max_output_tokens}``:
  a shipped trace (``azure_conv``, ``azure_code``, ``mooncake``), any trace file
  (``path``: Azure CSV, Mooncake JSONL or the project's Parquet trace, told apart
  by content), or fixed lengths (``name: fixed``); closed loops also read
  ``start_interval_s`` and ``client_overhead_s`` (see
  :class:`env.traces.workloads.ClosedLoop`);
* ``sim``: scheduler overrides (see :class:`env.sim.simulator.SchedulerConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from env.sim.acceptance import AcceptanceModel, acceptance_from_config
from env.sim.cost_model import CostProfile, load_profile
from env.sim.simulator import SchedulerConfig
from env.traces.workloads import ClosedLoop, Workload, load_workload, shipped_workload

SHIPPED_WORKLOADS = ("azure_conv", "azure_code", "mooncake")


def _plain(cfg: Any) -> Any:
    """An OmegaConf node as plain Python containers (anything else unchanged)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - hydra is a dependency
        return cfg
    if isinstance(cfg, DictConfig | ListConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def make_profile(spec: str | CostProfile) -> CostProfile:
    """A cost profile from its shipped name or a YAML path."""
    return spec if isinstance(spec, CostProfile) else load_profile(spec)


def make_acceptance(cfg: Mapping | None, profile: CostProfile, max_depth: int) -> AcceptanceModel:
    """The acceptance model: ``cfg`` if given, else the profile's default."""
    cfg = _plain(cfg)
    if cfg is None:
        if not profile.acceptance:
            raise ValueError(
                f"profile {profile.name!r} has no acceptance section; set acceptance=... explicitly"
            )
        cfg = profile.acceptance
    cfg = dict(cfg)
    if cfg.get("model") in ("parametric", "sglang_simulated", "spec_bench") and "alphas" not in cfg:
        cfg.setdefault("max_depth", max_depth)
    model = acceptance_from_config(cfg)
    if model.max_depth < max_depth:
        raise ValueError(
            f"acceptance model covers depth {model.max_depth} but max_depth is {max_depth}"
        )
    return model


def make_workload(cfg: Mapping) -> Workload | None:
    """The open-loop trace a workload config names (None for fixed lengths)."""
    cfg = _plain(cfg)
    path, name = cfg.get("path"), cfg.get("name", "fixed")
    if path:
        workload = load_workload(path, name=None if name == "fixed" else name)
    elif name in SHIPPED_WORKLOADS:
        workload = shipped_workload(name)
    elif name == "fixed":
        return None
    else:
        raise ValueError(
            f"workload.name {name!r}: expected one of {', '.join(SHIPPED_WORKLOADS)}, fixed, "
            "or a file in workload.path"
        )
    cap = cfg.get("max_output_tokens")
    return workload.with_output_cap(int(cap)) if cap else workload


def make_closed_loop(cfg: Mapping, concurrency: int, requests_per_client: int | None = None,
                     profile: CostProfile | None = None) -> ClosedLoop:
    """C clients with lengths from the workload's trace, or fixed lengths.

    Fixed lengths left ``null`` default to the request shape the profile was
    calibrated with (its ``provenance``), else 256 and 256.
    """
    cfg = _plain(cfg)
    lengths = make_workload(cfg)
    clients = {
        "concurrency": concurrency,
        "requests_per_client": requests_per_client,
        "start_interval_s": float(cfg.get("start_interval_s") or 0.0),
        "client_overhead_s": float(cfg.get("client_overhead_s") or 0.0),
    }
    if lengths is None:
        calibrated = profile.provenance if profile is not None else {}
        prompt = cfg.get("prompt_tokens") or calibrated.get("prompt_tokens", 256)
        output = cfg.get("output_tokens") or calibrated.get("output_tokens", 256)
        return ClosedLoop(prompt_tokens=int(prompt), output_tokens=int(output), **clients)
    return ClosedLoop(lengths_from=lengths, **clients)


def make_scheduler_config(sim_cfg: Mapping | None, profile: CostProfile,
                          max_depth: int) -> SchedulerConfig:
    """Server limits from the profile with the ``sim`` overrides applied."""
    overrides = dict(_plain(sim_cfg) or {})
    unknown = set(overrides) - set(SchedulerConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown sim settings: {sorted(unknown)}")
    overrides["max_depth"] = max_depth
    return SchedulerConfig.from_profile(profile, **overrides)

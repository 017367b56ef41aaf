"""Resolving the command-line shortcuts of ``specctl-train`` / ``specctl-eval``.

``profile=<name>`` restricts the environment to one cost profile;
``workload=<name>`` to one of its workloads; ``workload.path=<file>`` replaces
the workloads by that trace, replayed open-loop at the configured loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

#: Loads used for a trace given on the command line.
DEFAULT_LOADS = [0.3, 0.7, 1.0, 1.5]


def env_config(cfg: DictConfig) -> dict[str, Any]:
    """The ``env`` section with the ``profile`` / ``workload`` restrictions applied."""
    env = OmegaConf.to_container(cfg.env, resolve=True)
    if cfg.get("profile"):
        env["profiles"] = [str(cfg.profile)]
    workload = OmegaConf.to_container(cfg.workload, resolve=True) if "workload" in cfg else {}
    name, path = workload.get("name", "all"), workload.get("path")
    if path:
        stem = name if name not in ("all", "fixed") else Path(path).stem
        env["workloads"] = [{
            "name": stem, "path": str(path), "kind": "open", "load": DEFAULT_LOADS,
            "modulate_depth": [0.0, 0.8], "max_output_tokens": workload.get("max_output_tokens"),
        }]
    elif name != "all":
        chosen = [w for w in env["workloads"] if w["name"] == name]
        if not chosen:
            kind = "closed" if name == "fixed" else "open"
            chosen = [{"name": name, "kind": kind, "load": DEFAULT_LOADS,
                       "concurrency": [1, 4, 16, 64, 128, 256]}]
        env["workloads"] = chosen
    return env

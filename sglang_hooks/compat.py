"""Supported SGLang versions and the few things that differ between them.

Only how a scheduler process finds its own ranks differs: 0.5.15.post1 keeps
them on ``scheduler.ps`` (a ``ParallelState``), 0.5.23 in the process-wide
``sglang.srt.runtime_context.get_parallel()``. Everything else the hooks touch
is the same in both (see :mod:`sglang_hooks.contract`).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, NamedTuple

SUPPORTED_VERSIONS = ("0.5.15.post1", "0.5.23")


class Ranks(NamedTuple):
    """Where this scheduler process sits in the parallel layout."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    attn_dp: bool

    @property
    def world_rank(self) -> int:
        """A rank unique across DP replicas, TP and PP (names telemetry streams)."""
        return (self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.tp_rank


def installed_version() -> str | None:
    """The installed SGLang's version, or None if it has no distribution metadata."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def read_ranks(scheduler: Any, version: str) -> Ranks:
    """This scheduler process's ranks (call after ``Scheduler.__init__``)."""
    if version == "0.5.15.post1":
        ps = scheduler.ps
        attn_dp = bool(getattr(scheduler.server_args, "enable_dp_attention", False))
        return Ranks(ps.tp_rank, ps.tp_size, ps.pp_rank, ps.pp_size, ps.dp_rank or 0, attn_dp)
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    try:  # unset (not just None) when no DP controller spawned this process
        dp_rank = p.dp_rank or 0
    except (AttributeError, RuntimeError, ValueError):
        dp_rank = 0
    return Ranks(p.tp_rank, p.tp_size, p.pp_rank, p.pp_size, dp_rank, bool(p.attn_dp_enabled))

"""Supported SGLang versions and the few things that differ between them.

Only how a scheduler process finds its own ranks differs: 0.5.15.post1 keeps
them on ``scheduler.ps`` (a ``ParallelState``), 0.5.23 in the process-wide
``sglang.srt.runtime_context.get_parallel()``. Everything else the hooks touch
is the same in both (see :mod:`sglang_hooks.contract`).

Behaviour is chosen by what the installed source offers, not by its version
string: :func:`choose_flavour` returns the tested version whose whole contract
the source satisfies. A version other than the tested ones is used only with
``SPECCTL_ALLOW_UNTESTED_SGLANG=1``.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

from sglang_hooks import contract

#: The versions the contract tests pin (each has a contract in :mod:`contract`).
SUPPORTED_VERSIONS = ("0.5.15.post1", "0.5.23")
#: The function SGLang's scheduler processes (and only they) call ``load_plugins`` from.
SCHEDULER_ENTRY = (contract.SCHEDULER, "run_scheduler_process")
#: The modules that call ``load_plugins`` in the HTTP server's (main) process: the engine
#: (``Engine.__init__``, ``Engine._launch_subprocesses``) and the two command-line entries,
#: ``python -m sglang.launch_server`` and ``sglang serve``, which load the plugins first
#: (SGLang's loader runs once, so theirs is the call that counts; on the H200, run 44, a
#: server started with ``-m sglang.launch_server`` never registered the warm-up while only
#: the engine was listed).
HTTP_ENTRY_MODULES = (contract.ENGINE, contract.LAUNCH_SERVER, contract.CLI_SERVE)
#: SGLang's plugin loader (the frame whose caller tells the processes apart).
LOADER = ("sglang.srt.plugins", "load_plugins")


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


class Flavour(NamedTuple):
    """Which tested version's behaviour to use, or why none fits."""

    version: str | None  # a SUPPORTED_VERSIONS entry; None: do not register
    problems: tuple[str, ...] = ()


def choose_flavour(installed: str | None, root: str | Path, allow_untested: bool) -> Flavour:
    """The tested version whose contract the SGLang under ``root`` satisfies.

    The installed version's own contract is tried first; another version's only
    when ``allow_untested`` (an untested SGLang that behaves like a tested one).
    """
    tested = installed in SUPPORTED_VERSIONS
    if not tested and not allow_untested:
        return Flavour(None, (f"SGLang {installed} is not a tested version "
                              f"({', '.join(SUPPORTED_VERSIONS)}); set "
                              "SPECCTL_ALLOW_UNTESTED_SGLANG=1 to use it if its source "
                              "passes a tested version's contract",))
    order = ([installed] if tested else []) + [v for v in reversed(SUPPORTED_VERSIONS)
                                                if v != installed]
    if tested and not allow_untested:
        order = order[:1]
    first: tuple[str, ...] = ()
    for version in order:
        problems = tuple(contract.contract_problems(root, version))
        if not problems:
            return Flavour(version)
        first = first or problems
    return Flavour(None, first)


def in_scheduler_process() -> bool:
    """Whether SGLang's scheduler-process entry point is on the call stack.

    SGLang calls ``load_plugins()`` in every process it starts (the HTTP server,
    the detokenizer, the DP controller); only scheduler processes run hooks.
    """
    module, function = SCHEDULER_ENTRY
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


def in_http_process() -> bool:
    """Whether ``load_plugins`` was called from one of :data:`HTTP_ENTRY_MODULES`: the
    main process, where the tokenizer manager and the HTTP server run.

    The loader's own caller decides, not any frame below it: a process forked from the
    main one would still have the engine's frames beneath its own (SGLang spawns, but a
    user's launcher may fork).
    """
    module, function = LOADER
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            caller = frame.f_back
            return caller is not None and module_of(caller) in HTTP_ENTRY_MODULES
        frame = frame.f_back
    return False


def module_of(frame: Any) -> str | None:
    """The module a frame's code belongs to, by its import name: ``python -m X`` runs X as
    ``__main__``, whose ``__spec__`` still names X."""
    spec = frame.f_globals.get("__spec__")
    return getattr(spec, "name", None) or frame.f_globals.get("__name__")


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

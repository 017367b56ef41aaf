"""What every specctl console script shares: a user mistake ends in one line and exit status 2.

A mistake on the command line or in an input file (an unknown profile or policy name, a
missing or malformed trace, profile or policy file, a value out of range) raises one of
:func:`user_error_types`; the console scripts print its message as one line,
``specctl-bench: error: profile=nosuch: unknown profile ...``, and exit with status 2,
the convention of argparse and Hydra for usage errors. Anything else is a bug and keeps
its traceback. ``SPECCTL_DEBUG=1`` (or Hydra's ``HYDRA_FULL_ERROR=1``) shows the full
traceback of user mistakes too.

Worker processes need nothing of their own: :mod:`concurrent.futures` re-raises a worker's
exception in the parent with its type and message, where :func:`reported` catches it.

This module imports only the light modules that define those error types (no torch), so
``specctl-serve`` and ``specctl-fit-profile`` use it as well.
"""

from __future__ import annotations

import functools
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

#: Exit status of a user mistake (argparse and Hydra use 2 for usage errors).
USAGE_EXIT = 2
#: Set to 1 to see the full traceback of a user mistake.
DEBUG_VARIABLE = "SPECCTL_DEBUG"

T = TypeVar("T")


class UsageError(ValueError):
    """A command-line value that cannot work; the message names the key, the value and
    what is valid (see :mod:`agents.checks`)."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean a user mistake rather than a bug.

    Each module's own error type already says which file, line or field is wrong; plain
    ``OSError`` subclasses cover paths that do not exist or cannot be read.
    """
    from controller.policy_file import PolicyFileError
    from controller.security import UnsafeEndpointError
    from env.sim.cost_model import ProfileError, UnidentifiableFitError
    from env.traces.trace_format import DataFileError

    return (UsageError, ProfileError, UnidentifiableFitError, DataFileError, PolicyFileError,
            UnsafeEndpointError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
            PermissionError)


def debugging() -> bool:
    """Whether the user asked for full tracebacks."""
    return any(os.environ.get(name, "") not in ("", "0")
               for name in (DEBUG_VARIABLE, "HYDRA_FULL_ERROR"))


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (OSError's ``[Errno 2]`` prefix left out)."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror.lower()}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


@contextmanager
def reported(prog: str) -> Iterator[None]:
    """Turn a user mistake raised inside the block into one line on stderr and exit 2."""
    try:
        yield
    except user_error_types() as exc:
        if debugging():
            raise
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT) from None


def show(value: Any) -> str:
    """A config value as it is written on the command line (``null``, ``true``, ``[a,b]``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list | tuple) or type(value).__name__ == "ListConfig":
        return "[" + ",".join(show(v) for v in value) + "]"
    if isinstance(value, dict) or type(value).__name__ == "DictConfig":
        return "{" + ",".join(f"{k}:{show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _current(value: Any) -> str:
    """``(now VALUE)`` for a ``--help`` text; a long list goes on lines of its own."""
    text = show(value)
    if len(text) <= 40:
        return f"(now {text})"
    items = ", ".join(show(v) for v in value)
    return "(now\n" + textwrap.fill(f"[{items}])", width=88, initial_indent=" " * 30,
                                    subsequent_indent=" " * 31)


def _names(names: list[str]) -> str:
    # The help texts put the list after a 13-character label ("  profiles   ").
    return textwrap.fill(", ".join(names), width=88, initial_indent=" " * 13,
                         subsequent_indent=" " * 13).lstrip()


def _workload_names() -> str:
    from importlib import resources

    folder = resources.files("configs").joinpath("workload")
    return _names(sorted(p.name[: -len(".yaml")] for p in folder.iterdir()
                         if p.name.endswith(".yaml")))


def _profile_names() -> str:
    from env.sim.cost_model import shipped_profiles

    return _names(shipped_profiles())


def _policy_names() -> str:
    from agents.policies import POLICY_NAMES

    return _names(list(POLICY_NAMES))


def register_help_resolvers() -> None:
    """``${specctl_profiles:}``, ``${specctl_policies:}``, ``${specctl_workloads:}``: the
    valid names, as the ``--help`` texts (``configs/hydra/help/*.yaml``) list them, read
    from what ships so that they cannot go stale; ``${specctl_current:${key}}``: a key's
    current value as it is written on the command line."""
    from omegaconf import OmegaConf

    for name, function in (("specctl_profiles", _profile_names),
                           ("specctl_policies", _policy_names),
                           ("specctl_workloads", _workload_names), ("specctl_current", _current)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)


def hydra_app(config_name: str, prog: str) -> Callable[[Callable[[Any], T]], Callable[..., T]]:
    """``hydra.main`` for a specctl command, with :func:`reported` around the task.

    Hydra itself reports a bad override or an unknown config option (a few lines naming
    the key and the choices) and exits with status 1; that is a user mistake too, so the
    command exits with :data:`USAGE_EXIT` when it happens before the task starts. The
    task's return value (a sweeper's objective) is passed through. ``--help`` prints the
    app's own ``hydra/help`` config (``configs/hydra/help/<config_name>.yaml``).
    """
    import hydra

    register_help_resolvers()

    def decorate(task: Callable[[Any], T]) -> Callable[..., T]:
        started = False

        @functools.wraps(task)
        def guarded(cfg: Any) -> T:
            nonlocal started
            started = True
            with reported(prog):
                return task(cfg)

        app = hydra.main(config_path="pkg://configs", config_name=config_name,
                         version_base=None)(guarded)

        @functools.wraps(task)
        def main(*args: Any, **kwargs: Any) -> T:
            try:
                return app(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 1 and not started:  # Hydra's own report of a config mistake
                    raise SystemExit(USAGE_EXIT) from None
                raise

        return main

    return decorate

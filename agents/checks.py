"""Checks of a command's settings before any work starts.

Each check builds what the setting names (a profile, a policy, a workload), in the parent
process and before any worker starts, and turns a failure into a :class:`UsageError`
naming the key, the value and what is wrong or valid: ``profile=nosuch: unknown profile
'nosuch': ... shipped profiles [...]`` rather than a traceback from a worker process minutes
later. :mod:`agents.cli` prints it as one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from agents.cli import UsageError, one_line, show, user_error_types

T = TypeVar("T")


def setting(key: str, value: Any, build: Callable[[], T]) -> T:
    """``build()``, with any failure to build from ``value`` reported against ``key``.

    ``ValueError`` counts here (it does not in :func:`agents.cli.user_error_types`): the
    builder is handed nothing but this one user-given value.
    """
    try:
        return build()
    except (*user_error_types(), ValueError) as exc:
        raise UsageError(f"{key}={show(value)}: {one_line(exc)}") from exc


def existing_file(key: str, path: str | Path) -> Path:
    """``path`` as a Path, if something exists there (what it holds is the reader's to check)."""
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise UsageError(f"{key}={path}: no such file")
    return resolved


def profile(key: str, spec: Any):
    """The cost profile a shipped name, a YAML path or a ``{profile: ...}`` entry names."""
    from env.factory import make_profile

    name = spec.get("profile") if isinstance(spec, Mapping) else spec
    if name is None:
        raise UsageError(f"{key}={show(spec)}: expected a shipped profile name or a YAML path")
    return setting(key, spec, lambda: make_profile(name))


def concurrency(key: str, values: Sequence[Any]) -> list[int]:
    """Concurrency levels: whole numbers >= 1."""
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{key}={show(list(values))}: every concurrency must be a whole "
                             f"number >= 1, got {value!r}")
        out.append(value)
    if not out:
        raise UsageError(f"{key}=[]: give at least one concurrency, e.g. {key}=[1,16,64]")
    return out


def policy_file(key: str, path: str | None):
    """An exported policy file (``None``: the shipped default)."""
    from controller.default_policy import default_policy_path
    from controller.policy_file import ExportedPolicy

    if path is not None:
        existing_file(key, path)
    return setting(key, path, lambda: ExportedPolicy.load(path or default_policy_path()))


def policies(key: str, names: Sequence[str], *, profile, max_depth: int,
             policy_path: str | None = None) -> None:
    """Every policy name builds (``ppo`` from ``policy_path``, checked by :func:`policy_file`)."""
    from agents.policies import make_policy

    if not names:
        raise UsageError(f"{key}=[]: give at least one policy, e.g. {key}=[no_spec,static_3]")
    for name in names:
        setting(key, list(names), lambda n=name: make_policy(
            str(n), profile=profile, max_depth=max_depth, policy_path=policy_path))


def workload(key: str, cfg: Mapping[str, Any]) -> None:
    """A workload entry: its trace file exists and reads (``path``), or its name is known."""
    from env.factory import make_workload

    path = cfg.get("path")
    if path:
        existing_file(f"{key}.path", path)
        setting(f"{key}.path", path, lambda: make_workload(cfg))
    else:
        setting(f"{key}.name", cfg.get("name"), lambda: make_workload(cfg))


def init_policy(key: str, agent: Any) -> None:
    """A warm start's file exists and, if a policy file, fits the network ``agent`` builds."""
    path = existing_file(key, agent.init_policy)
    if path.suffix == ".zip":  # an SB3 model: stable-baselines3 checks it as it loads
        return
    from controller.policy_file import ExportedPolicy, PolicyFileError

    try:
        exported = ExportedPolicy.load(path)
    except (OSError, PolicyFileError) as exc:
        raise UsageError(f"{key}={path}: {one_line(exc)}") from exc
    hidden = [int(w.shape[1]) for w in exported.weights[:-1]]
    if hidden != [int(n) for n in agent.net_arch]:
        raise UsageError(f"{key}={path}: its hidden layers are {hidden}, agent.net_arch is "
                         f"{list(agent.net_arch)} (agent=ship builds 128x128)")
    if exported.activation != agent.activation:
        raise UsageError(f"{key}={path}: activation {exported.activation}, agent.activation "
                         f"is {agent.activation}")


def _named_profiles(cfg: Any) -> list[tuple[str, Any]]:
    """(key, entry) of every server the run uses: ``profile=``, or each ``env.profiles`` and
    ``eval.families`` entry (``random`` stands for randomised servers and names no profile)."""
    if cfg.get("profile"):
        return [("profile", cfg.profile)]
    named = [(f"env.profiles[{i}]", e) for i, e in enumerate(cfg.env.get("profiles") or [])]
    if "eval" in cfg and cfg.get("evaluate", True):  # the servers the evaluation runs
        named += [(f"eval.families[{i}]", e)
                  for i, e in enumerate(cfg.eval.get("families") or [])]
    return [(key, entry) for key, entry in named if entry != "random"]


def run_config(cfg: Any, *, policy_key: str | None = None) -> None:
    """The settings ``specctl-eval`` and ``specctl-train`` share, before any work starts:
    servers, the workload, the policy file (``policy_key``), and, when an evaluation will
    run, its policy names and concurrencies."""
    from omegaconf import OmegaConf

    profiles = [profile(key, entry) for key, entry in _named_profiles(cfg)]
    workload_cfg = OmegaConf.to_container(cfg.workload, resolve=True) if "workload" in cfg else {}
    if workload_cfg.get("path"):
        workload("workload", workload_cfg)
    policy_path = cfg.get(policy_key) if policy_key else None
    if policy_key:
        policy_file(policy_key, policy_path)
    max_depth = int(cfg.env.max_depth)
    if cfg.env.get("low_acceptance") is not None:
        from env.scenarios import LowAcceptanceEpisodes

        section = OmegaConf.to_container(cfg.env.low_acceptance, resolve=True)
        setting("env.low_acceptance", section,
                lambda: LowAcceptanceEpisodes.from_config(section))
    pretrain = cfg.get("agent", {}).get("pretrain", {})
    weight = pretrain.get("disagreement_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 1:
        raise UsageError(f"agent.pretrain.disagreement_weight={show(weight)}: must be a "
                         "number >= 1 (1: the student's mistakes count as any other state)")
    weight = pretrain.get("start_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 1:
        raise UsageError(f"agent.pretrain.start_weight={show(weight)}: must be a number >= 1 "
                         "(1: an episode's first decisions count as any other state)")
    count = pretrain.get("start_decisions", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise UsageError(f"agent.pretrain.start_decisions={show(count)}: must be a whole "
                         "number >= 0 (how many of an episode's first decisions start_weight "
                         "weighs)")
    weight = pretrain.get("anchor_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 1:
        raise UsageError(f"agent.pretrain.anchor_weight={show(weight)}: must be a number >= 1 "
                         "(1: states the initial policy already gets right count as any other)")
    if weight != 1 and not cfg.agent.get("init_policy"):
        raise UsageError(f"agent.pretrain.anchor_weight={show(weight)} needs "
                         "agent.init_policy (it weighs where the initial policy agrees with "
                         "the teacher)")
    modes = pretrain.get("initial_label_modes") or []
    if modes:
        from env.scenarios import PRIOR_MODES

        unknown = [m for m in modes if m not in PRIOR_MODES]
        if isinstance(modes, str) or unknown:
            raise UsageError(f"agent.pretrain.initial_label_modes={show(modes)}: must be a "
                             f"list of cost-prior modes, of {list(PRIOR_MODES)}")
        if not cfg.agent.get("init_policy"):
            raise UsageError(f"agent.pretrain.initial_label_modes={show(modes)} needs "
                             "agent.init_policy (its actions label those states)")
    count = pretrain.get("initial_label_decisions", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise UsageError(f"agent.pretrain.initial_label_decisions={show(count)}: must be a "
                         "whole number >= 0")
    if count and not cfg.agent.get("init_policy"):
        raise UsageError(f"agent.pretrain.initial_label_decisions={show(count)} needs "
                         "agent.init_policy (its actions label those states)")
    fraction = pretrain.get("blend", 1.0)
    if (isinstance(fraction, bool) or not isinstance(fraction, int | float)
            or not 0 < fraction <= 1):
        raise UsageError(f"agent.pretrain.blend={show(fraction)}: must be a number in (0, 1] "
                         "(1: the retrained weights as they are)")
    if fraction != 1 and not cfg.agent.get("init_policy"):
        raise UsageError(f"agent.pretrain.blend={show(fraction)} needs agent.init_policy "
                         "(it keeps part of the way from its weights)")
    rate = pretrain.get("learning_rate", 1e-3)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise UsageError(f"agent.pretrain.learning_rate={show(rate)}: must be a number > 0")
    if cfg.get("agent", {}).get("init_policy"):
        init_policy("agent.init_policy", cfg.agent)
    teacher = pretrain.get("teacher")
    if teacher and profiles:
        from agents.policies import make_policy

        setting("agent.pretrain.teacher", teacher, lambda: make_policy(
            str(teacher), profile=profiles[0], max_depth=max_depth))
        options = dict(pretrain.get("teacher_options") or {})
        setting("agent.pretrain.teacher_options", options, lambda: make_policy(
            str(teacher), profile=profiles[0], max_depth=max_depth, options=options))
    if "eval" in cfg and cfg.get("evaluate", True) and profiles:
        ev = cfg.eval
        for key in ("policies", "sweep_policies"):
            names = [str(n) for n in ev.get(key) or [] if str(n) != "ppo" or policy_key]
            if names:
                policies(f"eval.{key}", names, profile=profiles[0], max_depth=max_depth,
                         policy_path=policy_path)
        concurrency("eval.sweep_concurrency", list(ev.sweep_concurrency))

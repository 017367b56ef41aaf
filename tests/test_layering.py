"""The package layering, checked on the source (AST): each layer imports only the layers below.

    env.traces    schema, trace format, workloads      imports no other part of the project
    env.sim       simulator, cost model, calibration   + env.traces
    env           gym env, features, rollout           + env.sim
    controller    the serving daemon                   env's serving contracts (below) only
    sglang_hooks  the SGLang plugin                    + controller
    agents        training, evaluation, bench          anything

Two exceptions, each for a reason: :mod:`env.sim.calibration` matches end-to-end targets by
simulating bench cells exactly as ``specctl-bench`` runs them (``env.factory``,
``env.rollout``); console-script modules (``[project.scripts]``) use the shared command-line
front end (``agents.cli``, ``agents.checks``: one-line errors, Hydra apps). The serving side
(``env``, ``controller``, ``sglang_hooks``) never needs the ``train`` extra (torch, SB3):
``sglang_hooks`` may import it inside a function only, as it runs inside SGLang.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("env", "controller", "sglang_hooks", "agents")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

#: What the serving side (controller, plugin) may take from env: the telemetry records and
#: trace format, the feature contract (and the acceptance probe the features keep the
#: budget of, and the goodput guard read from the observation), the cost profile handed to
#: the controller.
SERVING_CONTRACTS = ("env.traces", "env.features", "env.probe", "env.guard",
                     "env.sim.cost_model")
#: Layer (module prefix) -> the project modules it may import (prefixes). Longest prefix wins.
LAYERS: dict[str, tuple[str, ...]] = {
    "env.traces": ("env.traces",),
    "env.sim": ("env.sim", "env.traces"),
    "env.sim.calibration": ("env",),
    "env": ("env",),
    "controller": ("controller", *SERVING_CONTRACTS),
    "sglang_hooks": ("sglang_hooks", "controller", *SERVING_CONTRACTS),
    "agents": PACKAGES,
}
#: The shared command-line front end, open to every console-script module.
CLI_FRONT_END = ("agents.cli", "agents.checks")
ENTRY_POINTS = frozenset(target.split(":")[0]
                         for target in PYPROJECT["project"]["scripts"].values())
#: Top-level modules of the ``train`` extra (distribution names as import names).
TRAIN_ONLY = frozenset(
    spec.split(">")[0].split("=")[0].split("<")[0].strip().replace("-", "_")
    for spec in PYPROJECT["project"]["optional-dependencies"]["train"]
)
#: Layers that must import without the train extra; sglang_hooks: at module level only.
NO_TRAIN_ANYWHERE = ("env", "controller")
NO_TRAIN_AT_TOP = ("sglang_hooks",)


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is, and whether it runs at import time."""

    module: str
    line: int
    top_level: bool


def _within(module: str, prefixes: tuple[str, ...] | frozenset[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _layer(module: str) -> str | None:
    matches = [p for p in LAYERS if _within(module, (p,))]
    return max(matches, key=len) if matches else None


def _is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every module ``source`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    tree = ast.parse(source)
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef)
    functions = [f for f in ast.walk(tree) if isinstance(f, scopes)]
    nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        top = id(node) not in nested
        if isinstance(node, ast.Import):
            found += [Import(a.name, node.lineno, top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - (node.level - 1)])
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if _is_module(sub) else base, node.lineno, top))
    return found


def violations(module: str, imports: list[Import]) -> list[str]:
    """What ``module`` imports against the layering, one line each (empty: none)."""
    layer = _layer(module)
    if layer is None:
        return []
    allowed = LAYERS[layer] + (CLI_FRONT_END if module in ENTRY_POINTS else ())
    found = []
    for imp in imports:
        root = imp.module.split(".")[0]
        if root in PACKAGES and not _within(imp.module, allowed):
            found.append(f"line {imp.line}: {layer} may not import {imp.module}")
        if root in TRAIN_ONLY and (_within(module, NO_TRAIN_ANYWHERE) or
                                   (imp.top_level and _within(module, NO_TRAIN_AT_TOP))):
            found.append(f"line {imp.line}: {module} imports {imp.module} (the train extra)")
    return found


def _project_modules() -> list[tuple[str, Path]]:
    modules = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return modules


MODULES = _project_modules()


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_module_respects_the_layering(module, path):
    found = imports_of(path.read_text(), module, is_package=path.name == "__init__.py")
    assert violations(module, found) == [], path.relative_to(REPO)


def test_every_layer_has_modules():
    """The table names real packages (a renamed folder would silently check nothing)."""
    for layer in LAYERS:
        assert any(_within(m, (layer,)) for m, _ in MODULES), layer
    assert ENTRY_POINTS and all(_is_module(m) for m in ENTRY_POINTS)
    assert {"torch", "stable_baselines3"} <= TRAIN_ONLY


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("env.traces.workloads", "from env.sim.cost_model import CostProfile",
     "env.traces may not import env.sim.cost_model"),
    ("env.traces.schema", "from env import features", "env.traces may not import env.features"),
    ("env.sim.simulator", "from env.rollout import rollout", "env.sim may not import env.rollout"),
    ("env.sim.cost_model", "from agents.cli import UsageError",
     "env.sim may not import agents.cli"),
    ("env.features", "import controller.wire", "env may not import controller.wire"),
    ("env.sim.calibration.h200", "from agents.bench import run_cell",
     "env.sim.calibration may not import agents.bench"),
    ("controller.server", "from env.rollout import DecisionLoop",
     "controller may not import env.rollout"),
    ("controller.cli", "from agents.policies import make_policy",
     "controller may not import agents.policies"),
    ("sglang_hooks.client", "from agents import policies",
     "sglang_hooks may not import agents.policies"),
    ("controller.decider", "def f():\n    import torch", "controller.decider imports torch"),
    ("sglang_hooks.runtime", "import stable_baselines3",
     "sglang_hooks.runtime imports stable_baselines3"),
    ("env.traces.workloads", "from . import schema\nfrom ..sim import cost_model",
     "env.traces may not import env.sim.cost_model"),
])
def test_a_violation_is_reported(module, source, expected):
    found = violations(module, imports_of(source, module))
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(("module", "source"), [
    ("env.sim.fit_profile", "from agents.cli import UsageError, reported"),  # a console script
    ("controller.cli", "from agents.cli import hydra_app"),  # a console script
    ("env.sim.calibration.fitting", "from env.rollout import rollout"),
    ("sglang_hooks.offswitch", "def f():\n    import torch"),  # inside SGLang only
    ("controller.server", "from env.traces.schema import StepRecord"),
    ("agents.train", "import torch\nfrom sglang_hooks import config"),
])
def test_what_the_layering_allows(module, source):
    assert violations(module, imports_of(source, module)) == []

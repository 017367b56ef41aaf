"""Two source trees in one process, for the lock-step A/B benchmarks (``ab_daemon.py``,
``ab_hooks.py``): each tree's packages imported as their own module copies."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

#: The project's top-level packages: a tree's copies replace the other tree's.
PACKAGES = ("controller", "env", "benchmarks", "sglang_hooks", "agents")


def load_tree(root: Path, modules: tuple[str, ...]) -> dict[str, ModuleType]:
    """Import ``modules`` afresh from ``root``; returns every module of its packages."""
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
    return {n: m for n, m in sys.modules.items() if n.split(".")[0] in PACKAGES}

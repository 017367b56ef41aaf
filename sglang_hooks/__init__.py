"""specctl's SGLang plugin: a learned controller chooses every decode step's speculation depth.

Entry point: :func:`sglang_hooks.plugin.register` (inactive unless a ``SPECCTL_*``
variable enables it, see :mod:`sglang_hooks.config`). Importing this package is
cheap and patches nothing.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def adaptive_config_path() -> Path:
    """The ``--speculative-adaptive-config`` file shipped with the plugin (steps 0..7)."""
    return Path(str(resources.files("sglang_hooks") / "adaptive_config.json"))

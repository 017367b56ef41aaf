"""Where the shipped default policy lives."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def default_policy_path() -> Path:
    """Path of the trained policy shipped with the package."""
    return Path(str(resources.files("controller") / "data" / "default_policy.npz"))

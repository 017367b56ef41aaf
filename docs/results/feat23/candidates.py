"""A candidate policy file: a shipped file with some feature-spec fields changed and nothing
else (weights, guard, probe), written as ``policy_<sha8>.npz`` (the twenty-third and
twenty-fourth sessions' ``make_policy.py`` scripts)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from controller.policy_file import ExportedPolicy


def write_candidate(label: str, source: Path, folder: Path, **changes) -> Path:
    """Write ``source`` with its feature spec's fields ``changes`` into ``folder``, print
    ``label``, its sha256 and its name, and return its path."""
    policy = ExportedPolicy.load(source)
    spec = dataclasses.replace(policy.feature_spec, **changes)
    path = dataclasses.replace(policy, feature_spec=spec).save_named_by_hash(folder)
    print(label, hashlib.sha256(path.read_bytes()).hexdigest(), path.name)
    return path

#!/usr/bin/env python
"""One-off: a copy of the shipped policy file with guard / probe settings replaced.

    python docs/results/never_pays16/make_candidate.py OUT.npz guard.margin=-0.05 ...

Prints the new file's sha256. The arrays and feature spec are the shipped file's.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from controller.policy_file import ExportedPolicy

SHIPPED = Path(__file__).resolve().parents[3] / "controller/data/default_policy.npz"


def main(argv: list[str]) -> None:
    """Write the copy and print its sha256."""
    out, settings = argv[0], argv[1:]
    policy = ExportedPolicy.load(SHIPPED)
    changes: dict[str, dict] = {"guard": {}, "probe": {}}
    for item in settings:
        key, value = item.split("=", 1)
        block, name = key.split(".", 1)
        changes[block][name] = json.loads(value)
    policy.guard = policy.guard.override(changes["guard"])
    policy.probe = policy.probe.override(changes["probe"])
    policy.provenance = {**policy.provenance, "never_pays16_from": {
        "sha256": hashlib.sha256(SHIPPED.read_bytes()).hexdigest(), "settings": settings}}
    policy.save(out)
    print(hashlib.sha256(Path(out).read_bytes()).hexdigest(), policy.guard, policy.probe)


if __name__ == "__main__":
    main(sys.argv[1:])

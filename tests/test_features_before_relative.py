"""The policy file shipped when ``FeatureSpec.latency_outlier_relative`` came (written
before it; kept as ``docs/results/off_probe/policy_3dd256a8.npz``, so this holds whatever
ships later) computes as the code before the field computed it, on a stream that would
show the field: a stall at the second measured step, then steps dear against the profile.

``tests/data/features_before_outlier_relative.json`` holds that code's observations
(commit 7c02a06, both backends, the shipped file's spec with the profile handed);
regenerate it only from a checkout of that code: ``PYTHONPATH=<old checkout> python
tests/test_features_before_relative.py``. The tolerance (1e-12 relative, 1e-7 on the
vector) only allows another machine's BLAS/LAPACK rounding.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from controller.policy_file import ExportedPolicy
from env.features import FeatureBuilder, FeatureSpec
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

ROOT = Path(__file__).parents[1]
GOLDEN = Path(__file__).parent / "data" / "features_before_outlier_relative.json"
SHIPPED = ROOT / "docs" / "results" / "off_probe" / "policy_3dd256a8.npz"
PROFILE = "h200_qwen3_30b_a3b"
CHECKPOINTS = (1, 3, 6, 12, 40, 119)
BATCHES = (1, 3, 16, 64)
GRID_ROWS = (0, 2, 7, 11)


def _stream() -> list[StepRecord]:
    """120 decode steps: depth 5 at batch 1-3 with a 16x stall at the second, then off
    and depth 3 at 8-24, the first 40 at 2-4x the profile (another server's), the rest
    at it."""
    rng = np.random.default_rng(20)
    profile = load_profile(PROFILE)
    out = []
    for i in range(120):
        depth = 5 if i < 4 else (3 if (i // 10) % 2 else 0)
        batch = 1 + i if i < 4 else int(rng.integers(8, 25))
        kv = 300 * batch
        latency = profile.step_latency_s(batch, depth, kv, 0, depth > 0, depth > 0)
        latency *= 16.0 if i == 1 else float(rng.uniform(2.0, 4.0)) if i < 40 else 1.0
        accepted = (rng.integers(0, depth + 1, size=batch).astype(np.int8) if depth
                    else np.zeros(0, dtype=np.int8))
        out.append(StepRecord("s", 0, i, 0.01 * i, batch, 0, batch, kv, 500_000, 0, depth,
                              accepted, latency))
    return out


def _observe(spec: FeatureSpec, backend: str) -> list[dict]:
    builder = FeatureBuilder(spec, load_profile(PROFILE), backend=backend)
    points = []
    for i, record in enumerate(_stream()):
        builder.update(record)
        if i in CHECKPOINTS:
            points.append({
                "grid": builder.observation_grid()[list(GRID_ROWS)].tolist(),
                "latency_s": builder.latency_predictions_s(np.array(BATCHES)).tolist(),
            })
    return points


def _shipped_spec() -> FeatureSpec:
    return ExportedPolicy.load(SHIPPED).feature_spec


@pytest.mark.parametrize("backend", ["numpy", "compiled"])
def test_the_shipped_file_computes_as_before_the_field(backend):
    if backend == "compiled":
        pytest.importorskip("numba")
    golden = json.loads(GOLDEN.read_text())[backend]
    spec = _shipped_spec()
    assert spec.latency_outlier_relative is False
    for want, have in zip(golden, _observe(spec, backend), strict=True):
        np.testing.assert_allclose(have["grid"], want["grid"], rtol=0, atol=1e-7)
        np.testing.assert_allclose(have["latency_s"], want["latency_s"], rtol=1e-12)


def test_the_field_computes_otherwise_on_this_stream():
    """The stream can tell the rule on from off (else the test above could not fail)."""
    golden = json.loads(GOLDEN.read_text())["numpy"]
    spec = dataclasses.replace(_shipped_spec(), latency_outlier_relative=True)
    got = _observe(spec, "numpy")
    assert not np.allclose(got[2]["latency_s"], golden[2]["latency_s"], rtol=1e-3)


if __name__ == "__main__":  # regenerate (from the old code only: see the docstring)
    document = {backend: _observe(_shipped_spec(), backend)
                for backend in ("numpy", "compiled")}
    GOLDEN.write_text(json.dumps(document))
    sys.stdout.write(f"wrote {GOLDEN}\n")

"""A policy file written before ``FeatureSpec.latency_model`` existed (the seventh session's
``778dd34c…``, shipped until the twelfth session and kept in ``docs/results/h200``) loads as
latency model 1 and its features compute as the code before the twelfth session computed them.

``tests/data/features_before_latency_model.json`` holds that code's observations of a
fixed telemetry stream (both backends, with and without a profile); regenerate it only
from a checkout of that code: ``PYTHONPATH=<old checkout> python
tests/test_features_old_files.py``. The numbers compared are float32 vectors and float64
latency predictions: equal here to the last bit; the tolerance (1e-12 relative, 1e-7 on
the vector) only allows another machine's BLAS/LAPACK rounding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from env.features import FeatureBuilder, FeatureSpec
from env.sim.cost_model import load_profile
from env.traces.schema import StepRecord

GOLDEN = Path(__file__).parent / "data" / "features_before_latency_model.json"
OLD_FILE = Path(__file__).parents[1] / "docs" / "results" / "h200" / "policy_778dd34c.npz"
#: The observation points of the stream, and the batch sizes predicted at.
CHECKPOINTS = (5, 60, 140, 260, 399)
BATCHES = (1, 16, 64, 300)
#: The rows of the observation grid kept (batch sizes 1, 16, 64, 256).
GRID_ROWS = (0, 7, 11, 15)


def _stream() -> list[StepRecord]:
    """400 steps: off at small batches, a long depth-2 run at 40-64, deeper and back."""
    rng = np.random.default_rng(12)
    profile = load_profile("h200_qwen3_30b_a3b")
    out = []
    for i in range(400):
        depth = 0 if i < 60 else 2 if i < 260 else (3 if i % 7 else 0)
        batch = int(rng.integers(1, 4)) if i < 60 else int(rng.integers(40, 65))
        kv = 1000 * i
        latency = profile.step_latency_s(batch, depth, kv, 0, depth > 0, depth > 0)
        latency *= float(rng.uniform(0.9, 1.1))
        accepted = (rng.integers(0, depth + 1, size=batch).astype(np.int8) if depth
                    else np.zeros(0, dtype=np.int8))
        out.append(StepRecord("s", 0, i, 0.01 * i, batch, 3, batch, kv, 500_000, 0, depth,
                              accepted, latency))
    return out


def _observe(spec: FeatureSpec, backend: str, with_profile: bool) -> list[dict]:
    prior = load_profile("h200_llama31_8b") if with_profile else None
    builder = FeatureBuilder(spec, prior, backend=backend)
    points = []
    for i, record in enumerate(_stream()):
        builder.update(record)
        if i in CHECKPOINTS:
            points.append({
                "grid": builder.observation_grid()[list(GRID_ROWS)].tolist(),
                "latency_s": builder.latency_predictions_s(np.array(BATCHES)).tolist(),
            })
    return points


def _cases() -> list[tuple[str, bool]]:
    return [(backend, with_profile) for backend in ("numpy", "compiled")
            for with_profile in (False, True)]


def test_an_old_file_predates_the_field_and_loads_as_model_1():
    from controller.policy_file import ExportedPolicy

    with np.load(OLD_FILE) as archive:
        stored = json.loads(archive["meta"].tobytes())["feature_spec"]
    assert "latency_model" not in stored
    spec = ExportedPolicy.load(OLD_FILE).feature_spec
    assert spec.latency_model == 1
    assert spec == FeatureSpec()  # the defaults are the old features


@pytest.mark.parametrize(("backend", "with_profile"), _cases())
def test_an_old_spec_computes_as_before(backend, with_profile):
    if backend == "compiled":
        pytest.importorskip("numba")
    golden = json.loads(GOLDEN.read_text())[f"{backend}/{with_profile}"]
    old = {key: value for key, value in FeatureSpec().to_dict().items()
           if key in golden["spec"]}
    assert set(old) == set(golden["spec"])
    spec = FeatureSpec.from_dict(golden["spec"])  # the old file's dict: no new fields
    assert spec.latency_model == 1
    got = _observe(spec, backend, with_profile)
    for want, have in zip(golden["points"], got, strict=True):
        np.testing.assert_allclose(have["grid"], want["grid"], rtol=0, atol=1e-7)
        np.testing.assert_allclose(have["latency_s"], want["latency_s"], rtol=1e-12)


def test_the_new_latency_model_computes_otherwise():
    """The golden data can tell the models apart (else the test above could not fail)."""
    golden = json.loads(GOLDEN.read_text())["numpy/False"]
    spec = FeatureSpec.from_dict({**golden["spec"], "latency_model": 2})
    got = _observe(spec, "numpy", False)
    assert not np.allclose(got[-1]["latency_s"], golden["points"][-1]["latency_s"],
                           rtol=1e-3)


if __name__ == "__main__":  # regenerate (from the old code only: see the docstring)
    document = {}
    for backend, with_profile in _cases():
        spec = FeatureSpec()
        document[f"{backend}/{with_profile}"] = {
            "spec": spec.to_dict(), "points": _observe(spec, backend, with_profile)}
    GOLDEN.write_text(json.dumps(document))
    sys.stdout.write(f"wrote {GOLDEN}\n")

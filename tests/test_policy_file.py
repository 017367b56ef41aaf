"""Policy files that pass the format checks but cannot serve are refused when loaded,
naming the field; a reload of one keeps the old policy (issue 10, item 7)."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest

from controller.policy_file import ExportedPolicy, PolicyFileError
from controller.reload import PolicyHolder
from env.features import FeatureSpec


def _write(path, meta_changes: dict | None = None, spec_changes: dict | None = None,
           meta_override=None, arrays: dict | None = None) -> None:
    """Save a valid random policy, then rewrite its meta/arrays as given (bypassing checks)."""
    ExportedPolicy.random(seed=3, name="edited").save(path)
    with np.load(path) as archive:
        data = {key: archive[key] for key in archive.files}
    meta = json.loads(data["meta"].tobytes())
    meta.update(meta_changes or {})
    if spec_changes:
        meta["feature_spec"].update(spec_changes)
    if meta_override is not None:
        meta = meta_override
    data["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    data.update(arrays or {})
    buffer = io.BytesIO()
    np.savez(buffer, **data)
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize(("changes", "message"), [
    (dict(spec_changes={"batch_grid": []}), "batch_grid"),
    (dict(spec_changes={"batch_grid": [-8, -4]}), "batch_grid"),
    (dict(spec_changes={"batch_grid": [1, 8, 4]}), "batch_grid"),
    (dict(spec_changes={"batch_grid": list(range(1, 300))}), "batch_grid"),
    (dict(spec_changes={"accept_decay": float("nan")}), "accept_decay"),
    (dict(spec_changes={"accept_decay": 1.5}), "accept_decay"),
    (dict(spec_changes={"latency_ridge": 0.0}), "latency_ridge"),
    (dict(spec_changes={"cost_confidence_samples": 0.0}), "cost_confidence_samples"),
    (dict(spec_changes={"ema_alpha": float("inf")}), "ema_alpha"),
    (dict(spec_changes={"batch_scale": -1.0}), "batch_scale"),
    (dict(meta_override=[1, 2, 3]), "must be a JSON object"),
    (dict(meta_override="policy"), "must be a JSON object"),
    (dict(meta_changes={"format_version": 99}), "format_version"),
    (dict(meta_changes={"format_version": None}), "format_version"),
    (dict(meta_changes={"actions": [0, 1, 2, 3, 4, 5, 6, 9]}), "actions"),
    (dict(meta_changes={"name": "x" * 300}), "name"),
    (dict(meta_changes={"provenance": [1]}), "provenance"),
    (dict(meta_changes={"feature_spec": None}), "feature_spec"),
    (dict(arrays={"w0": np.zeros((38, 64), dtype="<U1")}), "w0"),
])
def test_a_loadable_but_wrong_policy_file_is_refused(tmp_path, changes, message):
    path = tmp_path / "bad.npz"
    _write(path, **changes)
    with pytest.raises(PolicyFileError, match=message) as info:
        ExportedPolicy.load(path)
    assert "bad.npz" in str(info.value)


def test_a_missing_meta_field_is_named(tmp_path):
    path = tmp_path / "p.npz"
    ExportedPolicy.random(seed=3).save(path)
    with np.load(path) as archive:
        data = {key: archive[key] for key in archive.files}
    meta = json.loads(data["meta"].tobytes())
    del meta["actions"]
    data["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path.with_suffix(""), **data)  # np.savez appends .npz
    with pytest.raises(PolicyFileError, match="missing field 'actions'"):
        ExportedPolicy.load(path)


def test_actions_above_max_depth_are_refused():
    with pytest.raises(PolicyFileError, match="actions"):
        ExportedPolicy.random(spec=FeatureSpec(max_depth=3), actions=[0, 2, 4])


def test_reloading_an_empty_grid_keeps_the_old_policy_and_says_so(tmp_path, caplog):
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1, name="good").save(path)
    holder = PolicyHolder(path)
    _write(path, spec_changes={"batch_grid": []})
    holder.request_reload()
    with caplog.at_level(logging.INFO):
        assert holder.poll() is False
    assert holder.policy.name == "good"
    assert "policy reloaded" not in caplog.text and "batch_grid" in caplog.text

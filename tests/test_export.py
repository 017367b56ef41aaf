"""The torch-free export acts exactly like the SB3 model, and bad files are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stable_baselines3 import PPO

from agents.export import export_ppo
from controller.policy_file import ExportedPolicy, PolicyFileError
from env.features import FeatureSpec
from env.spec_env import SpecDecodeEnv

CFG = {"horizon_s": 2.0, "workloads": [{"name": "fixed", "kind": "closed", "concurrency": [8]}]}


@pytest.mark.parametrize("activation", [torch.nn.Tanh, torch.nn.ReLU])
def test_exported_policy_matches_sb3_on_the_same_observations(tmp_path, activation):
    env = SpecDecodeEnv(CFG)
    model = PPO("MlpPolicy", env, seed=0, device="cpu",
                policy_kwargs={"net_arch": [32, 16], "activation_fn": activation})
    # Random weights big enough that actions vary across observations.
    with torch.no_grad():
        for p in model.policy.parameters():
            p.mul_(8.0)
    exported = export_ppo(model, FeatureSpec(), provenance={"test": True})
    exported.save(tmp_path / "p.npz")
    loaded = ExportedPolicy.load(tmp_path / "p.npz")
    rng = np.random.default_rng(0)
    observations = rng.uniform(-1, 1, size=(2000, FeatureSpec().size)).astype(np.float32)
    sb3, _ = model.predict(observations, deterministic=True)
    assert len(set(sb3.tolist())) > 2
    assert np.array_equal(loaded.act(observations), sb3)
    assert loaded.act(observations[0]) == int(sb3[0])
    assert loaded.provenance == {"test": True}


def test_corrupt_and_mismatched_files_name_the_problem(tmp_path):
    bad = tmp_path / "garbage.npz"
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(PolicyFileError, match=r"garbage\.npz"):
        ExportedPolicy.load(bad)
    good = ExportedPolicy(weights=[np.zeros((FeatureSpec().size, 8), np.float32)],
                          biases=[np.zeros(8, np.float32)], actions=list(range(8)),
                          feature_spec=FeatureSpec())
    with pytest.raises(PolicyFileError, match="actions"):
        ExportedPolicy(weights=good.weights, biases=good.biases, actions=[0, 1],
                       feature_spec=FeatureSpec())
    with pytest.raises(PolicyFileError, match="w0"):
        ExportedPolicy(weights=[np.zeros((5, 8), np.float32)], biases=good.biases,
                       actions=list(range(8)), feature_spec=FeatureSpec())
    with pytest.raises(PolicyFileError, match="non-finite"):
        ExportedPolicy(weights=[np.full((FeatureSpec().size, 8), np.nan, np.float32)],
                       biases=good.biases, actions=list(range(8)), feature_spec=FeatureSpec())


def test_old_format_version_is_rejected_with_the_reason(tmp_path):
    import json

    path = tmp_path / "old.npz"
    ExportedPolicy.random().save(path)
    with np.load(path) as archive:
        arrays = {k: archive[k] for k in archive.files}
    meta = json.loads(arrays["meta"].tobytes().decode())
    meta["format_version"] = 1
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)
    with pytest.raises(PolicyFileError, match=r"old\.npz.*format_version.*1.*retrain"):
        ExportedPolicy.load(path)

"""Export a stable-baselines3 PPO policy to the torch-free policy file.

The deterministic PPO action is the arg-max of the action net applied to the
policy branch of the MLP extractor; we copy exactly those layers.
"""

from __future__ import annotations

import torch
from stable_baselines3 import PPO

from controller.policy_file import ExportedPolicy
from env.features import FeatureSpec

_ACTIVATIONS = {torch.nn.Tanh: "tanh", torch.nn.ReLU: "relu"}


def export_ppo(model: PPO, feature_spec: FeatureSpec, name: str = "ppo",
               provenance: dict | None = None) -> ExportedPolicy:
    """The numpy copy of ``model``'s deterministic policy."""
    policy = model.policy
    linears: list[torch.nn.Linear] = []
    activation = None
    for layer in policy.mlp_extractor.policy_net:
        if isinstance(layer, torch.nn.Linear):
            linears.append(layer)
        elif type(layer) in _ACTIVATIONS:
            found = _ACTIVATIONS[type(layer)]
            if activation not in (None, found):
                raise ValueError("mixed activations are not exportable")
            activation = found
        else:
            raise ValueError(f"cannot export layer {layer!r}")
    linears.append(policy.action_net)
    weights = [layer.weight.detach().cpu().numpy().T.copy() for layer in linears]
    biases = [layer.bias.detach().cpu().numpy().copy() for layer in linears]
    n_actions = weights[-1].shape[1]
    return ExportedPolicy(
        weights=weights,
        biases=biases,
        actions=list(range(n_actions)),
        feature_spec=feature_spec,
        activation=activation or "tanh",
        name=name,
        provenance=provenance or {},
    )

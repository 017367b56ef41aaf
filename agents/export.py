"""Export a stable-baselines3 PPO policy to the torch-free policy file, and back.

The deterministic PPO action is the arg-max of the action net applied to the
policy branch of the MLP extractor; we copy exactly those layers
(:func:`export_ppo`), and :func:`load_exported` copies them back into a model to
start training from an exported policy (``agent.init_policy``).
"""

from __future__ import annotations

import numpy as np
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


def load_exported(model: PPO, exported: ExportedPolicy, source: str = "policy") -> None:
    """Copy ``exported``'s layers into ``model``'s actor (the inverse of :func:`export_ppo`).

    Only the actor is in a policy file; the critic keeps its initial weights (the
    kick-start fits it to returns). Raises ``ValueError`` naming ``source`` where the two
    differ in shape, activation or actions: the network must be built as the file's was
    (``agent.net_arch``, ``agent.activation``, the feature spec's ``max_depth``).
    """
    linears = [layer for layer in model.policy.mlp_extractor.policy_net
               if isinstance(layer, torch.nn.Linear)] + [model.policy.action_net]
    shapes = [tuple(layer.weight.shape[::-1]) for layer in linears]
    theirs = [tuple(w.shape) for w in exported.weights]
    if shapes != theirs:
        raise ValueError(f"{source}: its layers are {theirs}, the network built here has "
                         f"{shapes} (set agent.net_arch to its hidden sizes and env.max_depth "
                         "to its feature spec's)")
    activation = next((name for layer in model.policy.mlp_extractor.policy_net
                       for kind, name in _ACTIVATIONS.items() if type(layer) is kind), "tanh")
    if activation != exported.activation:
        raise ValueError(f"{source}: activation {exported.activation}, the network built here "
                         f"uses {activation} (set agent.activation)")
    if list(exported.actions) != list(range(len(exported.actions))):
        raise ValueError(f"{source}: actions {exported.actions} are not 0..N-1 as a PPO "
                         "policy's are")
    with torch.no_grad():
        for layer, w, b in zip(linears, exported.weights, exported.biases, strict=True):
            layer.weight.copy_(torch.as_tensor(np.asarray(w).T, dtype=layer.weight.dtype))
            layer.bias.copy_(torch.as_tensor(np.asarray(b), dtype=layer.bias.dtype))

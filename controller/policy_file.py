"""The exported-policy file: a small MLP and its feature spec, loadable with numpy.

Training (:mod:`agents.export`) writes it; the controller daemon loads it without
torch. The file is a NumPy ``.npz`` archive:

* ``meta``: a UTF-8 JSON document (as a uint8 array) with ``format``
  (``"specctl-policy"``), ``format_version``, ``name``, ``activation``
  (``"tanh"`` or ``"relu"``), ``actions`` (the speculation steps each output
  index stands for), ``feature_spec`` (see :class:`env.features.FeatureSpec`)
  and free-form ``provenance`` (how it was trained);
* ``w0, b0, w1, b1, ...``: the layers, ``y = act(x @ w + b)``, the last layer
  without activation giving one logit per action.

The chosen action is the arg-max logit (the deterministic PPO action).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from env.features import FeatureSpec

FORMAT = "specctl-policy"
#: 2: feature spec version 2 (the observation gained per-depth cost confidence and the
#: cost profile's presence and error; steps 0 means the plugin's real off switch).
FORMAT_VERSION = 2
_ACTIVATIONS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0)}


class PolicyFileError(ValueError):
    """The file is not a valid exported policy; the message says why."""


@dataclass
class ExportedPolicy:
    """An MLP policy over :class:`env.features.Observation` vectors."""

    weights: list[np.ndarray]
    biases: list[np.ndarray]
    actions: list[int]
    feature_spec: FeatureSpec
    activation: str = "tanh"
    name: str = "ppo"
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._validate()
        self._act = _ACTIVATIONS[self.activation]
        self._actions = np.asarray(self.actions, dtype=np.int64)

    def logits(self, observations: np.ndarray) -> np.ndarray:
        """Action logits for one observation vector or a batch of them."""
        x = np.asarray(observations, dtype=np.float32)
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = x @ w + b
            if i < last:
                x = self._act(x)
        return x

    def act(self, observations: np.ndarray) -> np.ndarray | int:
        """Speculation steps chosen for one observation (int) or a batch (array)."""
        logits = self.logits(observations)
        index = np.argmax(logits, axis=-1)
        if np.ndim(index) == 0:
            return int(self._actions[int(index)])
        return self._actions[index]

    @classmethod
    def random(cls, spec: FeatureSpec | None = None, actions: list[int] | None = None,
               hidden: tuple[int, ...] = (64, 64), seed: int = 0,
               name: str = "random") -> ExportedPolicy:
        """An untrained policy with random weights (tests and benchmarks)."""
        spec = spec or FeatureSpec()
        actions = list(range(spec.max_depth + 1)) if actions is None else list(actions)
        rng = np.random.default_rng(seed)
        widths = [spec.size, *hidden, len(actions)]
        weights = [rng.normal(0.0, 1.0 / np.sqrt(a), size=(a, b)).astype(np.float32)
                   for a, b in itertools.pairwise(widths)]
        biases = [np.zeros(b, dtype=np.float32) for b in widths[1:]]
        return cls(weights, biases, actions, spec, name=name, provenance={"random_seed": seed})

    # -- file I/O --------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the policy atomically (a reader never sees a half-written file)."""
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "activation": self.activation,
            "actions": list(self.actions),
            "feature_spec": self.feature_spec.to_dict(),
            "provenance": self.provenance,
        }
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            arrays[f"w{i}"] = w.astype(np.float32)
            arrays[f"b{i}"] = b.astype(np.float32)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(buffer.getvalue())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ExportedPolicy:
        """Read and validate a policy file; raises :class:`PolicyFileError`."""
        try:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise PolicyFileError(f"{path}: not a readable .npz policy file ({exc})") from exc
        if "meta" not in arrays:
            raise PolicyFileError(f"{path}: missing 'meta' entry")
        try:
            meta = json.loads(arrays["meta"].tobytes().decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PolicyFileError(f"{path}: field 'meta' is not JSON ({exc})") from exc
        if meta.get("format") != FORMAT:
            raise PolicyFileError(
                f"{path}: field 'format' is {meta.get('format')!r}, not {FORMAT!r}"
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise PolicyFileError(
                f"{path}: field 'format_version' is {meta.get('format_version')!r}; "
                f"this build reads version {FORMAT_VERSION} only (version 1 policies were "
                "trained on the old observation and on steps=0 costing SGLang's steps=0, "
                "not a real off switch: retrain with specctl-train)"
            )
        n_layers = sum(1 for key in arrays if key.startswith("w"))
        try:
            weights = [arrays[f"w{i}"] for i in range(n_layers)]
            biases = [arrays[f"b{i}"] for i in range(n_layers)]
            spec = FeatureSpec.from_dict(meta["feature_spec"])
            return cls(
                weights=weights,
                biases=biases,
                actions=[int(a) for a in meta["actions"]],
                feature_spec=spec,
                activation=meta.get("activation", "tanh"),
                name=meta.get("name", "ppo"),
                provenance=meta.get("provenance", {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PolicyFileError(f"{path}: {exc}") from exc

    def _validate(self) -> None:
        if self.activation not in _ACTIVATIONS:
            raise PolicyFileError(f"field 'activation': unknown activation {self.activation!r}")
        if not self.weights or len(self.weights) != len(self.biases):
            raise PolicyFileError("fields 'w*'/'b*': need one bias per weight matrix")
        width = self.feature_spec.size
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            if w.ndim != 2 or b.ndim != 1 or w.shape[0] != width or w.shape[1] != b.shape[0]:
                raise PolicyFileError(
                    f"field 'w{i}': shape {w.shape} with bias {b.shape} does not follow "
                    f"an input of width {width}"
                )
            if not (np.all(np.isfinite(w)) and np.all(np.isfinite(b))):
                raise PolicyFileError(f"field 'w{i}'/'b{i}': non-finite values")
            width = w.shape[1]
        if width != len(self.actions):
            raise PolicyFileError(
                f"field 'actions': {len(self.actions)} actions but the last layer has "
                f"{width} outputs"
            )
        if any(a < 0 or a > self.feature_spec.max_depth for a in self.actions):
            raise PolicyFileError(
                f"field 'actions': steps must lie in 0..{self.feature_spec.max_depth}, "
                f"got {self.actions}"
            )

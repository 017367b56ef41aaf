"""The exported-policy file: a small MLP and its feature spec, loadable with numpy.

Training (:mod:`agents.export`) writes it; the controller daemon loads it without
torch. The file is a NumPy ``.npz`` archive:

* ``meta``: a UTF-8 JSON document (as a uint8 array) with ``format``
  (``"specctl-policy"``), ``format_version``, ``name``, ``activation``
  (``"tanh"`` or ``"relu"``), ``actions`` (the speculation steps each output
  index stands for), ``feature_spec`` (see :class:`env.features.FeatureSpec`)
  free-form ``provenance`` (how it was trained) and, optionally, ``probe`` (the
  acceptance probe's settings, :class:`env.probe.ProbeSpec`; absent:
  :data:`env.probe.DEFAULT_PROBE`) and ``guard`` (the goodput guard's,
  :class:`env.guard.GuardSpec`; absent: :data:`env.guard.DEFAULT_GUARD`);
* ``w0, b0, w1, b1, ...``: the layers, ``y = act(x @ w + b)``, the last layer
  without activation giving one logit per action.

The chosen action is the arg-max logit (the deterministic PPO action).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import itertools
import json
import math
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from controller import fast_tanh
from controller.wire import MAX_BATCH, MAX_GRID, MAX_NAME_CHARS
from env.features import FeatureSpec
from env.guard import DEFAULT_GUARD, GuardColumns, GuardSpec, guard_columns
from env.probe import DEFAULT_PROBE, ProbeSpec

FORMAT = "specctl-policy"
#: 2: feature spec version 2 (the observation gained per-depth cost confidence and the
#: cost profile's presence and error; steps 0 means the plugin's real off switch).
#: 3: feature spec version 3 (per-depth cost confidence saturates within a few samples).
FORMAT_VERSION = 3
#: Largest speculation depth a decision can carry (int8 on the wire).
MAX_STEPS = 127
#: Most rows a layer's bias is kept tiled for (see ExportedPolicy.logits); larger
#: batches add it by broadcasting.
_TILED_BIAS_ROWS = 4096
#: Row counts whose bias views _forward keeps at most (a daemon's polls: a grid's rows
#: times the streams answered; emptied when full).
_ROW_BIAS_SHAPES = 64


def _relu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    return np.maximum(x, 0.0, out=out)


#: Activations, each a ufunc-like callable taking ``out=`` (see ExportedPolicy.logits).
_ACTIVATIONS = {"tanh": np.tanh, "relu": _relu}


def _approximate_tanh(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`controller.fast_tanh.tanh_inplace` in the activations' form (``out`` is
    ``x``: :meth:`ExportedPolicy._forward` applies them in place)."""
    if x.dtype != np.float32 or out is not x or not x.flags.c_contiguous:
        return np.tanh(x, out=out)  # not the forward's own float32 array (never, today)
    return fast_tanh.tanh_inplace(x)


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
    #: Where and how the deciders probe acceptance (:mod:`env.probe`).
    probe: ProbeSpec = DEFAULT_PROBE
    #: When the deciders overrule a speculative choice priced below off (:mod:`env.guard`).
    guard: GuardSpec = DEFAULT_GUARD

    def __post_init__(self) -> None:
        self._validate()
        self._act = _ACTIVATIONS[self.activation]
        self._actions = np.asarray(self.actions, dtype=np.int64)
        # Per layer: whether adding its bias in place gives x @ w + b exactly (the
        # product's dtype already holds the sum's; float32 weights and biases do).
        dtype = np.dtype(np.float32)
        self._bias_in_place = []
        for w, b in zip(self.weights, self.biases, strict=True):
            dtype = np.result_type(dtype, w.dtype)
            self._bias_in_place.append(np.result_type(dtype, b.dtype) == dtype)
            dtype = np.result_type(dtype, b.dtype)
        #: Whether approximate_logits may fuse each hidden layer's bias with its tanh
        #: (fast_tanh.bias_tanh_inplace takes float32 activations and biases).
        self._fused = all(w.dtype == np.float32 and b.dtype == np.float32 and b.ndim == 1
                          for w, b in zip(self.weights, self.biases, strict=True))
        #: Per layer, its bias repeated over rows (grown on demand, powers of two).
        self._tiled: list[np.ndarray | None] = [None] * len(self.biases)
        #: Per row count, every layer's bias over that many rows (see _forward).
        self._row_biases: dict[int, list[np.ndarray]] = {}

    def _bias_rows(self, layer: int, rows: int) -> np.ndarray:
        """Layer ``layer``'s bias repeated over ``rows`` rows (a view of a kept array).

        Adding it is the broadcast addition element for element (the same values), but
        a same-shape addition skips numpy's broadcasting setup: 0.7 vs 1.4 us at a
        20-row grid, 1.3 vs 2.6 us at 120 rows (three layers per forward).
        """
        tiled = self._tiled[layer]
        if tiled is None or tiled.shape[0] < rows:
            height = max(32, 1 << (rows - 1).bit_length())
            bias = self.biases[layer]
            tiled = self._tiled[layer] = np.ascontiguousarray(
                np.broadcast_to(bias, (height, bias.shape[0])))
        return tiled[:rows]

    def logits(self, observations: np.ndarray) -> np.ndarray:
        """Action logits for one observation vector or a batch of them."""
        return self._forward(observations, self._act)

    def approximate_logits(self, observations: np.ndarray) -> np.ndarray | None:
        """:meth:`logits` with the hidden layers' ``tanh`` from
        :func:`controller.fast_tanh.tanh_inplace` (~3x cheaper, within
        :data:`controller.fast_tanh.TANH_ERROR` of numpy's), or None where it does not
        apply (another activation, numba missing or turned off). The last bits differ
        from :meth:`logits`: a decision taken on them must recheck the rows whose best
        two logits are within :attr:`tanh_tolerance` (:func:`controller.decider.evaluate`
        does)."""
        if self.activation != "tanh" or not fast_tanh.ENABLED:
            return None
        x = np.asarray(observations, dtype=np.float32)
        if x.ndim != 2 or not self._fused:
            return self._forward(x, _approximate_tanh)
        # The hidden layers' bias and tanh in one compiled pass each
        # (fast_tanh.bias_tanh_inplace: the same float32 sum, then the same tanh, bit for
        # bit), not a numpy addition and then the kernel: one pass over the activations
        # less per hidden layer. The last layer as _forward adds its bias.
        last = len(self.weights) - 1
        dot, fused = np.dot, fast_tanh.bias_tanh_inplace
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = dot(x, w)
            if i < last:
                fused(x, b)
            elif x.shape[0] <= _TILED_BIAS_ROWS:
                x += self._bias_rows(i, x.shape[0])
            else:
                x += b
        return x

    @functools.cached_property
    def tanh_tolerance(self) -> float:
        """How far apart a row's best two :meth:`approximate_logits` must be for
        :meth:`logits` to rank them the same (:func:`controller.fast_tanh.tolerance`)."""
        return fast_tanh.tolerance(self.weights)

    def _forward(self, observations: np.ndarray, act) -> np.ndarray:
        """The MLP with ``act`` (in place, ``act(x, out=x)``) after each hidden layer."""
        x = np.asarray(observations, dtype=np.float32)
        last = len(self.weights) - 1
        # One new array per layer, the bias and activation applied in place: the same
        # values as x @ w + b and act(...), without two more temporaries of (rows, width)
        # each. The controller's batches (~1,800 rows x 64) made each temporary a fresh
        # mmap of page-faulting memory: 1.2-1.4 ms -> 0.46-0.54 ms per forward here.
        # np.dot, not @: the same BLAS call (the same values, tested), without the matmul
        # ufunc's dispatch (1.9 vs 3.0 us for a 20-row grid: a local decision's size).
        dot = np.dot
        rows = x.shape[0] if x.ndim == 2 and x.shape[0] <= _TILED_BIAS_ROWS else 0
        # Every layer's bias over ``rows`` rows, the views themselves kept by row count:
        # slicing the tiled biases anew was a numpy call per layer (~1.5 us each in a
        # 1-kHz server's poll, run with the caches cold; docs/ONLINE.md, twenty-fourth
        # pass). A view outlives a tiled array grown since: the same values.
        biases = self._row_biases.get(rows) if rows else None
        if biases is None and rows:
            if len(self._row_biases) >= _ROW_BIAS_SHAPES:
                self._row_biases.clear()
            biases = self._row_biases[rows] = [
                self._bias_rows(i, rows) if in_place else None
                for i, in_place in enumerate(self._bias_in_place)]
        for i, (w, b, in_place) in enumerate(zip(self.weights, self.biases,
                                                 self._bias_in_place, strict=True)):
            x = dot(x, w)
            if not in_place:
                x = x + b
            elif not rows:
                x += b
            else:
                x += biases[i]
            if i < last:
                act(x, out=x)
        return x

    @property
    def action_array(self) -> np.ndarray:
        """:attr:`actions` as an int64 array (made once; read it, do not write it)."""
        return self._actions

    @functools.cached_property
    def guard_columns(self) -> GuardColumns:
        """Where the goodput guard reads this policy's observations (looked up once:
        :func:`env.guard.guard_columns` hashes the feature spec at every call)."""
        return guard_columns(self.feature_spec)

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
        _write_atomically(Path(path), self.to_bytes())

    def save_named_by_hash(self, folder: str | os.PathLike) -> Path:
        """Write ``policy_<first 8 hex digits of the file's sha256>.npz`` into ``folder``
        (how the docs name the files they compare) and return its path."""
        data = self.to_bytes()
        path = Path(folder) / f"policy_{hashlib.sha256(data).hexdigest()[:8]}.npz"
        _write_atomically(path, data)
        return path

    def to_bytes(self) -> bytes:
        """The policy file's bytes (what :meth:`save` writes and :meth:`loads` reads)."""
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "activation": self.activation,
            "actions": list(self.actions),
            "feature_spec": self.feature_spec.to_dict(),
            "provenance": self.provenance,
            "probe": self.probe.to_dict(),
            "guard": self.guard.to_dict(),
        }
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            arrays[f"w{i}"] = w.astype(np.float32)
            arrays[f"b{i}"] = b.astype(np.float32)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    @classmethod
    def load(cls, path: str | os.PathLike) -> ExportedPolicy:
        """Read and validate a policy file; raises :class:`PolicyFileError`."""
        return cls._load(path, path)

    @classmethod
    def loads(cls, data: bytes, source: str) -> ExportedPolicy:
        """Validate a policy file's bytes (e.g. pushed by ``specctl-serve``); raises
        :class:`PolicyFileError`, naming ``source`` (where the bytes came from)."""
        return cls._load(io.BytesIO(data), source)

    @classmethod
    def _load(cls, file, path) -> ExportedPolicy:
        try:
            with np.load(file, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise PolicyFileError(f"{path}: not a readable .npz policy file ({exc})") from exc
        if "meta" not in arrays:
            raise PolicyFileError(f"{path}: missing 'meta' entry")
        try:
            meta = json.loads(arrays["meta"].tobytes().decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PolicyFileError(f"{path}: field 'meta' is not JSON ({exc})") from exc
        if not isinstance(meta, dict):
            raise PolicyFileError(
                f"{path}: field 'meta' must be a JSON object, got a {type(meta).__name__}"
            )
        if meta.get("format") != FORMAT:
            raise PolicyFileError(
                f"{path}: field 'format' is {meta.get('format')!r}, not {FORMAT!r}"
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise PolicyFileError(
                f"{path}: field 'format_version' is {meta.get('format_version')!r}; "
                f"this build reads version {FORMAT_VERSION} only (older policies were "
                "trained on an older observation: retrain with specctl-train)"
            )
        for name, kind in (("feature_spec", dict), ("actions", list), ("probe", dict),
                           ("guard", dict)):
            if name in meta and not isinstance(meta[name], kind):
                raise PolicyFileError(f"{path}: field {name!r} must be a JSON "
                                      f"{'object' if kind is dict else 'array'}")
        n_layers = sum(1 for key in arrays if key.startswith("w"))
        try:
            weights = [arrays[f"w{i}"] for i in range(n_layers)]
            biases = [arrays[f"b{i}"] for i in range(n_layers)]
            spec = FeatureSpec.from_dict(meta["feature_spec"])
            try:
                probe = (ProbeSpec.from_dict(meta["probe"]) if "probe" in meta
                         else DEFAULT_PROBE)
            except ValueError as exc:
                raise PolicyFileError(f"field 'probe': {exc}") from exc
            try:
                guard = (GuardSpec.from_dict(meta["guard"]) if "guard" in meta
                         else DEFAULT_GUARD)
            except ValueError as exc:
                raise PolicyFileError(f"field 'guard': {exc}") from exc
            return cls(
                weights=weights,
                biases=biases,
                actions=[int(a) for a in meta["actions"]],
                feature_spec=spec,
                activation=meta.get("activation", "tanh"),
                name=meta.get("name", "ppo"),
                provenance=meta.get("provenance", {}),
                probe=probe,
                guard=guard,
            )
        except PolicyFileError as exc:
            raise PolicyFileError(f"{path}: {exc}") from exc
        except KeyError as exc:
            raise PolicyFileError(f"{path}: missing field {exc}") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            raise PolicyFileError(f"{path}: {exc}") from exc

    def _validate(self) -> None:
        _validate_spec(self.feature_spec)
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_NAME_CHARS:
            # Every decision carries the name: a longer one is rejected by every client.
            raise PolicyFileError(
                f"field 'name': must be a string of 1..{MAX_NAME_CHARS} chars, "
                f"got {str(self.name)[:40]!r}"
            )
        if not isinstance(self.probe, ProbeSpec):
            raise PolicyFileError(f"field 'probe': expected a ProbeSpec, got {self.probe!r}")
        if not isinstance(self.guard, GuardSpec):
            raise PolicyFileError(f"field 'guard': expected a GuardSpec, got {self.guard!r}")
        if not isinstance(self.provenance, dict):
            raise PolicyFileError("field 'provenance': must be a JSON object")
        if self.activation not in _ACTIVATIONS:
            raise PolicyFileError(f"field 'activation': unknown activation {self.activation!r}")
        if not self.weights or len(self.weights) != len(self.biases):
            raise PolicyFileError("fields 'w*'/'b*': need one bias per weight matrix")
        width = self.feature_spec.size
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            if w.dtype.kind != "f" or b.dtype.kind != "f":
                raise PolicyFileError(
                    f"field 'w{i}'/'b{i}': dtypes {w.dtype}/{b.dtype}, expected floats"
                )
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
        if not self.actions or any(type(a) is not int for a in self.actions):
            raise PolicyFileError(f"field 'actions': expected a list of ints, got {self.actions}")
        if any(a < 0 or a > self.feature_spec.max_depth for a in self.actions):
            raise PolicyFileError(
                f"field 'actions': steps must lie in 0..{self.feature_spec.max_depth}, "
                f"got {self.actions}"
            )


# (field, low, high, low is open): the feature spec's numbers that would pass
# FeatureSpec's constructor yet break serving (NaN decays zero every estimate, a zero
# ridge makes the latency regression singular). Fields absent in this build are skipped.
_SPEC_RANGES = (
    ("accept_decay", 0.0, 1.0, True),
    ("latency_forgetting", 0.0, 1.0, True),
    ("ema_alpha", 0.0, 1.0, True),
    ("accept_prior_first", 0.0, 1.0, False),
    ("accept_prior_strength", 0.0, 1e9, False),
    ("latency_ridge", 0.0, 1e9, True),
    ("speculation_prior_fraction", 0.0, 1e3, False),
    ("draft_step_prior_fraction", 0.0, 1e3, False),
    ("token_prior_fraction", 0.0, 1e3, False),
    ("level_prior_weight", 0.0, 1e9, True),  # 0: the no-profile prior has no scale
    ("cost_confidence_samples", 0.0, 1e9, True),  # divides: must be > 0
    ("batch_scale", 0.0, 1e12, True),
    ("waiting_scale", 0.0, 1e12, True),
    ("switch_scale", 0.0, 1e12, True),
)


def _validate_spec(spec: FeatureSpec) -> None:
    """Reject a feature spec that loads but cannot serve; the message names the field."""
    depth = spec.max_depth
    if type(depth) is not int or not 1 <= depth <= MAX_STEPS:
        raise PolicyFileError(f"field 'feature_spec.max_depth': {depth!r} not an int in "
                              f"1..{MAX_STEPS}")
    for name in (f.name for f in dataclasses.fields(spec)):
        value = getattr(spec, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise PolicyFileError(f"field 'feature_spec.{name}': {value!r} is not finite")
    for name, low, high, open_low in _SPEC_RANGES:
        if not hasattr(spec, name):
            continue
        value = getattr(spec, name)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and (
            (low < value if open_low else low <= value) and value <= high)
        if not ok:
            bracket = "(" if open_low else "["
            raise PolicyFileError(
                f"field 'feature_spec.{name}': {value!r} not in {bracket}{low}, {high}]"
            )
    grid = spec.batch_grid
    if not grid or len(grid) > MAX_GRID:
        raise PolicyFileError(
            f"field 'feature_spec.batch_grid': needs 1..{MAX_GRID} batch sizes, got {len(grid)}"
        )
    if any(type(b) is not int or not 1 <= b <= MAX_BATCH for b in grid) or any(
            b <= a for a, b in itertools.pairwise(grid)):
        raise PolicyFileError(
            f"field 'feature_spec.batch_grid': must be strictly increasing ints in "
            f"1..{MAX_BATCH}, got {list(grid)[:8]}{'...' if len(grid) > 8 else ''}"
        )


def _write_atomically(path: Path, data: bytes) -> None:
    """Write through a temporary file beside ``path`` and rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)

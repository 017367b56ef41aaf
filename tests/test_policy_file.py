"""Policy files: save and load, the forward pass, and every check on loading (a file
that passes the format checks but cannot serve is refused naming the field; a reload of one
keeps the old policy, issue 10 item 7)."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import policy_file
from controller.policy_file import FORMAT_VERSION, MAX_STEPS, ExportedPolicy, PolicyFileError
from controller.reload import PolicyHolder
from controller.wire import MAX_BATCH, MAX_NAME_CHARS
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
    (dict(spec_changes={"latency_model": 4}), "latency_model"),
    (dict(spec_changes={"latency_model": 2.0}), "latency_model"),
    (dict(spec_changes={"level_prior_weight": 0.0}), "level_prior_weight"),
    (dict(spec_changes={"token_prior_fraction": -0.5}), "token_prior_fraction"),
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


# -- the forward pass, against torch (an independent implementation of the same MLP) ----


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), activation=st.sampled_from(["tanh", "relu"]),
       hidden=st.lists(st.integers(1, 9), max_size=2), scale=st.floats(0.1, 30.0))
def test_logits_match_a_torch_mlp_of_the_same_weights(seed, activation, hidden, scale):
    torch = pytest.importorskip("torch")
    spec = FeatureSpec(max_depth=3)
    policy = ExportedPolicy.random(spec, hidden=tuple(hidden), seed=seed)
    policy = ExportedPolicy([w * scale for w in policy.weights],  # logits well beyond +-1
                            [b + scale for b in policy.biases], policy.actions, spec,
                            activation=activation)
    layers = []
    for w, b in zip(policy.weights, policy.biases, strict=True):
        linear = torch.nn.Linear(*w.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T.copy()))
            linear.bias.copy_(torch.from_numpy(b))
        layers += [linear, torch.nn.Tanh() if activation == "tanh" else torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers[:-1])  # no activation after the output layer
    x = np.random.default_rng(seed).normal(size=(5, spec.size)).astype(np.float32)
    with torch.no_grad():
        expected = mlp(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(policy.logits(x), expected, rtol=1e-4, atol=1e-4 * scale)
    np.testing.assert_allclose(policy.logits(x[0]), expected[0], rtol=1e-4, atol=1e-4 * scale)


def test_act_returns_the_action_of_the_largest_logit_for_one_and_for_a_batch():
    spec = FeatureSpec(max_depth=7)
    # One linear layer: the logit of action i is x[i] (+ bias), so the arg-max is known.
    w = np.zeros((spec.size, 3), np.float32)
    w[0, 0] = w[1, 1] = w[2, 2] = 1.0
    policy = ExportedPolicy([w], [np.zeros(3, np.float32)], [5, 0, 7], spec)
    x = np.zeros((3, spec.size), np.float32)
    x[0, 2], x[1, 0], x[2, 1] = 1.0, 1.0, 1.0
    assert policy.act(x).tolist() == [7, 5, 0]
    assert policy.act(x[1]) == 5 and type(policy.act(x[1])) is int


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), activation=st.sampled_from(["tanh", "relu"]),
       name=st.text(min_size=1, max_size=20))
def test_save_load_round_trip_keeps_everything(tmp_path_factory, seed, activation, name):
    spec = FeatureSpec(max_depth=4, batch_grid=(1, 4, 16), accept_decay=0.9)
    original = ExportedPolicy.random(spec, actions=[0, 2, 4], hidden=(5,), seed=seed, name=name)
    original = ExportedPolicy(original.weights, original.biases, [0, 2, 4], spec,
                              activation=activation, name=name, provenance={"seed": seed})
    folder = tmp_path_factory.mktemp("policy")
    original.save(folder / "p.npz")
    back = ExportedPolicy.load(folder / "p.npz")
    assert [p.name for p in folder.iterdir()] == ["p.npz"]  # no temporary file left
    assert (back.name, back.activation, back.actions, back.feature_spec, back.provenance) == (
        name, activation, [0, 2, 4], spec, {"seed": seed})
    for a, b in zip(back.weights + back.biases, original.weights + original.biases, strict=True):
        assert a.dtype == np.float32 and np.array_equal(a, b)


def test_save_named_by_hash_names_the_file_by_its_own_sha256(tmp_path):
    """The docs name compared files ``policy_<sha8>.npz``: the name must be the hash of the
    bytes written, the bytes what ``save`` writes, and two policies must not share it."""
    import hashlib

    spec = FeatureSpec(max_depth=3)
    a = ExportedPolicy.random(spec, hidden=(4,), seed=0)
    path = a.save_named_by_hash(tmp_path)
    assert path.name == f"policy_{hashlib.sha256(path.read_bytes()).hexdigest()[:8]}.npz"
    a.save(tmp_path / "plain.npz")
    assert (tmp_path / "plain.npz").read_bytes() == path.read_bytes()
    other = ExportedPolicy.random(spec, hidden=(4,), seed=1).save_named_by_hash(tmp_path)
    assert other != path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, other.name, "plain.npz"])  # no temporary file left


# -- every boundary of the checks, both sides -------------------------------------------


def _policy(spec_changes: dict | None = None, **changes) -> ExportedPolicy:
    spec = FeatureSpec(**{"max_depth": 3, **(spec_changes or {})})
    base = ExportedPolicy.random(FeatureSpec(max_depth=3), hidden=(4,), seed=0)
    fields = dict(weights=base.weights, biases=base.biases, actions=[0, 1, 2, 3],
                  feature_spec=spec, activation="tanh", name="p", provenance={})
    fields.update(changes)
    return ExportedPolicy(**fields)


@pytest.mark.parametrize("spec_changes", [
    {"max_depth": 1}, {"max_depth": MAX_STEPS},
    {"accept_decay": 1.0}, {"latency_forgetting": 1.0}, {"ema_alpha": 1.0},
    {"accept_prior_first": 0.0}, {"accept_prior_first": 1.0},
    {"accept_prior_strength": 0.0}, {"accept_prior_strength": 1e9},
    {"latency_ridge": 1e9}, {"speculation_prior_fraction": 0.0},
    {"draft_step_prior_fraction": 1e3}, {"batch_scale": 1e12},
    {"waiting_scale": 1e-9}, {"switch_scale": 1e12}, {"accept_decay": 1},
    {"batch_grid": (1,)}, {"batch_grid": (MAX_BATCH,)}, {"batch_grid": tuple(range(1, 257))},
])
def test_values_on_the_edge_of_their_range_are_accepted(spec_changes):
    depth = spec_changes.get("max_depth", 3)
    policy = _policy(spec_changes, actions=[0, depth], weights=[np.zeros(
        (FeatureSpec(max_depth=depth).size, 2), np.float32)], biases=[np.zeros(2, np.float32)])
    assert policy.act(np.zeros(policy.feature_spec.size)) in (0, depth)


@pytest.mark.parametrize(("spec_changes", "field"), [
    ({"max_depth": 0}, "max_depth"), ({"max_depth": MAX_STEPS + 1}, "max_depth"),
    ({"max_depth": 3.0}, "max_depth"),
    ({"accept_decay": 0.0}, "accept_decay"), ({"accept_decay": 1.0 + 1e-9}, "accept_decay"),
    ({"latency_forgetting": 0.0}, "latency_forgetting"), ({"ema_alpha": 0.0}, "ema_alpha"),
    ({"accept_prior_first": -1e-9}, "accept_prior_first"),
    ({"accept_prior_first": 1.0 + 1e-9}, "accept_prior_first"),
    ({"accept_prior_strength": -1e-9}, "accept_prior_strength"),
    ({"accept_prior_strength": 2e9}, "accept_prior_strength"),
    ({"latency_ridge": 2e9}, "latency_ridge"),
    ({"speculation_prior_fraction": -1e-9}, "speculation_prior_fraction"),
    ({"draft_step_prior_fraction": 1e3 + 1}, "draft_step_prior_fraction"),
    ({"batch_scale": 0.0}, "batch_scale"), ({"waiting_scale": 0.0}, "waiting_scale"),
    ({"switch_scale": 0.0}, "switch_scale"), ({"switch_scale": 2e12}, "switch_scale"),
    ({"accept_decay": True}, "accept_decay"), ({"accept_decay": "0.9"}, "accept_decay"),
    ({"accept_decay": float("-inf")}, "accept_decay"),
    ({"batch_grid": ()}, "batch_grid"), ({"batch_grid": tuple(range(1, 258))}, "batch_grid"),
    ({"batch_grid": (0, 4)}, "batch_grid"), ({"batch_grid": (4, MAX_BATCH + 1)}, "batch_grid"),
    ({"batch_grid": (4, 4)}, "batch_grid"), ({"batch_grid": (1, 2.0)}, "batch_grid"),
])
def test_values_just_outside_their_range_are_refused_naming_the_field(spec_changes, field):
    depth = spec_changes.get("max_depth", 3)
    size = 13 + 5 * depth if type(depth) is int and depth >= 0 else 28
    with pytest.raises(PolicyFileError, match=rf"field 'feature_spec\.{field}'"):
        _policy(spec_changes, actions=[0], weights=[np.zeros((size, 1), np.float32)],
                biases=[np.zeros(1, np.float32)])


def test_the_grid_error_shows_the_first_entries_only():
    with pytest.raises(PolicyFileError) as info:
        _policy({"batch_grid": tuple(range(20, 0, -1))})
    assert "[20, 19, 18, 17, 16, 15, 14, 13]..." in str(info.value)
    with pytest.raises(PolicyFileError) as info:
        _policy({"batch_grid": tuple(range(9, 0, -1))})  # nine: one left out
    assert str(info.value).endswith("got [9, 8, 7, 6, 5, 4, 3, 2]...")
    with pytest.raises(PolicyFileError) as info:
        _policy({"batch_grid": (2, 1)})
    assert str(info.value).endswith("got [2, 1]")


@pytest.mark.parametrize(("changes", "message"), [
    (dict(name=""), "field 'name': must be a string of 1..256"),
    (dict(name="x" * (MAX_NAME_CHARS + 1)), "field 'name'"),
    (dict(name=7), "field 'name'"),
    (dict(provenance=[]), "field 'provenance'"),
    (dict(activation="gelu"), "field 'activation': unknown activation 'gelu'"),
    (dict(weights=[], biases=[]), "need one bias per weight matrix"),
    (dict(biases=[np.zeros(4, np.float32)]), "need one bias per weight matrix"),
    (dict(actions=[0, 1, 2]), "field 'actions': 3 actions but the last layer has 4 outputs"),
    (dict(actions=[0, 1, 2, 4]), r"field 'actions': steps must lie in 0\.\.3"),
    (dict(actions=[-1, 1, 2, 3]), r"field 'actions': steps must lie in 0\.\.3"),
    (dict(actions=[0, 1, 2, 3.0]), "field 'actions': expected a list of ints"),
])
def test_bad_fields_are_refused_naming_the_field(changes, message):
    with pytest.raises(PolicyFileError, match=message):
        _policy(**changes)


def test_bad_layers_are_refused_naming_the_layer():
    good = _policy()
    w0, w1 = good.weights
    b0, b1 = good.biases
    cases = [
        (dict(weights=[w0.astype(np.int32), w1]), "field 'w0'/'b0': dtypes int32/float32"),
        (dict(biases=[b0, b1.astype(np.int64)]), "field 'w1'/'b1': dtypes float32/int64"),
        (dict(weights=[w0[:-1], w1]), r"field 'w0': shape \(27, 4\) with bias \(4,\)"),
        (dict(weights=[w0, w1[:-1]]), r"field 'w1': shape \(3, 4\) .* width 4"),
        (dict(biases=[b0[:-1], b1]), r"field 'w0': shape \(28, 4\) with bias \(3,\)"),
        (dict(weights=[w0[None], w1]), "field 'w0'"),
        (dict(biases=[b0, b1[None]]), "field 'w1'"),
        (dict(weights=[w0, np.where(w1 > 0, np.nan, w1)]), "field 'w1'/'b1': non-finite"),
        (dict(biases=[b0 + np.inf, b1]), "field 'w0'/'b0': non-finite"),
    ]
    for changes, message in cases:
        with pytest.raises(PolicyFileError, match=message):
            _policy(**changes)


@pytest.mark.parametrize(("content", "message"), [
    (b"not a zip", "not a readable .npz policy file"),
    (None, "missing 'meta' entry"),
    (b"\xff\xfe", "field 'meta' is not JSON"),
    (b"{broken", "field 'meta' is not JSON"),
    (json.dumps({"format": "other"}).encode(), "field 'format' is 'other', not 'specctl-policy'"),
    (json.dumps({}).encode(), "field 'format' is None"),
])
def test_unreadable_files_are_refused_saying_why(tmp_path, content, message):
    path = tmp_path / "p.npz"
    if content == b"not a zip":
        path.write_bytes(content)
    elif content is None:
        np.savez(path, w0=np.zeros((2, 2)))
    else:
        np.savez(path, meta=np.frombuffer(content, dtype=np.uint8))
    with pytest.raises(PolicyFileError, match=message) as info:
        ExportedPolicy.load(path)
    assert str(info.value).startswith(str(path))


@pytest.mark.parametrize(("changes", "message"), [
    (dict(meta_changes={"feature_spec": [1]}), "field 'feature_spec' must be a JSON object"),
    (dict(meta_changes={"actions": {"a": 1}}), "field 'actions' must be a JSON array"),
    (dict(meta_changes={"format_version": 1}), "field 'format_version' is 1; this build"),
    (dict(meta_changes={"activation": "gelu"}), "unknown activation"),
    (dict(meta_changes={"actions": ["x"] * 8}), "invalid literal"),
    (dict(spec_changes={"nonsense": 1}), "unknown feature-spec fields"),
])
def test_meta_errors_name_the_file_and_field(tmp_path, changes, message):
    path = tmp_path / "bad.npz"
    _write(path, **changes)
    with pytest.raises(PolicyFileError, match=message) as info:
        ExportedPolicy.load(path)
    assert str(info.value).startswith(str(path))


def test_missing_optional_meta_fields_take_their_defaults(tmp_path):
    path = tmp_path / "p.npz"
    _write(path, meta_changes={"format": "specctl-policy"})
    with np.load(path) as archive:
        data = {key: archive[key] for key in archive.files}
    meta = json.loads(data["meta"].tobytes())
    for key in ("activation", "name", "provenance"):
        del meta[key]
    data["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **data)
    policy = ExportedPolicy.load(path)
    assert (policy.activation, policy.name, policy.provenance) == ("tanh", "ppo", {})
    assert len(policy.weights) == 3  # random(): two hidden layers


def test_logits_are_float32_whatever_the_input():
    policy = _policy()
    x = np.random.default_rng(0).normal(size=(2, policy.feature_spec.size))  # float64
    assert policy.logits(x).dtype == np.float32 and policy.logits(x[0]).dtype == np.float32
    assert policy.logits(x.tolist()).dtype == np.float32


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("bias_dtypes", [
    (np.float32,) * 3, (np.float64,) * 3,
    # One float64 bias after float32 layers: only that layer widens (adding it in place
    # would round it to float32), and every layer after it stays float64.
    (np.float32, np.float64, np.float32), (np.float32, np.float32, np.float64),
])
def test_logits_equal_the_textbook_forward_bit_for_bit(activation, bias_dtypes):
    """The forward adds biases and activates in place where that is exact; with float64
    biases (a policy built in memory) the product's dtype widens, as x @ w + b does."""
    policy = ExportedPolicy.random(hidden=(16, 8), seed=3)
    biases = [b.astype(dtype) + 0.1 for b, dtype in zip(policy.biases, bias_dtypes, strict=True)]
    policy = ExportedPolicy(policy.weights, biases, policy.actions, policy.feature_spec,
                            activation=activation)
    x = np.random.default_rng(1).normal(size=(300, policy.feature_spec.size))
    expected = x.astype(np.float32)
    act = np.tanh if activation == "tanh" else (lambda v: np.maximum(v, 0.0))
    for i, (w, b) in enumerate(zip(policy.weights, policy.biases, strict=True)):
        expected = expected @ w + b
        if i < len(policy.weights) - 1:
            expected = act(expected)
    logits = policy.logits(x)
    assert logits.dtype == expected.dtype and np.array_equal(logits, expected)


def test_logits_with_tiled_biases_equal_the_broadcast_forward_at_every_batch_size(
        monkeypatch):
    """The bias kept tiled over rows (grown as batches grow; beyond the cap broadcast),
    and its views kept per row count (those of a tiled array grown since, and the kept
    row counts emptied when full), give the broadcast addition's values bit for bit,
    batch after batch."""
    monkeypatch.setattr(policy_file, "_TILED_BIAS_ROWS", 200)
    monkeypatch.setattr(policy_file, "_ROW_BIAS_SHAPES", 3)
    policy = ExportedPolicy.random(hidden=(16, 8), seed=4)
    biases = [b + np.float32(0.25) * (i + 1) for i, b in enumerate(policy.biases)]
    policy = ExportedPolicy(policy.weights, biases, policy.actions, policy.feature_spec)
    rng = np.random.default_rng(2)
    for rows in (20, 1, 33, 120, 20, 200, 201, 450, 7):  # grows, reuses, beyond the cap
        x = rng.normal(size=(rows, policy.feature_spec.size)).astype(np.float32)
        expected = x
        for i, (w, b) in enumerate(zip(policy.weights, policy.biases, strict=True)):
            expected = expected @ w + b
            if i < len(policy.weights) - 1:
                expected = np.tanh(expected)
        assert np.array_equal(policy.logits(x), expected), rows
    assert all(t.shape[0] == 256 for t in policy._tiled)  # 201+ rows broadcast instead


def test_random_policies_are_seeded_and_scaled_by_fan_in():
    a = ExportedPolicy.random()
    assert a.name == "random" and a.provenance == {"random_seed": 0}
    assert all(np.array_equal(x, y) for x, y in zip(a.weights, ExportedPolicy.random(seed=0)
                                                    .weights, strict=True))
    assert not np.array_equal(a.weights[0], ExportedPolicy.random(seed=1).weights[0])
    for w in a.weights:  # N(0, 1/fan_in): the logits neither vanish nor saturate
        assert abs(w.mean()) < 3 / np.sqrt(w.size) / np.sqrt(w.shape[0])
        assert w.std() == pytest.approx(1 / np.sqrt(w.shape[0]), rel=0.1)
    assert all(not b.any() for b in a.biases)


def test_messages_read_in_full():
    cases = [
        (dict(provenance=None), "field 'provenance': must be a JSON object"),
        (dict(weights=[], biases=[]), "fields 'w*'/'b*': need one bias per weight matrix"),
        (dict(name="y" * 300), "field 'name': must be a string of 1..256 chars, got "
                               f"{'y' * 40!r}"),
    ]
    for changes, text in cases:
        with pytest.raises(PolicyFileError) as info:
            _policy(**changes)
        assert str(info.value) == text
    for spec_changes, text in [
        ({"accept_decay": 1.5}, "field 'feature_spec.accept_decay': 1.5 not in (0.0, 1.0]"),
        ({"accept_prior_first": 2.0},
         "field 'feature_spec.accept_prior_first': 2.0 not in [0.0, 1.0]"),
        ({"ema_alpha": float("nan")}, "field 'feature_spec.ema_alpha': nan is not finite"),
        ({"batch_grid": tuple(range(8, 0, -1))}, "field 'feature_spec.batch_grid': must be "
         f"strictly increasing ints in 1..{MAX_BATCH}, got [8, 7, 6, 5, 4, 3, 2, 1]"),
    ]:
        with pytest.raises(PolicyFileError) as info:
            _policy(spec_changes)
        assert str(info.value) == text
    assert _policy(name="n" * MAX_NAME_CHARS).name == "n" * MAX_NAME_CHARS


def test_a_three_dimensional_layer_is_refused_even_when_its_edges_fit():
    w0, w1 = _policy().weights
    with pytest.raises(PolicyFileError, match=r"field 'w0': shape \(28, 4, 1\)"):
        _policy(weights=[w0[:, :, None], w1])


@pytest.mark.parametrize(("meta", "text"), [
    ([1, 2], "field 'meta' must be a JSON object, got a list"),
    ({"format": "specctl-policy", "format_version": 1},
     f"field 'format_version' is 1; this build reads version {FORMAT_VERSION} only (older "
     "policies were trained on an older observation: retrain with specctl-train)"),
])
def test_file_level_messages_read_in_full(tmp_path, meta, text):
    path = tmp_path / "p.npz"
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    with pytest.raises(PolicyFileError) as info:
        ExportedPolicy.load(path)
    assert str(info.value) == f"{path}: {text}"


def test_pushed_bytes_are_validated_naming_where_they_came_from(tmp_path):
    path = tmp_path / "p.npz"
    _policy().save(path)
    assert ExportedPolicy.loads(path.read_bytes(), "hub push").name == "p"
    with pytest.raises(PolicyFileError) as info:
        ExportedPolicy.loads(b"junk", "hub push")
    assert str(info.value).startswith("hub push: not a readable .npz policy file")

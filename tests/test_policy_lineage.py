"""Each kept policy file is its parent with only the named fields changed: the same
weights, biases and actions, and the guard, probe and feature spec equal to the parent's
with those fields replaced. A file rewritten with anything else changed fails here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controller.policy_file import ExportedPolicy

R = "docs/results"
#: (file, parent, feature-spec changes, probe changes), oldest first.
LINEAGE = [
    # the twenty-third session's default: the off ceiling (served as `ceil`, runs 74-77)
    (f"{R}/gpu22/policy_65d4fb99.npz", f"{R}/gpu21/policy_5c3d9060.npz",
     {"latency_off_ceiling": 0.1}, {}),
    # feat23's candidate (the ceiling from batch 24), never shipped
    (f"{R}/feat23/policy_e3ae0086.npz", f"{R}/gpu22/policy_65d4fb99.npz",
     {"latency_off_ceiling_batch": 24.0}, {}),
    # the twenty-fourth session's default: the ceiling rises (`rising`, runs 81-83; `ppo`, 85-90)
    (f"{R}/offceil24/policy_3f47437c.npz", f"{R}/gpu22/policy_65d4fb99.npz",
     {"latency_off_ceiling_samples": 2.0}, {}),
    # the twenty-fifth session: without a profile, model 2 (`m2`, run 90) ...
    (f"{R}/gpu25/policy_fb63f66c.npz", f"{R}/offceil24/policy_3f47437c.npz",
     {"latency_model": 2}, {}),
    # ... and its default: model 2 with a level-only prior and the cost probe (runs 91-97)
    (f"{R}/costprobe25/policy_c66f698d.npz", f"{R}/offceil24/policy_3f47437c.npz",
     {"latency_model": 2, "token_prior_fraction": 0.0},
     {"cost_depth": 3, "cost_share": 0.2, "cost_doubt": 2.0}),
    # the twenty-sixth session's candidates (no profile only): the cost probe's doubt 1.5 ...
    (f"{R}/nopro26/policy_e3c2b6c6.npz", f"{R}/costprobe25/policy_c66f698d.npz", {},
     {"cost_doubt": 1.5}),
    # ... and with it half the off probe's share without a profile
    (f"{R}/nopro26/policy_baef2897.npz", f"{R}/costprobe25/policy_c66f698d.npz", {},
     {"cost_doubt": 1.5, "off_unprofiled": 0.5}),
    # baef2897 with the start rule after an unmeasured deep first step (start27; 4c5ff8da,
    # start_depth 0, failed its held-out rule on seeds 8-15)
    (f"{R}/start27/policy_3ff099d0.npz", f"{R}/nopro26/policy_baef2897.npz", {},
     {"start_off": 6, "start_depth": 3}),
    # the default since then: 3ff099d0 (held-out seeds 16-23, start27/heldout_rule_b.md)
    ("controller/data/default_policy.npz", f"{R}/nopro26/policy_baef2897.npz", {},
     {"start_off": 6, "start_depth": 3}),
]


@pytest.mark.parametrize("path, parent_path, spec_changes, probe_changes", LINEAGE,
                         ids=[row[0].rsplit("/", 1)[-1] for row in LINEAGE])
def test_the_file_is_its_parent_with_only_these_fields_changed(path, parent_path,
                                                                spec_changes, probe_changes):
    policy, parent = ExportedPolicy.load(path), ExportedPolicy.load(parent_path)
    assert policy.feature_spec == dataclasses.replace(parent.feature_spec, **spec_changes)
    assert policy.probe == dataclasses.replace(parent.probe, **probe_changes)
    assert (policy.guard, policy.actions) == (parent.guard, parent.actions)
    for mine, theirs in zip([*policy.weights, *policy.biases],
                            [*parent.weights, *parent.biases], strict=True):
        np.testing.assert_array_equal(mine, theirs)
    changed = {**spec_changes, **probe_changes}
    assert all(getattr(parent.feature_spec, k, getattr(parent.probe, k, None)) != v
               for k, v in changed.items())  # each named field does change

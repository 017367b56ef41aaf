"""Marker stripping: fast, no SGLang and no subprocess (the scheduler dies if one leaks)."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_hooks.compat import Ranks
from sglang_hooks.config import PluginConfig
from sglang_hooks.marker import DecisionMarker, RuleMarker, strip_markers
from sglang_hooks.runtime import Runtime


class Req:
    """Stands for one of SGLang's request objects."""

    def __init__(self, rid: int) -> None:
        self.rid = rid


def decision(seq: int) -> DecisionMarker:
    return DecisionMarker(seq, "controller", 10 + seq, (1, 8), (3, seq % 8))


items = st.one_of(st.integers(0, 50).map(Req), st.integers(1, 50).map(decision),
                  st.just(RuleMarker("table", ((1, 3),), 4, 2)))


@given(st.lists(items, max_size=12))
def test_strip_keeps_every_request_in_order_and_returns_the_newest_decision(received):
    kept, newest, rule = strip_markers(received)
    assert kept == [r for r in received if isinstance(r, Req)]
    decisions = [r for r in received if type(r) is DecisionMarker]
    assert newest == (max(decisions, key=lambda d: d.seq) if decisions else None)
    assert rule == next((r for r in reversed(received) if type(r) is RuleMarker), None)
    if newest is None and rule is None:
        assert kept is received  # the common case allocates nothing


def test_markers_survive_the_broadcast_pickle():
    sent = [Req(1), decision(3), RuleMarker("sglang")]
    kept, newest, rule = strip_markers(pickle.loads(pickle.dumps(sent)))
    assert [r.rid for r in kept] == [1] and newest == decision(3) and rule == RuleMarker("sglang")


class Scheduler:
    """Only what ``before_process_input_requests`` touches before it strips."""


@pytest.mark.parametrize("follower", [False, True])
@pytest.mark.parametrize("as_kwarg", [False, True])
def test_the_hook_strips_in_place_queues_the_newest_and_adopts_the_rule(follower, as_kwarg):
    rt = Runtime(PluginConfig(server="t"), "0.5.23", ranks=Ranks(1, 2, 0, 1, 0, False),
                 follower=follower)
    rt._attached = True  # no scheduler to read ranks from
    announced = RuleMarker("table", ((1, 3), (32, 1)), 4, 6)
    received = [Req(1), decision(2), announced, decision(5), Req(2), decision(4)]
    if as_kwarg:
        assert rt.before_process_input_requests(Scheduler(), recv_reqs=received) is None
    else:
        assert rt.before_process_input_requests(Scheduler(), received) is None
    assert [r.rid for r in received] == [1, 2]  # the list SGLang dispatches, in place
    assert rt._pending == decision(5) and rt.local == announced
    rt.before_process_input_requests(Scheduler(), [decision(3)])
    assert rt._pending == decision(5), "an older sequence number never replaces a newer one"


def test_a_tuple_request_list_gets_a_stripped_copy():
    rt = Runtime(PluginConfig(server="t"), "0.5.23", ranks=Ranks(1, 2, 0, 1, 0, False))
    rt._attached = True
    scheduler = Scheduler()
    args, kwargs = rt.before_process_input_requests(scheduler, (Req(1), decision(1)))
    assert args[0] is scheduler and [r.rid for r in args[1]] == [1] and kwargs == {}


@pytest.mark.parametrize(("batch_size", "expected"), [
    (0, 5), (1, 5), (7, 5),  # below and inside the first grid interval
    (8, 3), (31, 3),  # from a grid value up to the next
    (32, 1), (10_000, 1),  # the last value holds for every larger batch
])
def test_steps_for_looks_up_the_grid_interval_of_the_batch_size(batch_size, expected):
    marker = DecisionMarker(1, "controller", 5, (1, 8, 32), (5, 3, 1))
    assert marker.steps_for(batch_size) == expected

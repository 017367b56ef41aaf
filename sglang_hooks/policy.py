"""The adaptive policy SGLang asks for every decode step's speculation depth.

:func:`make_policy_class` subclasses SGLang's ``AdaptiveSpeculativeParams``
(same constructor, so ``EAGLEWorkerV2`` builds it unchanged in 0.5.15.post1
and 0.5.23). ``get_steps_for_batch`` returns, in order of precedence:

1. the applied controller decision (:attr:`Runtime.controller`), for this batch size;
2. otherwise the local rule (:attr:`Runtime.local`, the same on every rank):
   ``sglang`` (SGLang's own acceptance-EMA rule, see below), ``table`` (a static
   batch size -> steps table) or ``explore`` (record mode: cycle through every
   candidate depth, ``dwell`` steps each, in an order that is a fixed function of
   the step index).

SGLang's rule runs on the configured tiers, or on SGLang's default tiers
(``DEFAULT_ADAPTIVE_CONFIG``, clamped to the depths built) when the config file
offers one flat slot (the shipped one does: it would make SGLang's rule blind to
batch size). It is fed every verify result, also while the controller is in
charge, so that a fallback starts from live acceptance. A verify at a depth
other than the rule's own is fed as SGLang would have seen it: accepted drafts
capped at the rule's depth, and nothing from a step that did not speculate. On
the source rank with a controller client the feeding is deferred: a verify is
queued (one append on the scheduler thread) and the client's I/O thread feeds
the queue in order, under a lock; the rule is fed whatever is still queued
before it is asked and before SGLang sets its CUDA graph sizes, so it answers as
if it had been fed at every verify. Every other rank feeds at once.

The result is clamped to the candidate steps SGLang built runtime states for
for this batch size (asking for another one would raise in
``AdaptiveController._activate``; one outside the slot has no CUDA graph);
clamps are counted. On the source rank a decision's clamped steps are tabled per
batch size (:func:`decision_table`, SGLang's routing read once when it sets its
CUDA graph sizes) by the client's I/O thread when it makes the marker
(:meth:`specctl_prepare`), so the scheduler thread answers a decision with one
index; every other rank looks each batch size up once per decision.

Outside exploration, a depth is kept for at least ``min_switch_steps`` steps
(``SPECCTL_MIN_SWITCH_STEPS``): every switch costs SGLang a buffer rebuild (see
:mod:`sglang_hooks.switching`). ``on_verify_complete`` never asks for an immediate
switch (it returns None): every switch happens when the next batch is launched.
A decision marked ``unheld`` (the DECISION's ``flags``: the start rule,
``ProbeSpec.start_off``) is the exception: its steps run at once, and it holds no later
switch (as if switched ``min_switch_steps`` ago); ``Simulator.decode(unheld=True)`` does the
same.

A warm-up step (:attr:`Runtime.warm_now`: the batch holds a request of the start-up
warm-up, :mod:`sglang_hooks.warmup`) overrides all of the above: the depth is the next of
the batch size's candidate steps in :func:`warmup.cycle`'s order, by the count of warm-up
decode steps (the same on every rank), not held by ``min_switch_steps`` and holding
nothing (the first step after it decides at once); its verify does not feed SGLang's rule.

A follower that has not heard the source's rule yet (``Runtime.local is None``)
is SGLang's class unchanged (warm-up steps included).
"""

from __future__ import annotations

import bisect
import random
import threading
from collections import deque

from sglang_hooks.marker import CONTROLLER, DecisionMarker, RuleMarker
from sglang_hooks.runtime import Runtime
from sglang_hooks.warmup import cycle as warmup_cycle

_STEP_RANGE = 128  # steps a decision may name (int8 on the wire)
#: A decision's clamped steps are tabled for every batch size below the largest of this,
#: SGLang's CUDA graph sizes and its tiers, plus one (larger ones: looked up one by one).
_TABLE_MIN = 256
_TABLE_MAX = 8192  # (a server whose graph sizes go beyond looks the rest up one by one)
_PREPARED = 4  # tables built off the scheduler thread kept for markers not applied yet


def _nearest(candidates: list[int]) -> tuple[int, ...]:
    """For every requested step 0..127, the closest candidate (ties: the smaller)."""
    return tuple(min(candidates, key=lambda c: (abs(c - s), c)) for s in range(_STEP_RANGE))


def decision_table(grid: tuple[int, ...], steps: tuple[int, ...],
                   routes: tuple[tuple[int, tuple[int, ...]], ...], size: int) -> list:
    """Per batch size ``0 .. size - 1``: (steps clamped, steps asked, clamping table) of
    the decision ``(grid, steps)`` (:meth:`DecisionMarker.steps_for`), clamped by
    ``routes``: (first batch size, clamping table) of each run of batch sizes SGLang
    routes to one slot, the first starting at 0. Built per run of equal entries (the grid's
    and the routes' runs merged: a few list repetitions, not ``size`` lookups); never
    changed once built (the scheduler thread indexes it while another may build the next).
    """
    if list(grid) != sorted(set(grid)):
        return []  # not increasing (never from the wire): looked up one by one
    table: list[tuple[int, int, tuple[int, ...]]] = []
    last = len(grid) - 1
    count = len(routes)
    segment = route = start = 0  # steps[segment] holds from grid[segment] on (0: from 0)
    while start < size:
        grid_end = grid[segment + 1] if segment < last else size
        route_end = routes[route + 1][0] if route + 1 < count else size
        end = min(grid_end, route_end, size)
        want = steps[segment]
        nearest = routes[route][1]
        if end > start:
            table += [(nearest[want if want < _STEP_RANGE else _STEP_RANGE - 1], want,
                       nearest)] * (end - start)
            start = end
        if start >= grid_end:
            segment += 1
        if start >= route_end:
            route += 1
    return table


def default_tiers(base: type, initial_steps: int, built: list[int]):
    """SGLang's rule on its default tiers, each slot's candidates clamped to ``built``."""
    tiers = base(initial_steps, None)  # no config file: DEFAULT_ADAPTIVE_CONFIG
    nearest = _nearest(built)
    for slot in tiers._slots.values():
        slot.candidate_steps = sorted({nearest[min(c, _STEP_RANGE - 1)]
                                       for c in slot.candidate_steps})
        slot.current_steps = nearest[min(slot.current_steps, _STEP_RANGE - 1)]
    return tiers


def make_policy_class(base: type, runtime: Runtime) -> type:
    """A subclass of SGLang's ``AdaptiveSpeculativeParams`` bound to ``runtime``."""
    # SGLang's own rule, as the methods below call it: with SPECCTL_HOOK_TIMING its time
    # is SGLang's (it runs without the plugin too), taken out of the plugin's.
    clock = runtime.clock
    sglang_steps = base.get_steps_for_batch if clock is None else clock.outside(
        base.get_steps_for_batch)
    sglang_verify = base.on_verify_complete if clock is None else clock.outside(
        base.on_verify_complete)

    class SpecctlAdaptiveParams(base):
        """SGLang's adaptive params, with steps chosen by specctl (see module docstring)."""

        _specctl: Runtime = runtime

        def __init__(self, initial_steps: int, cfg_path: str | None = None) -> None:
            super().__init__(initial_steps, cfg_path)
            per_slot = {bs: tuple(slot.candidate_steps) for bs, slot in self._slots.items()}
            self._specctl_nearest = {id(slot): _nearest(list(per_slot[bs]))
                                     for bs, slot in self._slots.items()}
            # The shipped config offers the same steps at every batch size: skip routing.
            self._specctl_uniform = (
                _nearest(list(next(iter(per_slot.values()))))
                if len(set(per_slot.values())) == 1 else None
            )
            #: What SGLang's rule runs on: this object's tiers, or SGLang's defaults.
            self._specctl_rule = (self if len(self._slots) > 1 else
                                  default_tiers(base, initial_steps, self.candidate_steps))
            self._specctl_order: list[int] = []
            self._specctl_cycle = -1
            self._specctl_current = -1  # the depth returned last
            self._specctl_switched_at = 0  # launch step of the last switch
            self._specctl_table: tuple[RuleMarker | None, list[int], list[int]] = (None, [], [])
            #: Batch size -> the slot of SGLang's rule it routes to (fixed once SGLang has
            #: set its CUDA graph sizes; cleared when it sets them).
            self._specctl_rule_slots: dict[int, object] = {}
            #: How this object clamps, per run of batch sizes: (table size, ((first batch
            #: size, clamping table), ...)); replaced (one store) when SGLang sets its CUDA
            #: graph sizes, and read by the client's I/O thread (specctl_prepare).
            self._specctl_routes = self._specctl_routing()
            #: The decision in charge and what it answers per batch size: (decision, table
            #: of (steps clamped, steps asked, clamping table) per batch size below its
            #: size, its size, batch size -> the same for the larger ones).
            self._specctl_memo: tuple = (None, (), 0, {})
            #: Tables the client's I/O thread built for markers not applied yet:
            #: ((marker, routes they were built with, table), ...), newest first.
            self._specctl_prepared: tuple = ()
            #: Verifies not fed to SGLang's rule yet: (drafts, batch size, depth run), in
            #: order. Fed at once unless :attr:`Runtime.defer_rule_feed` (then by the
            #: client's I/O thread, :meth:`specctl_feed_rule`, and before the rule is asked).
            self._specctl_feeds: deque[tuple[list[int], int, int]] = deque()
            #: Held while feeding: the feeds go in order, whichever thread feeds them.
            self._specctl_feed_lock = threading.Lock()
            self._specctl.attach_policy(self)

        def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
            with self._specctl_feed_lock:  # what was verified before goes where it routed
                self._specctl_feed(sglang_verify)
                super().set_cuda_graph_bs(cuda_graph_bs)
                self._specctl_rule_slots = {}
                # The clamping follows the new routing (tables built before: not used).
                self._specctl_routes = self._specctl_routing()
                self._specctl_memo = (None, (), 0, {})
                if self._specctl_rule is not self:  # route as SGLang would: padded sizes
                    base.set_cuda_graph_bs(self._specctl_rule, cuda_graph_bs)

        def get_steps_for_batch(self, batch_size: int) -> int:
            rt = self._specctl
            local = rt.local
            if local is None:  # a follower before the source's announcement: SGLang itself
                steps = rt.last_steps = sglang_steps(self, batch_size)
                return steps
            if rt.warm_now:  # a start-up warm-up step: every candidate depth in turn
                steps = rt.last_steps = rt.offswitch.choose(self._specctl_warmup(batch_size))
                return steps
            try:
                decision = rt.controller
                exploring = False
                if decision is not None:
                    # The decision's steps for this batch size, as clamped below: one index
                    # into its table, which the client's I/O thread built when it made the
                    # marker (the source rank); otherwise looked up once per batch size.
                    memo = self._specctl_memo
                    if memo[0] is not decision:
                        table = self._specctl_table_of(decision)
                        memo = self._specctl_memo = (decision, table, len(table), {})
                    steps, want, nearest = (memo[1][batch_size] if 0 <= batch_size < memo[2]
                                            else self._specctl_lookup(decision, batch_size))
                elif local.rule == "table":
                    want = self._table_steps(local, batch_size)
                elif local.rule == "explore":
                    want = self._explore(rt.launch_step, local.explore_dwell)
                    exploring = True
                else:
                    if self._specctl_feeds:  # the rule as if fed at every verify
                        self.specctl_feed_rule(sglang_verify)
                    want = sglang_steps(self._specctl_rule, batch_size)
                if decision is None:
                    nearest = (self._specctl_uniform
                               or self._specctl_nearest[id(self._route(batch_size))])
                    steps = nearest[want if want < _STEP_RANGE else _STEP_RANGE - 1]
                if steps != want:
                    rt.counters["clamped"] += 1
                current = self._specctl_current
                if decision is not None and decision.unheld:
                    # The start rule's decision: runs at once, and holds no later switch
                    # (switched, as far as the hold knows, min_switch_steps ago).
                    if steps != current:
                        self._specctl_current = steps
                        rt.counters["switches"] += 1
                    self._specctl_switched_at = rt.launch_step - local.min_switch_steps
                elif steps != current:
                    step = rt.launch_step
                    if (not exploring and local.min_switch_steps > 1 and current >= 0
                            and nearest[current] == current
                            and 0 <= step - self._specctl_switched_at < local.min_switch_steps):
                        rt.counters["switches_held"] += 1
                        steps = current
                    else:
                        self._specctl_current = steps
                        self._specctl_switched_at = step
                        rt.counters["switches"] += 1
            except Exception as exc:
                rt.fault("policy", exc)
                if self._specctl_feeds and self._specctl_rule is self:
                    self.specctl_feed_rule(sglang_verify)
                steps = sglang_steps(self, batch_size)
            # The off switch may turn the first step back on into SGLang's steps=0 (a
            # warm-up for the draft); telemetry reports the steps that actually ran.
            steps = rt.offswitch.choose(steps)
            rt.last_steps = steps
            return steps

        def _specctl_warmup(self, batch_size: int) -> int:
            """A warm-up step's depth: the batch size's candidates in :func:`warmup.cycle`'s
            order, at the position of the warm-up decode step count (every rank's own)."""
            rt = self._specctl
            try:
                depths = warmup_cycle(self._route(batch_size).candidate_steps)
                steps = depths[(rt.warm_steps - 1) % len(depths)]
            except Exception as exc:
                rt.fault("policy", exc)
                return sglang_steps(self, batch_size)
            rt.counters["warmup_steps"] += 1
            self._specctl_current = -1  # no depth to hold: the next real step decides at once
            return steps

        def specctl_prepare(self, marker: object) -> None:
            """Build a new marker's table of steps per batch size (the client's I/O thread
            calls it before it publishes the marker), so that the scheduler thread only
            indexes it once the marker applies."""
            if getattr(marker, "mode", None) != CONTROLLER:
                return
            routes = self._specctl_routes
            table = decision_table(marker.batch_grid, marker.steps, routes[1], routes[0])
            # One store: the scheduler thread reads the tuple whole.
            self._specctl_prepared = ((marker, routes, table),
                                      *self._specctl_prepared[:_PREPARED - 1])

        def _specctl_table_of(self, decision: DecisionMarker) -> list:
            """The table of the decision just applied: the one the I/O thread prepared
            for it under the current routing; else none (other ranks, a marker that went
            past the prepared ones, a routing changed since): each batch size is then
            looked up when first asked (:meth:`_specctl_lookup`), which costs this
            thread less in one step than building the whole table would."""
            routes = self._specctl_routes
            for marker, built_with, table in self._specctl_prepared:
                # The same object on the source rank; a broadcast copy is equal.
                if (marker is decision or marker == decision) and built_with is routes:
                    return table
            return []

        def _specctl_lookup(self, decision: DecisionMarker, batch_size: int) -> tuple:
            """(steps clamped, steps asked, clamping table) of a batch size outside the
            decision's table, looked up once per decision and batch size."""
            known = self._specctl_memo[3].get(batch_size)
            if known is None:
                want = decision.steps_for(batch_size)
                nearest = (self._specctl_uniform
                           or self._specctl_nearest[id(self._route(batch_size))])
                known = self._specctl_memo[3][batch_size] = (
                    nearest[want if want < _STEP_RANGE else _STEP_RANGE - 1], want, nearest)
            return known

        def _specctl_routing(self) -> tuple[int, tuple[tuple[int, tuple[int, ...]], ...]]:
            """(table size, the clamping table of each run of batch sizes SGLang routes to
            one slot) for :func:`decision_table`: SGLang's own routing asked once per
            batch size (here, when SGLang sets its CUDA graph sizes: start-up). Never
            raises: a routing it cannot read tables nothing (every size looked up alone)."""
            try:
                graph = getattr(self, "_cuda_graph_bs", None) or ()
                size = min(_TABLE_MAX, max(_TABLE_MIN, *graph, *self._slots) + 1)
                if self._specctl_uniform is not None:
                    return size, ((0, self._specctl_uniform),)
                runs: list[tuple[int, tuple[int, ...]]] = []
                for batch_size in range(size):
                    nearest = self._specctl_nearest[id(self._route(batch_size))]
                    if not runs or runs[-1][1] is not nearest:
                        runs.append((batch_size, nearest))
                return size, tuple(runs)
            except Exception as exc:
                self._specctl.fault("policy", exc)
                return 0, ()

        def on_verify_complete(self, num_correct_drafts_per_req: list[int],
                               batch_size: int) -> int | None:
            rt = self._specctl
            local = rt.local
            if local is None:  # a follower before the source's announcement: SGLang itself
                rt.on_verify(num_correct_drafts_per_req)
                return sglang_verify(self, num_correct_drafts_per_req, batch_size)
            if local.rule == "sglang" and not rt.verify_warm:
                # Keep SGLang's rule live, whoever is in charge: feed it what it would have
                # seen at its own depth, in order (one append here; the feeding below, or
                # on the client's I/O thread while the rule is not asked: deferred).
                self._specctl_feeds.append((num_correct_drafts_per_req, batch_size,
                                            rt.verify_steps))
                if not rt.defer_rule_feed:  # only this thread feeds: no lock to take
                    self._specctl_feed(sglang_verify)
            rt.accepted = num_correct_drafts_per_req  # Runtime.on_verify, without the call
            return None

        def specctl_feed_rule(self, verify=base.on_verify_complete) -> None:
            """Feed SGLang's rule every verify queued so far, in order (any thread: the
            client's I/O thread calls it with SGLang's method itself, the scheduler
            thread with ``sglang_verify``, which hook timing takes out)."""
            if not self._specctl_feeds:  # nothing queued: no lock to take (most looks)
                return
            with self._specctl_feed_lock:
                self._specctl_feed(verify)

        def _specctl_feed(self, verify) -> None:
            # The caller holds the lock (or is the only feeder): the rule's state is each
            # feed's, in order, so a rule asked after them answers as if each had been fed
            # at its verify.
            feeds = self._specctl_feeds
            rt = self._specctl
            params = self._specctl_rule
            routes = self._specctl_rule_slots
            while feeds:
                drafts, batch_size, ran = feeds.popleft()
                try:
                    # SGLang's routing (padding to a CUDA graph size, then its tier) looked
                    # up once per batch size.
                    slot = routes.get(batch_size)
                    if slot is None:
                        slot = routes[batch_size] = base._route(params, batch_size)
                    own = slot.current_steps
                    # A step that did not speculate has no acceptance to learn from.
                    if ran != 0 or own <= 0:
                        # Chain drafting: accepted at depth d = min(accepted, d). The copy
                        # only when some request accepted more than the rule's depth.
                        if ran > own > 0 and drafts and max(drafts) > own:
                            drafts = [d if d <= own else own for d in drafts]
                        verify(params, drafts, batch_size)
                except Exception as exc:
                    rt.fault("policy", exc)

        def _table_steps(self, local: RuleMarker, batch_size: int) -> int:
            cached, sizes, steps = self._specctl_table
            if cached is not local:
                sizes = [size for size, _ in local.table]
                steps = [depth for _, depth in local.table]
                self._specctl_table = (local, sizes, steps)
            index = bisect.bisect_right(sizes, batch_size) - 1
            return steps[index if index > 0 else 0]

        def _explore(self, step: int, dwell: int) -> int:
            candidates = self.candidate_steps
            cycle, position = divmod(step // dwell, len(candidates))
            if cycle != self._specctl_cycle:
                # A fresh order each cycle, so every depth follows every other one.
                self._specctl_order = random.Random(cycle).sample(candidates, len(candidates))
                self._specctl_cycle = cycle
            return self._specctl_order[position]

    if runtime.clock is not None:  # SPECCTL_HOOK_TIMING: count these on the scheduler thread
        for name in ("get_steps_for_batch", "on_verify_complete"):
            setattr(SpecctlAdaptiveParams, name,
                    runtime.clock.plain(getattr(SpecctlAdaptiveParams, name), name))
    return SpecctlAdaptiveParams


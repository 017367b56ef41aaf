"""The decision marker: how a decision reaches every TP rank at the same step.

Only the source rank (pp 0, tp 0) talks to the controller. It appends a
:class:`DecisionMarker` to the request list it pulled from the tokenizer; SGLang
broadcasts that list to every TP rank (``broadcast_pyobj``), and each rank,
the source included, strips the markers out in ``process_input_requests`` and
applies them before the iteration's batch is launched. So all ranks switch on
the same scheduler step, and a decision that never rode the broadcast is never
applied anywhere.

The source also announces its local rule once (:class:`RuleMarker`), so that
ranks without the ``SPECCTL_*`` variables (other nodes of a multi-node TP group)
run the same fallback as the source. Any rank with the plugin installed strips
both kinds (:func:`strip_markers`): SGLang's request dispatcher raises on objects
it does not know, which would kill the scheduler.
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple

CONTROLLER = "controller"
FALLBACK = "fallback"


class DecisionMarker(NamedTuple):
    """What every rank should do from ``apply_from_step`` on (picklable, immutable).

    Attributes:
        seq: Increases with every marker the source attaches; older ones are ignored.
        mode: ``"controller"`` (use ``steps``) or ``"fallback"`` (run the local rule).
        apply_from_step: First scheduler step (``forward_ct``) it applies to.
        batch_grid: Increasing batch sizes; ``steps[i]`` holds for batch sizes from
            ``batch_grid[i]`` up to the next grid value.
        steps: Speculation steps per grid value (empty in fallback mode).
        policy: Name of the policy that decided (for logs).
        unheld: The switch to ``steps`` is not held by ``min_switch_steps``, nor does it
            hold a later switch (the DECISION's ``flags``: the start rule).
    """

    seq: int
    mode: str
    apply_from_step: int
    batch_grid: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    policy: str = ""
    unheld: bool = False

    def steps_for(self, batch_size: int) -> int:
        """Steps for a batch of ``batch_size`` (controller mode only)."""
        index = bisect.bisect_right(self.batch_grid, batch_size) - 1
        return self.steps[index if index > 0 else 0]

    @property
    def key(self) -> tuple:
        """What the marker decides, without its sequence number and timing."""
        return (self.mode, self.batch_grid, self.steps, self.unheld)


class RuleMarker(NamedTuple):
    """The source rank's local rule, announced once to every rank (picklable).

    Attributes:
        rule: ``"sglang"``, ``"table"`` or ``"explore"`` (see :mod:`sglang_hooks.policy`).
        table: Sorted (batch size, steps) pairs of the table rule.
        explore_dwell: Steps per depth when exploring.
        min_switch_steps: Fewest steps between two depth switches.
    """

    rule: str
    table: tuple[tuple[int, int], ...] = ()
    explore_dwell: int = 4
    min_switch_steps: int = 4


def strip_markers(recv_reqs: list) -> tuple[list, DecisionMarker | None, RuleMarker | None]:
    """Split a received request list: (requests without markers, newest decision, rule).

    The common case (no marker) costs one type check per item and returns the
    list itself.
    """
    decision: DecisionMarker | None = None
    rule: RuleMarker | None = None
    found = False
    for item in recv_reqs:
        kind = type(item)
        if kind is DecisionMarker:
            found = True
            if decision is None or item.seq > decision.seq:
                decision = item
        elif kind is RuleMarker:
            found = True
            rule = item
    if not found:
        return recv_reqs, None, None
    kept: list[Any] = [item for item in recv_reqs
                       if type(item) is not DecisionMarker and type(item) is not RuleMarker]
    return kept, decision, rule

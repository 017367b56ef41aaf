"""SGLang's switch path made cheap: the log filter and the overrides-log trimmer (no SGLang)."""

from __future__ import annotations

import logging

from sglang_hooks.switching import (
    RESTORE_SOURCE,
    SWITCH_LOGGER,
    OverridesLogTrimmer,
    SwitchLogFilter,
    quiet_switch_log,
)


class Context:
    """A ``RuntimeContext``'s overrides log, overlaid in order as ``/server_info`` does."""

    def __init__(self) -> None:
        self._overrides_log: list = [("startup", {"speculative_num_steps": 7, "x": 1})]

    def switch(self, steps: int) -> None:  # what EAGLEWorkerV2.apply_runtime_state appends
        self._overrides_log.append((RESTORE_SOURCE, {"speculative_num_steps": steps,
                                                     "speculative_num_draft_tokens": steps + 1}))

    def overlay(self) -> dict:
        merged: dict = {}
        for _, fields in self._overrides_log:
            merged.update(fields)
        return merged


def test_trimming_keeps_the_log_bounded_and_the_overlay_unchanged():
    trimmed, untrimmed = Context(), Context()
    trimmer = OverridesLogTrimmer(trimmed)
    for i in range(5000):
        for context in (trimmed, untrimmed):
            context.switch(i % 8)
        trimmer.trim()
        if i % 997 == 0:
            assert trimmed.overlay() == untrimmed.overlay()
    assert trimmed.overlay() == untrimmed.overlay()
    assert len(untrimmed._overrides_log) == 5001
    assert len(trimmed._overrides_log) == 2 and trimmer.trimmed == 4999


def test_other_sources_between_switches_are_kept():
    context = Context()
    trimmer = OverridesLogTrimmer(context)
    context.switch(3)
    context._overrides_log.append(("operator", {"speculative_num_steps": 9}))
    context.switch(5)
    trimmer.trim()
    assert [source for source, _ in context._overrides_log] == [
        "startup", RESTORE_SOURCE, "operator", RESTORE_SOURCE]
    context._overrides_log.append((RESTORE_SOURCE, {"speculative_num_steps": 2}))
    trimmer.trim()  # sets fewer fields than the entry before it: that one still matters
    assert len(context._overrides_log) == 5


def test_the_filter_drops_only_the_switch_line_and_counts_it(caplog):
    logger = logging.getLogger(SWITCH_LOGGER)
    installed = quiet_switch_log()
    try:
        assert quiet_switch_log() is installed  # once per process
        with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger=SWITCH_LOGGER):
            logger.info("Switch adaptive runtime state: steps 3 -> 5, draft_tokens 4 -> 6")
            logger.info("Built adaptive runtime state steps=5: elapsed=1.00s")
            logging.getLogger("other").info("Switch adaptive runtime state: not SGLang's")
        assert [r.getMessage() for r in caplog.records] == [
            "Built adaptive runtime state steps=5: elapsed=1.00s",
            "Switch adaptive runtime state: not SGLang's"]
        assert installed.dropped == 1
    finally:
        logger.removeFilter(installed)
    assert not any(isinstance(f, SwitchLogFilter) for f in logger.filters)

"""Keeping SGLang's depth-switch path cheap when the depth changes often.

SGLang built ``EAGLEWorkerV2.apply_runtime_state`` for rare switches. Each one

* logs ``Switch adaptive runtime state: ...`` at INFO on TP rank 0
  (:class:`SwitchLogFilter` drops exactly that message, counted; nothing else
  on that logger and no log level changes);
* in 0.5.23, appends ``("adaptive_spec.restore", {...})`` to
  ``RuntimeContext._overrides_log``, which is never trimmed and is walked by
  ``/server_info`` (:class:`OverridesLogTrimmer` keeps one entry per run of
  consecutive switches: the overlay ``/server_info`` computes is unchanged);
* rebuilds two small GPU buffers (``_rebuild_topk1_chain_buffers``): not
  touched here; the policy's dwell (``SPECCTL_MIN_SWITCH_STEPS``) bounds how
  often it happens.
"""

from __future__ import annotations

import logging
from typing import Any

#: The logger and message prefix of SGLang's per-switch INFO line (both versions).
SWITCH_LOGGER = "sglang.srt.speculative.eagle_worker_v2"
SWITCH_MESSAGE = "Switch adaptive runtime state"
#: The source SGLang 0.5.23 records each switch's server-args sync under.
RESTORE_SOURCE = "adaptive_spec.restore"


class SwitchLogFilter(logging.Filter):
    """Drops SGLang's per-switch INFO line and counts what it dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if type(msg) is str and msg.startswith(SWITCH_MESSAGE):
            self.dropped += 1
            return False
        return True


def quiet_switch_log() -> SwitchLogFilter:
    """Install (once per process) the filter on SGLang's EAGLE worker logger."""
    logger = logging.getLogger(SWITCH_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, SwitchLogFilter):
            return existing
    installed = SwitchLogFilter()
    logger.addFilter(installed)
    return installed


class OverridesLogTrimmer:
    """Keeps a ``RuntimeContext._overrides_log`` from growing by one entry per switch.

    ``/server_info`` overlays the entries in order (later wins), so of two
    adjacent ``adaptive_spec.restore`` entries where the later sets every field
    of the earlier, the earlier one changes nothing: it is removed.
    """

    def __init__(self, context: Any) -> None:
        self.context = context
        self.trimmed = 0

    @classmethod
    def for_this_process(cls) -> OverridesLogTrimmer | None:
        """A trimmer for SGLang's process context, or None where there is none (0.5.15)."""
        try:
            from sglang.srt.runtime_context import get_context
        except ImportError:
            return None
        context = get_context()
        return cls(context) if isinstance(getattr(context, "_overrides_log", None), list) else None

    def trim(self) -> None:
        """Drop redundant switch entries at the end of the log (O(1) when none)."""
        log = self.context._overrides_log
        while (len(log) >= 2 and log[-1][0] == RESTORE_SOURCE and log[-2][0] == RESTORE_SOURCE
               and log[-1][1].keys() >= log[-2][1].keys()):
            del log[-2]
            self.trimmed += 1

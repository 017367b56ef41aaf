"""The policy being served, reloaded when its file changes (or on request, e.g. SIGHUP).

A file that fails to load or validate leaves the previous policy serving; the
error is logged (once per version of the broken file) and counted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from controller.policy_file import ExportedPolicy, PolicyFileError

log = logging.getLogger(__name__)


def _signature(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _read(path: Path) -> tuple[ExportedPolicy, bytes, str]:
    """The policy in ``path``, and the bytes it was read from (read once: what is served
    and what is pushed are the same file version)."""
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise PolicyFileError(f"{path}: not a readable .npz policy file ({exc})") from exc
    return ExportedPolicy.loads(blob, str(path)), blob, hashlib.sha256(blob).hexdigest()


class PolicyHolder:
    """Holds the served policy; :meth:`poll` reloads it when the file changes.

    Args:
        path: The policy file (loaded now; a bad file raises PolicyFileError).
        poll_s: How often :meth:`poll` looks at the file.
        on_reload: Called with ``(old, new)`` after a successful reload.
    """

    def __init__(self, path: str | os.PathLike, poll_s: float = 1.0,
                 on_reload: Callable[[ExportedPolicy, ExportedPolicy], None] | None = None
                 ) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self.on_reload = on_reload
        self.reloads = 0
        self.errors = 0
        self._signature = _signature(self.path)
        #: The served policy, its file's bytes and their SHA-256 (hex): what the hub
        #: pushes to plugins in local decision mode.
        self.policy, self.blob, self.digest = _read(self.path)
        self._failed_signature: tuple | None = None
        self._next_check = time.monotonic() + poll_s
        self._requested = False

    def request_reload(self) -> None:
        """Reload at the next :meth:`poll`, changed or not (safe from a signal handler)."""
        self._requested = True

    def poll(self, now: float | None = None) -> bool | None:
        """Reload if due and changed: True (reloaded), False (failed), None (nothing to do)."""
        now = time.monotonic() if now is None else now
        forced = self._requested
        if not forced and now < self._next_check:
            return None
        self._requested = False
        self._next_check = now + self.poll_s
        signature = _signature(self.path)
        if not forced and (signature == self._signature or signature == self._failed_signature
                           or signature is None):
            return None
        try:
            new, blob, digest = _read(self.path)
        except Exception as exc:  # PolicyFileError, or anything a damaged file provokes
            self.errors += 1
            self._failed_signature = signature
            log.error("policy reload failed, still serving %r: %s", self.policy.name, exc)
            return False
        old, self.policy, self.blob, self.digest = self.policy, new, blob, digest
        self._signature, self._failed_signature = signature, None
        self.reloads += 1
        log.info("policy reloaded from %s: %r (was %r)", self.path, new.name, old.name)
        if self.on_reload is not None:
            self.on_reload(old, new)
        return True

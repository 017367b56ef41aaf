"""The daemon's streams, owned by the connection that created them, with bounded churn.

A stream is keyed by ``(peer, server, rank)``: ``peer`` is the ZeroMQ ROUTER
routing id of the connection (plus the client's CURVE public key where CURVE is
configured). The server name and rank inside a message therefore only name a
stream *within* its sender's connection: no client can feed, reset or restrict
another client's stream, whatever names it claims.

Churn is bounded three ways, each O(1) per message:

* the table is an LRU (``OrderedDict``, most recently active last): when it is
  full the least recently active stream goes, and streams that send telemetry
  at any useful rate are never the least recent;
* each peer holds at most ``max_per_peer`` streams (a plugin's connection uses
  one): beyond that the peer's own least recent stream goes, so a connection
  inventing names churns only itself;
* each peer may open ``new_per_s`` streams per second (token bucket, burst
  ``max_per_peer``); a frame that would open one beyond that is refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

#: The connection a frame came from: ROUTER routing id, and CURVE key ("" without).
Peer = tuple[bytes, str]
StreamKey = tuple[Peer, str, int]
S = TypeVar("S")


@dataclass(frozen=True)
class StreamLimits:
    """How many streams, and how fast new ones may appear (``configs/serve.yaml``)."""

    max_streams: int = 4096
    max_per_peer: int = 4
    new_per_s: float = 20.0


class _PeerState:
    """A connection's streams (LRU order) and its new-stream token bucket."""

    __slots__ = ("keys", "stamp", "tokens")

    def __init__(self, tokens: float, now: float) -> None:
        self.keys: OrderedDict[StreamKey, None] = OrderedDict()
        self.tokens = tokens
        self.stamp = now


class StreamTable(Generic[S]):
    """Streams by key, in LRU order; ``factory(key)`` builds a new one.

    Returns from :meth:`get_or_open` tell the caller what happened, and
    :attr:`evicted` / :attr:`refused` count evictions and refusals.
    """

    def __init__(self, limits: StreamLimits, factory: Callable[[StreamKey], S]) -> None:
        self.limits = limits
        self._factory = factory
        self._streams: OrderedDict[StreamKey, S] = OrderedDict()
        self._peers: dict[Peer, _PeerState] = {}
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[S]:
        return iter(self._streams.values())

    def get(self, key: StreamKey) -> S | None:
        """The stream, marked as just active; None if there is none."""
        stream = self._streams.get(key)
        if stream is not None:
            self._streams.move_to_end(key)
            keys = self._peers[key[0]].keys
            if len(keys) > 1:  # a peer's only stream (a plugin's connection) is its latest
                keys.move_to_end(key)
        return stream

    def get_or_open(self, key: StreamKey, now: float) -> S | None:
        """The stream (marked active), a new one, or None: the peer opens streams too fast."""
        stream = self.get(key)
        if stream is not None:
            return stream
        limits = self.limits
        peer = self._peers.get(key[0])
        if peer is None:
            peer = self._peers[key[0]] = _PeerState(float(limits.max_per_peer), now)
        else:
            peer.tokens = min(float(limits.max_per_peer),
                              peer.tokens + (now - peer.stamp) * limits.new_per_s)
            peer.stamp = now
        if peer.tokens < 1.0:
            self.refused += 1
            return None
        peer.tokens -= 1.0
        if len(peer.keys) >= limits.max_per_peer:
            self._remove(next(iter(peer.keys)))
        if len(self._streams) >= limits.max_streams:
            self._remove(next(iter(self._streams)))
        stream = self._streams[key] = self._factory(key)
        peer.keys[key] = None
        return stream

    def drop_idle(self, is_idle: Callable[[S], bool]) -> int:
        """Remove streams from the least recently active on while ``is_idle``; returns how many."""
        dropped = 0
        while self._streams:
            key, stream = next(iter(self._streams.items()))
            if not is_idle(stream):
                break
            self._remove(key, evicted=False)
            dropped += 1
        return dropped

    def _remove(self, key: StreamKey, evicted: bool = True) -> None:
        del self._streams[key]
        peer = self._peers[key[0]]
        del peer.keys[key]
        if not peer.keys:
            del self._peers[key[0]]
        self.evicted += evicted


def _load_libc_function(function: str):
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_libc_function("malloc_trim")
_mallopt = _load_libc_function("mallopt")
#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Let the allocator reuse freed memory instead of returning it to the OS at once
    (glibc ``mallopt``); False where unavailable. For the daemon's process only.

    Each poll allocates and frees arrays of 0.1-0.4 MB (the grids, the MLP's layers).
    By default glibc maps arrays that size afresh, or gives the heap's top back when they
    are freed, and the kernel pages them in again next poll: measured in the daemon's
    decide() at 64 streams per poll, 30-38 us per decision by default, 17-28 us with
    these settings. :func:`trim_heap` still gives memory back after stream bursts.
    """
    if _mallopt is None:
        return False
    return all(_mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 64 << 20), (_M_TOP_PAD, 16 << 20)))


def trim_heap() -> bool:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``); False where unavailable.

    Dropped streams' memory is freed to the allocator, which keeps it: after a burst of
    streams the daemon's RSS would stay at its peak.
    """
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True

"""The specctl wire protocol: msgpack messages over ZeroMQ, one message per frame.

An SGLang server (the plugin's DEALER socket) sends ``HELLO`` and ``TELEMETRY``
messages to the controller (a ROUTER socket); the controller answers with
``DECISION`` messages. Every message is a msgpack array whose first two items
are the protocol version and the message kind; the remaining items are
positional, in the order listed below. Telemetry fields carry the names of
:class:`env.traces.schema.StepRecord`.

``HELLO`` (server -> controller), sent on start-up and every second:

    [WIRE_VERSION, 1, server: str, rank: int, schema_version: int,
     candidate_steps: list[int], client: str, pid: int(, policy_digest: str)]

``policy_digest`` (present only in local decision mode) is the SHA-256 (hex) of the policy
the plugin decides with: it asks the hub for the policy it serves when they differ.

``TELEMETRY`` (server -> controller), one per scheduler step:

    [WIRE_VERSION, 2, server: str, rank: int, step_index: int, time_s: float,
     batch_size: int, waiting_requests: int, running_requests: int,
     kv_used_tokens: int, kv_capacity_tokens: int, prefill_tokens: int,
     steps_used: int, accepted_drafts: bin (int8 per request),
     accepted_drafts_sum: int, accepted_drafts_count: int, step_latency_s: float
     (, warmup: bool | nil (, before_prefill: bool | nil))]

Two optional flags follow, each a msgpack bool, or nil for unknown (an absent item is
unknown too). ``warmup`` (known where the plugin's off path is in use) says whether
this depth-0 decode step was the plugin's re-entry warm-up (``StepRecord.warmup``): true
only on a decode step with ``steps_used`` 0. ``before_prefill`` (known to the plugin since
the twenty-second session) says whether the batch launched right after this step was a
prefill, whose launch this step's latency then carries (``StepRecord.before_prefill``).
A frame of 17 items (an older plugin) decodes with both None. A daemon older than a field
refuses a TELEMETRY with more items (``malformed``): upgrade the daemon with the plugin.

``DECISION`` (controller -> server), the answer to the latest telemetry:

    [WIRE_VERSION, 3, seq: int, apply_from_step: int, policy: str, mode: int,
     batch_grid: list[int], steps: list[int](, flags: int)]

``flags`` (optional; absent means 0, and a decision without flags is sent as 8 items, as
before it) is a bit set: bit 0 (:data:`DECISION_UNHELD`) says the plugin must neither hold
the switch to this decision's steps by its ``min_switch_steps`` nor hold a later switch by
this one (the start rule, ``ProbeSpec.start_off``: the off steps it forces, and every
decision before a stream's first speculative cost sample). Other bits must be 0. Only a
policy with ``start_off`` set sends it; a plugin older than the field refuses such a frame
(``malformed``): upgrade the plugin with the daemon before serving one.

``POLICY`` (controller -> server), the policy ``specctl-serve`` serves, pushed to each
connection whose HELLO carries another ``policy_digest``, and to all those again when it
reloads (a plugin in local decision mode installs it; see :mod:`sglang_hooks.local`):

    [WIRE_VERSION, 4, name: str, digest: str (SHA-256 of the file, hex), policy: bin
     (the exported .npz file, at most MAX_POLICY_BYTES)]

``mode`` 1 means "use ``steps[i]`` for a batch of size b, where ``batch_grid[i]``
is the largest grid value <= b"; mode 0 means "use your fallback rule" (the
lists are then empty). ``apply_from_step`` is the first scheduler step the
decision is meant for: the answered telemetry's ``step_index`` + ``DECISION_LAG``
(overlap scheduling launches step N+1 before step N's result is known).

:func:`decode` rejects anything else with a :class:`WireError` whose ``kind``
(``oversized``, ``garbage``, ``version``, ``kind``, ``malformed``, ``range``)
callers count; it never raises anything else, whatever the frame (a nested array
1,000 levels deep included). ``range`` is a well-typed value no real server can
send (a negative or absurd latency, a batch of 10**10 requests, more accepted
drafts than draft steps): such values would only drive the feature estimators
into overflow, so they are refused here, and ``WireError.field`` names the field.

Decoding TELEMETRY, the one message every step sends, has a fast path: msgspec
(a dependency; without it only the general path runs) parses a frame that starts
like a TELEMETRY into a typed struct whose types and ranges it checks in C
(1-2 us instead of 4-5). A frame it does not accept, or that fails a check between
fields, goes through the general path, which decides and names the error: both
paths accept exactly the same frames with exactly the same result
(``tests/test_wire.py`` checks that).
"""

from __future__ import annotations

import itertools
import reprlib
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Annotated

import msgpack
import numpy as np

try:
    import msgspec
except ImportError:  # the general msgpack path only (slower, same results)
    msgspec = None

from env.traces.schema import SCHEMA_VERSION, StepRecord

#: Version of this protocol; a message with another version is rejected.
WIRE_VERSION = 1
#: Largest frame :func:`decode` accepts (a batch of 16k requests fits).
MAX_FRAME_BYTES = 64 * 1024
#: ``ZMQ_MAXMSGSIZE`` of every specctl socket: a peer sending more is disconnected
#: by ZeroMQ before the frame reaches Python (frames between MAX_FRAME_BYTES and
#: this are delivered and counted as ``oversized``).
TRANSPORT_MAX_MSG_BYTES = 1 << 20
#: apply_from_step = step_index of the telemetry a decision answers + DECISION_LAG.
DECISION_LAG = 2
#: A DECISION's ``flags`` bit: neither held by the plugin's switch hold nor holding after.
DECISION_UNHELD = 1
MAX_NAME_CHARS = 256
MAX_GRID = 256
#: Largest exported policy a POLICY message carries (below TRANSPORT_MAX_MSG_BYTES, which
#: would disconnect the receiver); only :func:`decode` with ``accept_policy`` takes one.
MAX_POLICY_BYTES = 768 * 1024
#: The largest valid POLICY frame: the policy, a name of MAX_NAME_CHARS characters of up to
#: 4 UTF-8 bytes each, the 64-digit digest, and msgpack's headers (array, version and kind
#: 3 bytes; the name's str16 3; the digest's str8 2; the policy's bin32 5).
_MAX_POLICY_FRAME_BYTES = MAX_POLICY_BYTES + 4 * MAX_NAME_CHARS + 64 + 13
_MAX_INT = (1 << 63) - 1

# Physical ranges of telemetry (kind "range" outside them). Generous: an order of
# magnitude or more beyond any server, yet small enough that the feature module's
# regressions (squares of batch and KV terms) stay well inside float64.
MAX_RANK = 1 << 16
MAX_BATCH = 1 << 20
MAX_REQUESTS = 1 << 32
MAX_KV_TOKENS = 1 << 36
MAX_PREFILL_TOKENS = 1 << 32
MAX_TIME_S = 1e10
#: A measured step latency lies in this range; 0 means "not measured".
MIN_STEP_LATENCY_S = 1e-6
MAX_STEP_LATENCY_S = 3600.0

ERROR_KINDS = ("oversized", "garbage", "version", "kind", "malformed", "range")


class Kind(IntEnum):
    """Message kinds (the second item of every message)."""

    HELLO = 1
    TELEMETRY = 2
    DECISION = 3
    POLICY = 4


class WireError(ValueError):
    """A frame that is not a valid message; ``kind`` is one of :data:`ERROR_KINDS`,
    ``field`` the offending field's name ("" when the frame as a whole is bad)."""

    def __init__(self, kind: str, detail: str, field: str = "") -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.field = field


@dataclass(frozen=True, slots=True)
class Hello:
    """A server introducing itself: who it is and which steps it can run."""

    server: str
    rank: int
    candidate_steps: tuple[int, ...]
    client: str = ""
    pid: int = 0
    schema_version: int = SCHEMA_VERSION
    #: Local decision mode: the SHA-256 (hex) of the policy deciding; "" otherwise.
    policy_digest: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    """Speculation steps per batch-size grid value, or "use your fallback"."""

    seq: int
    apply_from_step: int
    policy: str
    batch_grid: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    #: Neither held by the plugin's switch hold nor holding a later switch (``flags``
    #: bit 0 on the wire; the start rule).
    unheld: bool = False

    @property
    def is_fallback(self) -> bool:
        """True when the server should run its own fallback rule."""
        return not self.steps

    @classmethod
    def fallback(cls, seq: int, apply_from_step: int, policy: str) -> Decision:
        """A "use your fallback" decision."""
        return cls(seq, apply_from_step, policy)


def _decision_maker():
    """:class:`Decision`'s constructor without the frozen dataclass's five
    ``object.__setattr__`` calls: the same object in half the time (0.55 vs 1.1 us
    here; the daemon makes one per answer). Frozen stays frozen to everyone else."""
    new = object.__new__
    set_seq, set_apply, set_policy, set_grid, set_steps, set_unheld = (
        Decision.__dict__[name].__set__
        for name in ("seq", "apply_from_step", "policy", "batch_grid", "steps", "unheld"))

    def new_decision(seq: int, apply_from_step: int, policy: str,
                     batch_grid: tuple[int, ...] = (), steps: tuple[int, ...] = (),
                     unheld: bool = False) -> Decision:
        decision = new(Decision)
        set_seq(decision, seq)
        set_apply(decision, apply_from_step)
        set_policy(decision, policy)
        set_grid(decision, batch_grid)
        set_steps(decision, steps)
        set_unheld(decision, unheld)
        return decision

    return new_decision


#: ``Decision(seq, apply_from_step, policy, batch_grid, steps, unheld)``, faster (see above).
new_decision = _decision_maker()


@dataclass(frozen=True, slots=True)
class PolicyPush:
    """An exported policy file sent by the hub (``specctl-serve``) to its servers."""

    name: str
    digest: str
    blob: bytes = field(repr=False)


# -- encoding ------------------------------------------------------------------

_pack = msgpack.Packer(use_bin_type=True).pack
_DECISION = int(Kind.DECISION)
#: A DECISION's items (a tuple) -> bytes: msgspec's encoder writes msgpack's bytes in a
#: fifth of the time (0.27 vs 1.3 us here); msgpack where msgspec is missing.
_encode_decision = msgspec.msgpack.Encoder().encode if msgspec is not None else _pack


def encode_hello(hello: Hello) -> bytes:
    """One HELLO frame (the ninth item only in local decision mode: a plugin deciding
    remotely stays understood by a daemon that knows eight)."""
    items = [WIRE_VERSION, Kind.HELLO, hello.server, hello.rank, hello.schema_version,
             list(hello.candidate_steps), hello.client, hello.pid]
    if hello.policy_digest:
        items.append(hello.policy_digest)
    return _pack(items)


def pack_telemetry(
    server: str, rank: int, step_index: int, time_s: float, batch_size: int,
    waiting_requests: int, running_requests: int, kv_used_tokens: int,
    kv_capacity_tokens: int, prefill_tokens: int, steps_used: int,
    accepted_drafts: bytes, accepted_drafts_sum: int, step_latency_s: float,
    warmup: bool | None = None, before_prefill: bool | None = None,
) -> bytes:
    """One TELEMETRY frame from plain values (the hooks' hot path: no StepRecord).
    Unknown flags at the end are left out (a frame without flags is 17 items, as before
    them); an unknown ``warmup`` before a known ``before_prefill`` is nil."""
    items = [
        WIRE_VERSION, 2, server, rank, step_index, time_s, batch_size, waiting_requests,
        running_requests, kv_used_tokens, kv_capacity_tokens, prefill_tokens, steps_used,
        accepted_drafts, accepted_drafts_sum, len(accepted_drafts), step_latency_s,
    ]
    if before_prefill is not None:
        items += (None if warmup is None else bool(warmup), bool(before_prefill))
    elif warmup is not None:
        items.append(bool(warmup))
    return _pack(items)


def telemetry_bytes(accepted: object, steps_used: int, batch_size: int) -> tuple[bytes, int]:
    """A step's per-request accepted drafts (SGLang's list of ints) as TELEMETRY carries
    them: int8 bytes, at most ``batch_size`` entries, empty for a step that did not
    speculate; and their sum. Entries outside 0..255 are clipped to 0..127 (the frame is
    then valid); 128..255 or more than ``steps_used`` pass and :func:`decode` refuses them.
    """
    if steps_used <= 0 or not accepted:
        return b"", 0
    try:
        blob = bytes(accepted)
    except ValueError:  # outside 0..255
        blob = bytes(min(max(int(a), 0), 127) for a in accepted)
    if len(blob) > batch_size:
        blob = blob[:batch_size]
    return blob, sum(blob)


def encode_step(record: StepRecord) -> bytes:
    """One TELEMETRY frame from a step record (``request_ids`` and ``prefill_pairs`` are
    not sent; the flags where known)."""
    accepted = np.asarray(record.accepted_drafts, dtype=np.int8)
    return pack_telemetry(
        record.server, int(record.rank), int(record.step_index), float(record.time_s),
        int(record.batch_size), int(record.waiting_requests), int(record.running_requests),
        int(record.kv_used_tokens), int(record.kv_capacity_tokens), int(record.prefill_tokens),
        int(record.steps_used), accepted.tobytes(), int(accepted.sum(dtype=np.int64)),
        float(record.step_latency_s), record.warmup, record.before_prefill,
    )


def encode_decision(decision: Decision) -> bytes:
    """One DECISION frame (``flags`` only when set: 8 items otherwise, as before it)."""
    if decision.unheld:
        return _encode_decision((
            WIRE_VERSION, _DECISION, decision.seq, decision.apply_from_step, decision.policy,
            1 if decision.steps else 0, decision.batch_grid, decision.steps, DECISION_UNHELD,
        ))
    return _encode_decision((
        WIRE_VERSION, _DECISION, decision.seq, decision.apply_from_step, decision.policy,
        1 if decision.steps else 0, decision.batch_grid, decision.steps,
    ))


def encode_policy(push: PolicyPush) -> bytes:
    """One POLICY frame."""
    return _pack([WIRE_VERSION, Kind.POLICY, push.name, push.digest, push.blob])


# -- decoding ------------------------------------------------------------------

_ARITY = {Kind.HELLO: 8, Kind.TELEMETRY: 17, Kind.DECISION: 8, Kind.POLICY: 5}
#: Items a message may carry after its required ones (HELLO: the policy digest;
#: TELEMETRY: the warm-up and before-prefill flags; DECISION: its flags).
_OPTIONAL_ITEMS = {Kind.HELLO: 1, Kind.TELEMETRY: 2, Kind.DECISION: 1}
#: A POLICY's first bytes: msgpack fixarray of 5, WIRE_VERSION, Kind.POLICY.
_POLICY_HEADER = bytes([0x95, WIRE_VERSION, Kind.POLICY])


def decode(frame: bytes, accept_policy: bool = False) -> Hello | StepRecord | Decision | PolicyPush:
    """Parse and validate one frame; raises :class:`WireError` (only) if it is bad.

    A TELEMETRY frame becomes a :class:`StepRecord` whose ``accepted_drafts`` is
    a read-only int8 view of the frame. Frames longer than MAX_FRAME_BYTES are refused
    unread, except, with ``accept_policy`` (the plugin's side), a POLICY of up to
    MAX_POLICY_BYTES.
    """
    if _decode_fast is not None and frame[:5] in TELEMETRY_HEADERS:
        record = _decode_fast(frame)
        if record is not None:
            return record
    return decode_general(frame, accept_policy)


#: A DECISION frame's first bytes: an array of 8 items, the wire version, the kind.
_DECISION_HEADER = bytes([0x98, WIRE_VERSION, _DECISION])
#: msgpack's unsigned int encodings (type byte -> bytes that follow).
_UINT_SIZES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def _uint_at(frame: bytes, at: int) -> tuple[int, int] | None:
    """The unsigned int encoded at ``frame[at]`` and the offset after it, or None
    (another encoding, or the frame ends)."""
    if at >= len(frame):
        return None
    kind = frame[at]
    if kind < 0x80:  # positive fixint
        return kind, at + 1
    size = _UINT_SIZES.get(kind)
    if size is None or at + 1 + size > len(frame):
        return None
    return int.from_bytes(frame[at + 1:at + 1 + size], "big"), at + 1 + size


class DecisionDecoder:
    """:func:`decode` for one connection's frames, cheaper on DECISION frames whose
    policy, mode, grid and steps are the same bytes as the last decoded one's (the
    daemon's answers to a server mostly are: only ``seq`` and ``apply_from_step``
    change). For those only the two leading ints are read; everything after them was
    validated when those bytes were first decoded, and no check relates them to the
    ints. Any other frame goes to :func:`decode`. So the result (or the error) is
    decode's for every frame; what it saves is the general path's Python checks (17-23
    us per decision on the plugin's I/O thread, with the GIL held, on a loaded machine).
    """

    def __init__(self, accept_policy: bool = False) -> None:
        self.accept_policy = accept_policy
        self._tail: bytes | None = None
        self._rest: tuple[str, tuple[int, ...], tuple[int, ...]] = ("", (), ())

    def __call__(self, frame: bytes) -> Hello | StepRecord | Decision | PolicyPush:
        tail_at = -1
        if frame[:3] == _DECISION_HEADER and len(frame) <= MAX_FRAME_BYTES:
            seq = _uint_at(frame, 3)
            apply_from = _uint_at(frame, seq[1]) if seq is not None else None
            if apply_from is not None and seq[0] <= _MAX_INT and apply_from[0] <= _MAX_INT:
                tail_at = apply_from[1]
                if self._tail is not None and frame[tail_at:] == self._tail:
                    return new_decision(seq[0], apply_from[0], *self._rest)
        message = decode(frame, self.accept_policy)
        if tail_at >= 0 and type(message) is Decision:
            self._tail = frame[tail_at:]
            self._rest = (message.policy, message.batch_grid, message.steps)
        return message


def decode_general(frame: bytes, accept_policy: bool = False
                   ) -> Hello | StepRecord | Decision | PolicyPush:
    """:func:`decode` without the TELEMETRY fast path (the reference it must agree with)."""
    limit = MAX_FRAME_BYTES
    if accept_policy and frame[:3] == _POLICY_HEADER:
        limit = _MAX_POLICY_FRAME_BYTES
    if len(frame) > limit:
        raise WireError("oversized", f"frame of {len(frame)} bytes > {limit}")
    try:
        msg = msgpack.unpackb(
            frame, raw=False, use_list=True, strict_map_key=True,
            max_str_len=MAX_FRAME_BYTES, max_bin_len=limit,
            max_array_len=MAX_FRAME_BYTES, max_map_len=0, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types on garbage
        raise WireError("garbage", f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    if not isinstance(msg, list) or len(msg) < 2:
        raise WireError("garbage", f"expected an array [version, kind, ...], got {_describe(msg)}")
    version, kind = msg[0], msg[1]
    if type(version) is not int or version != WIRE_VERSION:
        raise WireError(
            "version", f"wire version {_describe(version)}; this build speaks {WIRE_VERSION}"
        )
    if type(kind) is not int or kind not in _ARITY:
        raise WireError("kind", f"unknown message kind {_describe(kind)}")
    kind = Kind(kind)
    least, extra = _ARITY[kind], _OPTIONAL_ITEMS.get(kind, 0)
    if not least <= len(msg) <= least + extra:
        raise WireError("malformed", f"{kind.name} has {len(msg)} items, expected {least}"
                        + (f" to {least + extra}" if extra else ""))
    if kind is Kind.TELEMETRY:
        return _decode_telemetry(msg)
    if kind is Kind.DECISION:
        return _decode_decision(msg)
    if kind is Kind.POLICY:
        return _decode_policy(msg)
    return _decode_hello(msg)


def _decode_policy(m: list) -> PolicyPush:
    name = _name(m[2], "name")
    digest = _digest(m[3], "digest")
    blob = m[4]
    if type(blob) is not bytes or not 0 < len(blob) <= MAX_POLICY_BYTES:
        raise WireError("malformed", f"field 'policy' must be bin of 1..{MAX_POLICY_BYTES} "
                        f"bytes, got {_describe(blob)}", "policy")
    return PolicyPush(name, digest, blob)


def _decode_telemetry(m: list) -> StepRecord:
    server = _name(m[2], "server")
    rank = _int(m[3], "rank", hi=MAX_RANK)
    step_index = _int(m[4], "step_index")
    time_s = _float(m[5], "time_s", hi=MAX_TIME_S)
    batch_size = _int(m[6], "batch_size", hi=MAX_BATCH)
    waiting = _int(m[7], "waiting_requests", hi=MAX_REQUESTS)
    running = _int(m[8], "running_requests", hi=MAX_REQUESTS)
    kv_used = _int(m[9], "kv_used_tokens", hi=MAX_KV_TOKENS)
    kv_capacity = _int(m[10], "kv_capacity_tokens", hi=MAX_KV_TOKENS)
    prefill = _int(m[11], "prefill_tokens", hi=MAX_PREFILL_TOKENS)
    steps_used = _int(m[12], "steps_used", hi=127)
    accepted = m[13]
    if type(accepted) is not bytes:
        raise WireError(
            "malformed", f"field 'accepted_drafts' must be bin, got {_describe(accepted)}",
            "accepted_drafts",
        )
    total = _int(m[14], "accepted_drafts_sum")
    count = _int(m[15], "accepted_drafts_count")
    latency = _float(m[16], "step_latency_s", hi=MAX_STEP_LATENCY_S)
    warmup = _flag(m, 17, "warmup")
    before_prefill = _flag(m, 18, "before_prefill")
    if 0.0 < latency < MIN_STEP_LATENCY_S:
        raise _range("step_latency_s", f"{latency!r} s is below {MIN_STEP_LATENCY_S} s "
                     "(0 means not measured)")
    if kv_capacity and kv_used > kv_capacity:
        raise _range("kv_used_tokens", f"{kv_used} > kv_capacity_tokens {kv_capacity}")
    if count != len(accepted) or count > batch_size:
        raise WireError(
            "malformed",
            f"field 'accepted_drafts_count' is {count} for {len(accepted)} entries "
            f"and batch_size {batch_size}", "accepted_drafts_count",
        )
    if accepted and max(accepted) > 127:
        raise _range("accepted_drafts", "negative entries")
    if accepted and max(accepted) > steps_used:
        raise _range("accepted_drafts", f"an entry of {max(accepted)} > steps_used {steps_used}")
    if total != sum(accepted):
        raise WireError(
            "malformed", f"field 'accepted_drafts_sum' is {total}, entries sum to {sum(accepted)}",
            "accepted_drafts_sum",
        )
    if warmup and (steps_used or prefill):
        raise _range("warmup", f"a warm-up is a decode step at steps_used 0, got steps_used "
                     f"{steps_used} and prefill_tokens {prefill}")
    return StepRecord(
        server=server, rank=rank, step_index=step_index, time_s=time_s, batch_size=batch_size,
        waiting_requests=waiting, running_requests=running, kv_used_tokens=kv_used,
        kv_capacity_tokens=kv_capacity, prefill_tokens=prefill, steps_used=steps_used,
        accepted_drafts=np.frombuffer(accepted, dtype=np.int8), step_latency_s=latency,
        warmup=warmup, before_prefill=before_prefill,
    )


def _flag(m: list, index: int, name: str) -> bool | None:
    """An optional flag: a bool, or None where nil or absent (unknown)."""
    value = m[index] if len(m) > index else None
    if value is not None and type(value) is not bool:
        raise WireError("malformed", f"field {name!r} must be true, false or nil, got "
                        f"{_describe(value)}", name)
    return value


#: _UP_TO[s]: the byte values 0..s (deleting them leaves the entries above s).
_UP_TO = [bytes(range(s + 1)) for s in range(128)]
#: A TELEMETRY frame's first bytes: msgpack array16 of 17, WIRE_VERSION, Kind.TELEMETRY.
_TELEMETRY_HEADER = bytes([0xDC, 0x00, 17, WIRE_VERSION, 2])
#: The same with one flag (``warmup``) and with both (``before_prefill`` too).
_TELEMETRY_HEADER_18 = bytes([0xDC, 0x00, 18, WIRE_VERSION, 2])
_TELEMETRY_HEADER_19 = bytes([0xDC, 0x00, 19, WIRE_VERSION, 2])
#: The first bytes of every TELEMETRY frame: with both flags, with one, without.
TELEMETRY_HEADERS = (_TELEMETRY_HEADER_19, _TELEMETRY_HEADER_18, _TELEMETRY_HEADER)


if msgspec is not None:
    # Module level: with postponed annotations msgspec resolves these names here.
    _Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]
    _Count = Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT)]
    _Batch = Annotated[int, msgspec.Meta(ge=0, le=MAX_BATCH)]
    _Requests = Annotated[int, msgspec.Meta(ge=0, le=MAX_REQUESTS)]
    _KvTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_KV_TOKENS)]
    _Prefill = Annotated[int, msgspec.Meta(ge=0, le=MAX_PREFILL_TOKENS)]
    _Steps = Annotated[int, msgspec.Meta(ge=0, le=127)]
    _Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    _Time = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIME_S)]
    _Latency = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_STEP_LATENCY_S)]
    _Drafts = Annotated[bytes, msgspec.Meta(max_length=MAX_FRAME_BYTES)]

    class _Telemetry(msgspec.Struct, array_like=True):
        """TELEMETRY, field by field as :func:`_decode_telemetry` (same types and ranges)."""

        version: int
        kind: int
        server: _Name
        rank: _Rank
        step_index: _Count
        time_s: _Time
        batch_size: _Batch
        waiting_requests: _Requests
        running_requests: _Requests
        kv_used_tokens: _KvTokens
        kv_capacity_tokens: _KvTokens
        prefill_tokens: _Prefill
        steps_used: _Steps
        accepted_drafts: _Drafts
        accepted_drafts_sum: _Count
        accepted_drafts_count: _Count
        step_latency_s: _Latency
        #: Absent or nil: None (unknown); otherwise a bool (as the general path).
        warmup: bool | None = None
        before_prefill: bool | None = None


def _make_fast_decoder():
    """msgspec's typed TELEMETRY decoder; None without msgspec."""
    if msgspec is None:
        return None
    parse = msgspec.msgpack.Decoder(_Telemetry).decode
    frombuffer, int8 = np.frombuffer, np.int8

    def fast(frame: bytes) -> StepRecord | None:
        """The record, or None: let the general path decide (and name the error)."""
        if len(frame) > MAX_FRAME_BYTES:
            return None
        try:
            m = parse(frame)
        except msgspec.DecodeError:  # ValidationError included
            return None
        accepted = m.accepted_drafts
        latency = m.step_latency_s
        steps = m.steps_used
        if (0.0 < latency < MIN_STEP_LATENCY_S
                or (m.kv_capacity_tokens and m.kv_used_tokens > m.kv_capacity_tokens)
                or m.accepted_drafts_count != len(accepted) or len(accepted) > m.batch_size
                or accepted.translate(None, _UP_TO[steps])  # an entry above steps_used
                or (m.warmup and (steps or m.prefill_tokens))):
            return None
        # Every entry is in 0..steps: a short batch summed directly (0.3 us for 32), a
        # long one from a few C-level counts (not 1 per entry: 3 us for 1,024, not 6).
        total = (sum(accepted) if len(accepted) <= 192 or steps >= 16
                 else sum(v * accepted.count(v) for v in range(1, steps + 1)))
        if m.accepted_drafts_sum != total:
            return None
        return StepRecord(  # positional: StepRecord's field order
            m.server, m.rank, m.step_index, m.time_s, m.batch_size, m.waiting_requests,
            m.running_requests, m.kv_used_tokens, m.kv_capacity_tokens, m.prefill_tokens,
            steps, frombuffer(accepted, int8), latency, None, None, m.warmup,
            m.before_prefill,
        )

    return fast


_decode_fast = _make_fast_decoder()
#: :func:`decode`'s own TELEMETRY path, for a frame that starts with one of
#: :data:`TELEMETRY_HEADERS`: its record, or None (then :func:`decode` decides, and names
#: the error); None where msgspec is missing. The daemon's per-frame loop calls it.
decode_telemetry_fast = _decode_fast
#: The first bytes of a TELEMETRY frame without ``warmup`` (a 17-item array, WIRE_VERSION,
#: TELEMETRY); :data:`TELEMETRY_HEADERS` has both.
TELEMETRY_HEADER = _TELEMETRY_HEADER


def _decode_decision(m: list) -> Decision:
    seq = _int(m[2], "seq")
    apply_from = _int(m[3], "apply_from_step")
    policy = _name(m[4], "policy", allow_empty=True)
    mode = m[5]
    if type(mode) is not int or mode not in (0, 1):
        raise WireError("malformed", f"field 'mode' must be 0 or 1, got {_describe(mode)}",
                        "mode")
    grid = _int_list(m[6], "batch_grid", lo=1, hi=_MAX_INT)
    steps = _int_list(m[7], "steps", lo=0, hi=127)
    if len(grid) != len(steps):
        raise WireError(
            "malformed", f"fields 'batch_grid'/'steps' have {len(grid)} and {len(steps)} entries"
        )
    if mode == 1 and not steps:
        raise WireError("malformed", "mode 1 (controller) needs at least one grid entry")
    if mode == 0 and steps:
        raise WireError("malformed", "mode 0 (fallback) must not carry steps")
    if any(b <= a for a, b in itertools.pairwise(grid)):
        raise WireError("malformed", "field 'batch_grid' must strictly increase")
    flags = m[8] if len(m) > 8 else 0
    if type(flags) is not int or flags & ~DECISION_UNHELD or (flags and mode == 0):
        raise WireError("malformed", f"field 'flags' must be 0 or {DECISION_UNHELD} (mode 1 "
                        f"only), got {_describe(flags)}", "flags")
    return Decision(seq, apply_from, policy, tuple(grid), tuple(steps), bool(flags))


def _decode_hello(m: list) -> Hello:
    server = _name(m[2], "server")
    rank = _int(m[3], "rank", hi=MAX_RANK)
    schema_version = _int(m[4], "schema_version")
    if schema_version != SCHEMA_VERSION:
        raise WireError("version", f"schema version {schema_version}; this build speaks "
                        f"{SCHEMA_VERSION}", "schema_version")
    candidates = _int_list(m[5], "candidate_steps", lo=0, hi=127)
    client = _name(m[6], "client", allow_empty=True)
    pid = _int(m[7], "pid")
    digest = _digest(m[8], "policy_digest") if len(m) == 9 else ""
    return Hello(server, rank, tuple(candidates), client, pid, schema_version, digest)


def _digest(value: object, name: str) -> str:
    if type(value) is not str or len(value) != 64 or value.strip("0123456789abcdef"):
        raise WireError("malformed", f"field {name!r} must be 64 lowercase hex digits, got "
                        f"{_describe(value)}", name)
    return value


# Bounded depth and width: a deeply nested value must not recurse (RecursionError).
_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxlist, _repr.maxstring, _repr.maxother, _repr.maxlong = 2, 4, 40, 40, 40


def _describe(value: object) -> str:
    return f"{type(value).__name__} {_repr.repr(value)}"


def _range(name: str, detail: str) -> WireError:
    return WireError("range", f"field {name!r}: {detail}", name)


def _int(value: object, name: str, hi: int = _MAX_INT) -> int:
    if type(value) is not int:
        raise WireError("malformed", f"field {name!r} must be an int, got {_describe(value)}",
                        name)
    if not 0 <= value <= hi:
        raise _range(name, f"{_describe(value)} not in [0, {hi}]")
    return value


def _float(value: object, name: str, hi: float) -> float:
    if type(value) not in (float, int):
        raise WireError("malformed", f"field {name!r} must be a number, got {_describe(value)}",
                        name)
    if not 0 <= value <= hi:  # False for NaN too
        raise _range(name, f"{_describe(value)} not in [0, {hi}]")
    return float(value)


def _name(value: object, name: str, allow_empty: bool = False) -> str:
    if type(value) is not str or len(value) > MAX_NAME_CHARS or not (value or allow_empty):
        raise WireError(
            "malformed", f"field {name!r} must be a string of 1..{MAX_NAME_CHARS} chars, "
            f"got {_describe(value)}", name,
        )
    return value


def _int_list(value: object, name: str, lo: int, hi: int) -> list[int]:
    if type(value) is not list or len(value) > MAX_GRID:
        raise WireError("malformed", f"field {name!r} must be a list of <= {MAX_GRID} ints",
                        name)
    for v in value:
        if type(v) is not int or not lo <= v <= hi:
            raise WireError(
                "malformed", f"field {name!r}: entry {_describe(v)} not an int in [{lo}, {hi}]",
                name,
            )
    return value


def apply_socket_limits(sock: object) -> None:
    """Set the options every specctl socket shares: size cap, no linger, IPv6 allowed."""
    import zmq  # local: keeps this module importable for pure encode/decode use

    sock.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_MAX_MSG_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    # Without it ZeroMQ cannot bind or connect tcp://[::1]:PORT (IPv4 still works).
    sock.setsockopt(zmq.IPV6, 1)

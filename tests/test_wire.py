"""The wire protocol: round trips, and every kind of bad frame rejected with its kind."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import wire
from controller.wire import (
    ERROR_KINDS,
    MAX_BATCH,
    MAX_FRAME_BYTES,
    MAX_KV_TOKENS,
    MAX_POLICY_BYTES,
    MAX_STEP_LATENCY_S,
    MAX_TIME_S,
    MIN_STEP_LATENCY_S,
    TRANSPORT_MAX_MSG_BYTES,
    WIRE_VERSION,
    Decision,
    Hello,
    Kind,
    PolicyPush,
    WireError,
    apply_socket_limits,
    decode,
    decode_general,
    encode_decision,
    encode_hello,
    encode_policy,
    encode_step,
    new_decision,
    pack_telemetry,
)
from env.traces.schema import SCHEMA_VERSION, STEP_FIELDS, StepRecord

ints = st.integers(0, 2**32)
times = st.floats(0, 1e7, allow_nan=False, allow_infinity=False)
latencies = st.just(0.0) | st.floats(MIN_STEP_LATENCY_S, MAX_STEP_LATENCY_S)


@st.composite
def step_records(draw) -> StepRecord:
    batch = draw(st.integers(0, 300))
    # The warm-up flag: unknown, known, or a warm-up (a decode step at steps 0).
    warmup = draw(st.sampled_from([None, False, True]))
    before_prefill = draw(st.sampled_from([None, False, True]))
    steps = 0 if warmup else draw(st.integers(0, 7))
    accepted = draw(st.lists(st.integers(0, steps), max_size=batch)) if steps else []
    capacity = draw(st.integers(0, MAX_KV_TOKENS))
    return StepRecord(
        server=draw(st.text(min_size=1, max_size=40)), rank=draw(st.integers(0, 1024)),
        step_index=draw(st.integers(0, 2**62)), time_s=draw(times), batch_size=batch,
        waiting_requests=draw(ints), running_requests=draw(ints),
        kv_used_tokens=draw(st.integers(0, capacity or MAX_KV_TOKENS)),
        kv_capacity_tokens=capacity, prefill_tokens=0 if warmup else draw(ints),
        steps_used=steps, accepted_drafts=np.array(accepted, dtype=np.int8),
        step_latency_s=draw(latencies), warmup=warmup, before_prefill=before_prefill,
    )


@given(step_records())
def test_telemetry_round_trip(record):
    back = decode(encode_step(record))
    for name in STEP_FIELDS:
        if name == "accepted_drafts":
            assert np.array_equal(back.accepted_drafts, record.accepted_drafts)
            assert back.accepted_drafts.dtype == np.int8
        elif name != "request_ids":
            assert getattr(back, name) == getattr(record, name), name
    assert back.accepted_drafts_sum == record.accepted_drafts_sum


def test_hot_path_packing_matches_the_record_encoder():
    record = StepRecord("s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 3,
                        np.array([0, 3, 1, 2], np.int8), 0.012)
    frame = pack_telemetry("s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 3,
                           bytes([0, 3, 1, 2]), 6, 0.012)
    assert frame == encode_step(record)
    for warmup in (False, True):
        record = StepRecord("s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 0,
                            np.zeros(0, np.int8), 0.012, warmup=warmup)
        frame = pack_telemetry("s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 0, b"", 0, 0.012,
                               warmup)
        assert frame == encode_step(record)


def test_an_unknown_warmup_flag_sends_the_old_17_item_frame_and_a_known_one_an_18th():
    """A record without the flag (None) is sent as before the field, byte for byte (an
    older daemon still reads it); a known flag is an 18th item, a msgpack bool."""
    old = msgpack.packb([WIRE_VERSION, 2, "s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 0, b"", 0,
                         0, 0.012], use_bin_type=True)
    assert pack_telemetry("s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 0, b"", 0, 0.012) == old
    for warmup in (False, True):
        frame = pack_telemetry("s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 0, b"", 0, 0.012,
                               warmup)
        assert frame == old[:2] + bytes([18]) + old[3:] + (b"\xc3" if warmup else b"\xc2")
        for decoder in (decode, decode_general):
            assert decoder(frame).warmup is warmup
    for decoder in (decode, decode_general):  # an older plugin's frame: unknown
        assert decoder(old).warmup is None


@pytest.mark.parametrize("warmup", [None, False, True])
def test_a_known_before_prefill_flag_is_a_19th_item_after_the_warmup_flag_or_nil(warmup):
    """``before_prefill`` follows ``warmup``: an unknown warm-up flag is then sent as nil
    (and read back as unknown), a known one as before."""
    base = msgpack.packb([WIRE_VERSION, 2, "s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 0, b"",
                          0, 0, 0.012], use_bin_type=True)
    tail = {None: b"\xc0", False: b"\xc2", True: b"\xc3"}
    for flag in (False, True):
        frame = pack_telemetry("s", 3, 17, 1.5, 4, 2, 6, 1000, 9000, 0, 0, b"", 0, 0.012,
                               warmup, flag)
        assert frame == base[:2] + bytes([19]) + base[3:] + tail[warmup] + tail[flag]
        for decoder in (decode, decode_general):
            record = decoder(frame)
            assert record.warmup is warmup and record.before_prefill is flag
    for decoder in (decode, decode_general):  # 17 items: unknown
        assert decoder(base).before_prefill is None


@given(st.builds(
    Decision, seq=ints, apply_from_step=ints, policy=st.text(max_size=20),
    batch_grid=st.just((1, 8, 64)), steps=st.tuples(*[st.integers(0, 7)] * 3),
))
def test_decision_round_trip(decision):
    assert decode(encode_decision(decision)) == decision


@given(seq=ints, apply_from=ints, policy=st.text(max_size=20),
       grid=st.lists(st.integers(1, 2**40), max_size=5).map(tuple),
       steps=st.lists(st.integers(0, 127), max_size=5).map(tuple))
def test_the_fast_decision_constructor_makes_the_same_frozen_decision(seq, apply_from, policy,
                                                                        grid, steps):
    made = new_decision(seq, apply_from, policy, grid, steps)
    assert type(made) is Decision
    assert made == Decision(seq, apply_from, policy, grid, steps)
    assert new_decision(seq, apply_from, policy) == Decision.fallback(seq, apply_from, policy)
    with pytest.raises(AttributeError):  # still frozen
        made.seq = seq + 1


def test_a_fresh_decision_maker_makes_the_same_decisions():
    """``new_decision`` is made at import; mutation testing reaches only what a test runs,
    so a fresh one is made here (one decision per field order and the defaults)."""
    make = wire._decision_maker()
    for fields in [(7, 9, "ppo", (1, 8, 64), (3, 2, 0)), (0, 2, "", (5,), (127,))]:
        made = make(*fields)
        assert type(made) is Decision and made == Decision(*fields)
    assert make(4, 10, "p") == Decision.fallback(4, 10, "p")
    with pytest.raises(AttributeError):  # still frozen
        made.steps = ()


@given(st.builds(
    Decision, seq=ints, apply_from_step=ints, policy=st.text(max_size=40),
    batch_grid=st.lists(st.integers(1, 2**40), max_size=30).map(tuple),
    steps=st.lists(st.integers(0, 127), max_size=30).map(tuple),
))
def test_decision_bytes_are_msgpacks_own(decision):
    """The msgspec encoder writes what msgpack writes for the same items, byte for byte
    (a plugin decoding with either library reads the same message)."""
    items = [wire.WIRE_VERSION, int(wire.Kind.DECISION), decision.seq,
             decision.apply_from_step, decision.policy, 0 if decision.is_fallback else 1,
             list(decision.batch_grid), list(decision.steps)]
    assert encode_decision(decision) == msgpack.packb(items, use_bin_type=True)


def test_fallback_decision_and_hello_round_trip():
    fallback = Decision.fallback(4, 10, "ppo")
    assert fallback.is_fallback and decode(encode_decision(fallback)) == fallback
    hello = Hello("server-a", 2, (0, 1, 3, 7), "specctl-plugin", 1234)
    assert decode(encode_hello(hello)) == hello


def _kind(frame: bytes) -> str:
    with pytest.raises(WireError) as info:
        decode(frame)
    assert info.value.kind in ERROR_KINDS
    return info.value.kind


def _telemetry(**changes) -> list:
    fields = dict(server="s", rank=0, step=1, time=0.5, batch=2, waiting=0, running=2, kv=10,
                  cap=100, prefill=0, steps=3, accepted=bytes([1, 2]), total=3, count=2,
                  latency=0.01)
    fields.update(changes)
    return [WIRE_VERSION, int(Kind.TELEMETRY), *fields.values()]


@pytest.mark.parametrize(("frame", "kind"), [
    (b"", "garbage"),
    (b"\xc1", "garbage"),
    (b"\x92\x01", "garbage"),  # truncated array
    (msgpack.packb({"version": 1}), "garbage"),  # maps are not messages
    (msgpack.packb("hello"), "garbage"),
    (msgpack.packb([1]), "garbage"),
    (msgpack.packb([2, 2]), "version"),
    (msgpack.packb([True, 2]), "version"),
    (msgpack.packb([WIRE_VERSION, 9]), "kind"),
    (msgpack.packb([WIRE_VERSION, 2, "s"]), "malformed"),
    (msgpack.packb(_telemetry(rank=-1)), "range"),
    (msgpack.packb(_telemetry(rank=True)), "malformed"),
    (msgpack.packb(_telemetry(server="")), "malformed"),
    (msgpack.packb(_telemetry(server="x" * 300)), "malformed"),
    (msgpack.packb(_telemetry(time=float("nan"))), "range"),
    (msgpack.packb(_telemetry(latency="fast")), "malformed"),
    (msgpack.packb(_telemetry(accepted=[1, 2]), use_bin_type=True), "malformed"),
    (msgpack.packb(_telemetry(total=4), use_bin_type=True), "malformed"),
    (msgpack.packb(_telemetry(count=1), use_bin_type=True), "malformed"),
    (msgpack.packb(_telemetry(batch=1), use_bin_type=True), "malformed"),
    (msgpack.packb(_telemetry(accepted=bytes([255, 4]), total=259), use_bin_type=True),
     "range"),  # int8 -1
    (msgpack.packb([WIRE_VERSION, 3, 1, 2, "p", 1, [], []]), "malformed"),
    (msgpack.packb([WIRE_VERSION, 3, 1, 2, "p", 0, [1], [3]]), "malformed"),
    (msgpack.packb([WIRE_VERSION, 3, 1, 2, "p", 1, [8, 1], [3, 2]]), "malformed"),
    (msgpack.packb([WIRE_VERSION, 3, 1, 2, "p", 1, [1], [300]]), "malformed"),
    (msgpack.packb([WIRE_VERSION, 3, 1, 2, "p", 2, [1], [3]]), "malformed"),
    (b"\x00" * (MAX_FRAME_BYTES + 1), "oversized"),
])
def test_bad_frames_are_rejected_with_their_kind(frame, kind):
    assert _kind(frame) == kind


# Values of the right type that no server can send: each names its field.
@pytest.mark.parametrize(("changes", "field"), [
    (dict(time=-1.0), "time_s"),
    (dict(time=float("inf")), "time_s"),
    (dict(latency=-0.01), "step_latency_s"),
    (dict(latency=1e308), "step_latency_s"),  # issue 10 #3: poisoned the stream for good
    (dict(latency=5e-324), "step_latency_s"),  # (and its reciprocal overflowed)
    (dict(latency=MAX_STEP_LATENCY_S * 2), "step_latency_s"),
    (dict(latency=float("nan")), "step_latency_s"),
    (dict(batch=10**10), "batch_size"),  # issue 10 #2: made the latency model singular
    (dict(batch=MAX_BATCH + 1), "batch_size"),
    (dict(waiting=-3), "waiting_requests"),
    (dict(running=2**40), "running_requests"),
    (dict(kv=2**40, cap=2**40), "kv_used_tokens"),
    (dict(kv=101, cap=100), "kv_used_tokens"),
    (dict(prefill=2**40), "prefill_tokens"),
    (dict(steps=1), "accepted_drafts"),  # 2 accepted drafts from 1 draft step
    (dict(rank=2**20), "rank"),
])
def test_out_of_range_values_are_rejected_naming_the_field(changes, field):
    with pytest.raises(WireError) as info:
        decode(msgpack.packb(_telemetry(**changes), use_bin_type=True))
    assert info.value.kind == "range" and info.value.field == field
    assert field in str(info.value)


def test_pack_telemetry_with_an_absurd_batch_is_rejected_at_decode():
    """The exact frame of issue 10 #2."""
    frame = pack_telemetry("s", 0, 1, 0.5, 10**10, 0, 1, 10, 100, 0, 0, b"", 0, 0.01)
    with pytest.raises(WireError, match="batch_size"):
        decode(frame)


def test_zero_latency_means_not_measured_and_passes():
    assert decode(msgpack.packb(_telemetry(latency=0), use_bin_type=True)).step_latency_s == 0.0


def test_hello_of_another_schema_version_is_rejected():
    frame = msgpack.packb([WIRE_VERSION, 1, "s", 0, 99, [0, 1], "c", 1])
    with pytest.raises(WireError) as info:
        decode(frame)
    assert info.value.kind == "version" and info.value.field == "schema_version"


@pytest.mark.parametrize("frame", [
    b"\x91" * 1010 + b"\xc0",  # issue 10 #1: RecursionError describing it
    b"\x92" + b"\x91" * 1010 + b"\xc0\x02",  # ...as the version
    b"\x92\x01" + b"\x91" * 1010 + b"\xc0",  # ...as the kind
    # ...as a HELLO's server name, 7 valid items around it
    b"\x98\x01\x01" + b"\x91" * 1010 + b"\xc0"
    + b"".join(msgpack.packb(v) for v in (0, 1, [0], "c", 1)),
])
def test_deeply_nested_frames_are_rejected_not_recursed_into(frame):
    with pytest.raises(WireError) as info:
        decode(frame)
    assert info.value.kind in ERROR_KINDS
    assert len(str(info.value)) < 200


def test_every_socket_gets_the_transport_size_cap():
    import zmq

    context = zmq.Context()
    try:
        for kind in (zmq.ROUTER, zmq.DEALER):
            sock = context.socket(kind)
            apply_socket_limits(sock)
            assert sock.getsockopt(zmq.MAXMSGSIZE) == TRANSPORT_MAX_MSG_BYTES == 1 << 20
            assert sock.getsockopt(zmq.LINGER) == 0 and sock.getsockopt(zmq.IPV6) == 1
            sock.close()
    finally:
        context.destroy(linger=0)  # term() would wait forever on a socket a failure left open


def test_well_formed_telemetry_frame_passes():
    record = decode(msgpack.packb(_telemetry(), use_bin_type=True))
    assert record.accepted_drafts.tolist() == [1, 2] and record.steps_used == 3
    assert record.warmup is None


WARMUP = dict(warmup=True, steps=0, accepted=b"", total=0, count=0)


@pytest.mark.parametrize(("changes", "field", "text"), [
    (dict(warmup=1), "warmup", "malformed: field 'warmup' must be true, false or nil, got "
                               "int 1"),
    (dict(warmup=b"\x01"), "warmup", "malformed: field 'warmup' must be true, false or nil"),
    (dict(warmup=False, before_prefill=0), "before_prefill",
     "malformed: field 'before_prefill' must be true, false or nil, got int 0"),
    (dict(warmup=None, before_prefill="yes"), "before_prefill",
     "malformed: field 'before_prefill' must be true, false or nil, got str 'yes'"),
    (dict(warmup=True), "warmup", "range: field 'warmup': a warm-up is a decode step at "
                                  "steps_used 0, got steps_used 3 and prefill_tokens 0"),
    ({**WARMUP, "prefill": 7}, "warmup", "range: field 'warmup': a warm-up is a decode step "
                                         "at steps_used 0, got steps_used 0 and "
                                         "prefill_tokens 7"),
])
def test_a_bad_warmup_flag_is_refused_naming_it(changes, field, text):
    frame = msgpack.packb(_telemetry(**changes), use_bin_type=True)
    for decoder in (decode, decode_general):
        with pytest.raises(WireError) as info:
            decoder(frame)
        assert str(info.value).startswith(text) and info.value.field == field
    assert wire._make_fast_decoder()(frame) is None  # the general path names it


@pytest.mark.parametrize("changes", [
    dict(warmup=False), WARMUP, {**WARMUP, "warmup": False}, dict(warmup=False, prefill=9,
                                                                  steps=0, accepted=b"",
                                                                  total=0, count=0),
    dict(warmup=None), dict(warmup=None, before_prefill=True),
    {**WARMUP, "before_prefill": False}, dict(warmup=False, before_prefill=None)])
def test_a_known_or_nil_flag_passes_both_paths(changes):
    frame = msgpack.packb(_telemetry(**changes), use_bin_type=True)
    record = wire._make_fast_decoder()(frame)
    flag = changes.get("before_prefill")
    assert record is not None and record.warmup is changes["warmup"]
    assert record.before_prefill is flag
    assert decode_general(frame).warmup is changes["warmup"]
    assert decode_general(frame).before_prefill is flag


@settings(max_examples=400)
@given(st.binary(max_size=300))
def test_decoder_never_raises_anything_but_wire_error_on_bytes(data):
    """Any bytes: a WireError of a known kind whose text starts with it, or a valid
    message (one that survives its own encoder)."""
    try:
        message = decode(data)
    except WireError as exc:
        assert exc.kind in ERROR_KINDS and str(exc).startswith(f"{exc.kind}: ")
    else:
        _assert_valid(message)


def _assert_valid(message) -> None:
    """A decoded message is one its own encoder writes and decoding gives back."""
    encoders = {Hello: encode_hello, Decision: encode_decision, StepRecord: encode_step}
    again = decode(encoders[type(message)](message))
    if isinstance(message, StepRecord):
        assert _outcome(lambda _: again, b"") == _outcome(lambda _: message, b"")
    else:
        assert again == message


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=8,
)
VALID = {
    Kind.HELLO: [WIRE_VERSION, 1, "s", 0, 1, [0, 1], "c", 1],
    Kind.TELEMETRY: _telemetry(),
    Kind.DECISION: [WIRE_VERSION, 3, 1, 2, "p", 1, [1, 8], [3, 2]],
}


@settings(max_examples=300)
@given(st.sampled_from(list(VALID)), st.data())
def test_decoder_survives_any_field_replaced(kind, data):
    """A valid message with one field (version and kind included) replaced by anything."""
    message = list(VALID[kind])
    index = data.draw(st.integers(0, len(message) - 1))
    message[index] = data.draw(msgpack_values)
    try:
        decoded = decode(msgpack.packb(message, use_bin_type=True))
    except WireError as exc:
        assert exc.kind in ERROR_KINDS
        # A field after the header cannot make the version or the kind wrong, but for
        # a HELLO's schema version (another int than this build's), named as such.
        assert index < 2 or exc.kind != "kind", exc
        assert index < 2 or exc.kind != "version" or (
            (kind, index, exc.field) == (Kind.HELLO, 4, "schema_version")), exc
    else:  # the replacement was a value the field accepts: a message of the same kind
        assert type(decoded) is {Kind.HELLO: Hello, Kind.TELEMETRY: StepRecord,
                                 Kind.DECISION: Decision}[kind]
        _assert_valid(decoded)


#: Each message's fields in wire order after the version and the kind.
FIELD_NAMES = {
    Kind.HELLO: ["server", "rank", "schema_version", "candidate_steps", "client", "pid"],
    Kind.TELEMETRY: [*STEP_FIELDS[:11], "accepted_drafts", "accepted_drafts_sum",
                     "accepted_drafts_count", "step_latency_s"],
    Kind.DECISION: ["seq", "apply_from_step", "policy", "mode", "batch_grid", "steps"],
}


@pytest.mark.parametrize(("kind", "index"), [
    (kind, index) for kind, names in FIELD_NAMES.items() for index, _ in enumerate(names, start=2)])
def test_a_nil_in_any_field_is_refused_naming_that_field(kind, index):
    """No field takes nil; the error says which field (``WireError.field``) and names it
    in its text, so a bad frame from a plugin can be traced to what the plugin sent."""
    message = list(VALID[kind])
    message[index] = None
    name = FIELD_NAMES[kind][index - 2]
    with pytest.raises(WireError, match=rf"^malformed: field '{name}' ") as info:
        decode(msgpack.packb(message, use_bin_type=True))
    assert info.value.field == name


# -- the TELEMETRY fast path (msgspec) against the general path -------------------------


def _outcome(decoder, frame: bytes):
    try:
        record = decoder(frame)
    except WireError as exc:
        return ("error", exc.kind, exc.field)
    if not isinstance(record, StepRecord):
        return ("other", record)
    return ("record", *(getattr(record, name).tobytes() if name == "accepted_drafts"
                        else getattr(record, name) for name in STEP_FIELDS))


def _same_either_way(frame: bytes) -> None:
    fast = _outcome(decode, frame)
    assert fast == _outcome(decode_general, frame)
    if fast[0] == "record":  # the types, too (0 vs 0.0 would compare equal)
        assert [type(v) for v in fast] == [type(v) for v in _outcome(decode_general, frame)]


def test_the_fast_path_is_in_use():
    assert wire._decode_fast is not None, "msgspec is a dependency (pyproject.toml)"
    frame = msgpack.packb(_telemetry(), use_bin_type=True)
    assert wire._decode_fast(frame) is not None


@settings(max_examples=300)
@given(step_records())
def test_fast_and_general_decoding_agree_on_valid_telemetry(record):
    _same_either_way(encode_step(record))


@settings(max_examples=500)
@given(st.data())
def test_fast_and_general_decoding_agree_on_any_field_replaced(data):
    message = _telemetry(accepted=bytes([1, 2, 3]), total=6, count=3, batch=4, steps=3,
                         **data.draw(st.sampled_from([{}, dict(warmup=False),
                                                      dict(warmup=None, before_prefill=True)])))
    index = data.draw(st.integers(2, len(message) - 1))
    message[index] = data.draw(msgpack_values | st.integers(-5, 300)
                               | st.floats(-1.0, 1e4) | st.binary(max_size=6))
    _same_either_way(msgpack.packb(message, use_bin_type=True))


@pytest.mark.parametrize("changes", [
    dict(time=-1.0), dict(time=float("inf")), dict(latency=5e-324), dict(latency=float("nan")),
    dict(batch=MAX_BATCH + 1), dict(kv=101, cap=100), dict(steps=1), dict(rank=2**20),
    dict(total=4), dict(count=1), dict(batch=1), dict(accepted=bytes([255, 4]), total=259),
    dict(server="x" * 300), dict(server=""), dict(time=3), dict(latency=0), dict(steps=127),
    dict(accepted=b"", total=0, count=0), dict(steps=0, accepted=b"", total=0, count=0),
    dict(warmup=True), dict(warmup=False), WARMUP, {**WARMUP, "prefill": 1}, dict(warmup=None),
    dict(warmup=0), dict(warmup=1.0), dict(warmup=None, before_prefill=None),
    dict(warmup=True, before_prefill=1), dict(warmup=False, before_prefill=False),
])
def test_fast_and_general_decoding_agree_on_edge_cases(changes):
    _same_either_way(msgpack.packb(_telemetry(**changes), use_bin_type=True))
    _same_either_way(msgpack.packb(_telemetry(**changes), use_bin_type=True) + b"\x00")


def test_every_valid_telemetry_frame_takes_the_fast_path():
    """The fast path may hand a frame to the general one only when the frame is bad; a
    valid frame it declined would cost speed silently. (A fresh decoder: the module's
    own is built once, at import.)"""
    fast = wire._make_fast_decoder()
    for changes in [{}, dict(latency=0), dict(latency=MIN_STEP_LATENCY_S), dict(cap=0, kv=5),
                    dict(kv=100, cap=100), dict(steps=127), dict(steps=2),
                    dict(accepted=b"", total=0, count=0), dict(time=MAX_TIME_S),
                    dict(latency=MAX_STEP_LATENCY_S), dict(rank=wire.MAX_RANK),
                    dict(batch=MAX_BATCH), dict(accepted=bytes([3] * 20), total=60, count=20,
                                                batch=20, steps=3),
                    dict(accepted=bytes(range(17)), total=136, count=17, batch=17, steps=16),
                    # Over 192 entries at steps < 16: the total comes from per-value counts.
                    dict(accepted=bytes([0, 1, 2, 3] * 50), total=300, count=200, batch=200,
                         steps=3), dict(warmup=False), WARMUP]:
        frame = msgpack.packb(_telemetry(**changes), use_bin_type=True)
        record = fast(frame)
        assert record is not None, changes
        assert _outcome(lambda f, r=record: r, frame) == _outcome(decode_general, frame)


@settings(max_examples=200)
@given(step_records())
def test_a_fresh_fast_decoder_accepts_and_agrees_on_valid_telemetry(record):
    fast = wire._make_fast_decoder()
    frame = encode_step(record)
    got = fast(frame)
    assert got is not None
    assert _outcome(lambda f: got, frame) == _outcome(decode_general, frame)


@settings(max_examples=300)
@given(st.data())
def test_a_fresh_fast_decoder_never_accepts_what_the_general_path_refuses(data):
    message = _telemetry(accepted=bytes([1, 2, 3]), total=6, count=3, batch=4, steps=3,
                         **data.draw(st.sampled_from([{}, dict(warmup=False),
                                                      dict(warmup=None, before_prefill=True)])))
    index = data.draw(st.integers(2, len(message) - 1))
    message[index] = data.draw(msgpack_values | st.integers(-5, 300)
                               | st.floats(-1.0, 1e4) | st.binary(max_size=6))
    frame = msgpack.packb(message, use_bin_type=True)
    got = wire._make_fast_decoder()(frame)
    if got is not None:
        assert _outcome(lambda f: got, frame) == _outcome(decode_general, frame)


@pytest.mark.parametrize(("changes", "field"), [
    (dict(time=-1.0), "time_s"), (dict(latency=MIN_STEP_LATENCY_S / 2), "step_latency_s"),
    (dict(kv=101, cap=100), "kv_used_tokens"), (dict(count=3), "accepted_drafts_count"),
    (dict(batch=1), "accepted_drafts_count"), (dict(steps=1), "accepted_drafts"),
    (dict(total=4), "accepted_drafts_sum"), (dict(total=2), "accepted_drafts_sum"),
    (dict(accepted=bytes([200, 2]), total=202), "accepted_drafts"),
    (dict(batch=MAX_BATCH + 1), "batch_size"),
    (dict(accepted=bytes([17] * 3), total=51, count=3, batch=3, steps=16), "accepted_drafts"),
    (dict(warmup=True), "warmup"), ({**WARMUP, "prefill": 3}, "warmup"),
    (dict(warmup=0), "warmup"),
])
def test_a_fresh_fast_decoder_hands_bad_frames_to_the_general_path(changes, field):
    frame = msgpack.packb(_telemetry(**changes), use_bin_type=True)
    fast = wire._make_fast_decoder()
    assert fast(frame) is None
    assert fast(frame[:-1]) is None  # truncated
    with pytest.raises(WireError, match=rf"^(range|malformed): field '{field}'") as info:
        decode_general(frame)
    assert info.value.field == field


def test_a_fresh_fast_decoder_declines_oversized_frames():
    frame = msgpack.packb(_telemetry(accepted=bytes(MAX_FRAME_BYTES), total=0,
                                     count=MAX_FRAME_BYTES, batch=MAX_FRAME_BYTES),
                          use_bin_type=True)
    assert len(frame) > MAX_FRAME_BYTES and wire._make_fast_decoder()(frame) is None


def test_a_frame_of_exactly_the_largest_size_is_decoded_by_both_paths():
    frame = b""
    for size in range(MAX_FRAME_BYTES - 100, MAX_FRAME_BYTES):  # pad the drafts to fit
        frame = msgpack.packb(_telemetry(accepted=bytes(size), total=0, count=size,
                                         batch=size), use_bin_type=True)
        if len(frame) == MAX_FRAME_BYTES:
            break
    assert len(frame) == MAX_FRAME_BYTES
    assert wire._make_fast_decoder()(frame) is not None
    assert decode_general(frame).batch_size == decode(frame).batch_size


def test_decode_sends_telemetry_and_only_telemetry_through_the_fast_path(monkeypatch):
    monkeypatch.setattr(wire, "_decode_fast", lambda frame: ("fast", frame))
    frame = msgpack.packb(_telemetry(), use_bin_type=True)
    assert decode(frame) == ("fast", frame)
    hello = encode_hello(Hello("s", 0, (0, 1)))
    assert isinstance(decode(hello), Hello)
    monkeypatch.setattr(wire, "_decode_fast", lambda frame: None)  # declined: general path
    assert isinstance(decode(frame), StepRecord)


# -- telemetry_bytes: SGLang's accepted counts as the wire carries them -----------------


@pytest.mark.parametrize(("accepted", "steps", "batch", "expected"), [
    ([1, 0, 3], 3, 3, (bytes([1, 0, 3]), 4)),
    ([1, 0, 3], 0, 3, (b"", 0)),  # a step that did not speculate
    ([1, 0, 3], -1, 3, (b"", 0)),
    ([], 3, 3, (b"", 0)),
    (None, 3, 3, (b"", 0)),
    ([2, 2, 2, 2], 3, 2, (bytes([2, 2]), 4)),  # more entries than requests: cut
    ([2, 2], 3, 2, (bytes([2, 2]), 4)),
    ([300, -4, 5], 7, 3, (bytes([127, 0, 5]), 132)),  # outside 0..255: clipped
    ([200, 1], 7, 2, (bytes([200, 1]), 201)),  # 128..255 pass; decode refuses them
    ((1, 2), 1, 2, (bytes([1, 2]), 3)),  # more than steps_used: decode refuses it
])
def test_telemetry_bytes(accepted, steps, batch, expected):
    assert wire.telemetry_bytes(accepted, steps, batch) == expected


@given(st.lists(st.integers(-1000, 1000), max_size=40), st.integers(1, 7), st.integers(0, 50))
def test_telemetry_bytes_make_a_frame_that_decodes_to_the_same_entries(accepted, steps, batch):
    blob, total = wire.telemetry_bytes(accepted, steps, batch)
    assert len(blob) <= batch and total == sum(blob)
    clipped = [min(max(a, 0), 127) for a in accepted] if any(
        not 0 <= a <= 255 for a in accepted) else accepted
    assert list(blob) == clipped[:batch]


# -- every field of every message: its name in the error, both sides of its range -------

TELEMETRY_FIELDS = ["server", "rank", "step_index", "time_s", "batch_size", "waiting_requests",
                    "running_requests", "kv_used_tokens", "kv_capacity_tokens",
                    "prefill_tokens", "steps_used", "accepted_drafts", "accepted_drafts_sum",
                    "accepted_drafts_count", "step_latency_s"]
DECISION_FIELDS = ["seq", "apply_from_step", "policy", "mode", "batch_grid", "steps"]
HELLO_FIELDS = ["server", "rank", "schema_version", "candidate_steps", "client", "pid"]
FIELDS = {Kind.TELEMETRY: TELEMETRY_FIELDS, Kind.DECISION: DECISION_FIELDS,
          Kind.HELLO: HELLO_FIELDS}
#: What each kind of field says it must be.
MUST_BE = {"server": "a string of 1..256 chars", "policy": "a string of 1..256 chars",
           "client": "a string of 1..256 chars", "time_s": "a number",
           "step_latency_s": "a number", "accepted_drafts": "bin",
           "batch_grid": "a list of <= 256 ints", "steps": "a list of <= 256 ints",
           "candidate_steps": "a list of <= 256 ints", "mode": "0 or 1"}


@pytest.mark.parametrize(("kind", "index"), [
    (kind, index) for kind, names in FIELDS.items() for index in range(len(names))])
def test_a_field_of_the_wrong_type_is_named_with_what_it_got(kind, index):
    message = list(VALID[kind])
    name = FIELDS[kind][index]
    is_list = MUST_BE.get(name, "").startswith("a list")
    message[2 + index] = 7.5 if is_list else [7.5]  # no field's type
    with pytest.raises(WireError) as info:
        decode(msgpack.packb(message, use_bin_type=True))
    error = info.value
    assert error.kind == "malformed"
    assert error.field == name
    assert f"field '{name}'" in str(error)
    assert is_list or "list [7.5]" in str(error)  # (a list field's error omits the value)
    assert f"must be {MUST_BE.get(name, 'an int')}" in str(error)


#: Telemetry fields with an upper bound, and the bound (the lower bound is 0 for all).
UPPER = {"rank": wire.MAX_RANK, "time_s": MAX_TIME_S, "batch_size": MAX_BATCH,
         "waiting_requests": wire.MAX_REQUESTS, "running_requests": wire.MAX_REQUESTS,
         "kv_used_tokens": MAX_KV_TOKENS, "kv_capacity_tokens": MAX_KV_TOKENS,
         "prefill_tokens": wire.MAX_PREFILL_TOKENS, "steps_used": 127,
         "step_latency_s": MAX_STEP_LATENCY_S, "step_index": 2**63 - 1,
         "accepted_drafts_sum": None, "accepted_drafts_count": None}


def _with(name: str, value, **changes) -> bytes:
    message = _telemetry(**changes)
    message[2 + TELEMETRY_FIELDS.index(name)] = value
    return msgpack.packb(message, use_bin_type=True)


@pytest.mark.parametrize("name", sorted(UPPER))
def test_a_negative_value_is_out_of_range_naming_the_field_and_the_range(name):
    with pytest.raises(WireError) as info:
        decode(_with(name, -1 if name not in ("time_s", "step_latency_s") else -1.0))
    assert info.value.kind == "range" and info.value.field == name
    assert f"field '{name}'" in str(info.value) and "-1" in str(info.value)
    if UPPER[name] is not None:
        assert f"not in [0, {UPPER[name]}]" in str(info.value)


@pytest.mark.parametrize("name", [n for n, hi in UPPER.items() if hi is not None])
def test_the_upper_bound_is_accepted_and_one_more_is_not(name):
    hi = UPPER[name]
    changes = {"kv_used_tokens": dict(cap=0), "kv_capacity_tokens": dict(kv=0)}.get(name, {})
    record = decode(_with(name, hi, **changes))
    assert getattr(record, name) == hi and type(getattr(record, name)) is type(hi)
    above = hi + 1 if isinstance(hi, int) else hi * (1 + 1e-9)
    if name == "step_index":
        above = 2**64 - 1  # msgpack's largest
    with pytest.raises(WireError) as info:
        decode(_with(name, above, **changes))
    assert info.value.kind == "range" and info.value.field == name


def test_consistency_errors_say_what_disagrees():
    cases = [
        (dict(latency=MIN_STEP_LATENCY_S / 2), "step_latency_s", "is below 1e-06 s (0 means"),
        (dict(kv=101, cap=100), "kv_used_tokens", "101 > kv_capacity_tokens 100"),
        (dict(count=1), "accepted_drafts_count", "is 1 for 2 entries and batch_size 2"),
        (dict(total=4), "accepted_drafts_sum", "is 4, entries sum to 3"),
        (dict(steps=1), "accepted_drafts", "an entry of 2 > steps_used 1"),
        (dict(accepted=bytes([255, 4]), total=259), "accepted_drafts", "negative entries"),
    ]
    for changes, field, text in cases:
        with pytest.raises(WireError) as info:
            decode_general(msgpack.packb(_telemetry(**changes), use_bin_type=True))
        assert info.value.field == field and field in str(info.value), changes
        assert text in str(info.value), (changes, str(info.value))


def test_an_entry_equal_to_steps_used_is_accepted():
    record = decode(msgpack.packb(_telemetry(steps=2), use_bin_type=True))
    assert record.accepted_drafts.tolist() == [1, 2]


def _decision(**changes) -> bytes:
    fields = dict(seq=1, apply=2, policy="p", mode=1, grid=[1, 8], steps=[3, 2])
    fields.update(changes)
    return msgpack.packb([WIRE_VERSION, 3, *fields.values()])


@pytest.mark.parametrize(("changes", "text"), [
    (dict(grid=[1, 8], steps=[3]), "fields 'batch_grid'/'steps' have 2 and 1 entries"),
    (dict(grid=[], steps=[]), "mode 1 (controller) needs at least one grid entry"),
    (dict(mode=0), "mode 0 (fallback) must not carry steps"),
    (dict(grid=[4, 4]), "field 'batch_grid' must strictly increase"),
    (dict(grid=[0, 8]), "field 'batch_grid': entry int 0 not an int in [1, "),
    (dict(steps=[3, 128]), "field 'steps': entry int 128 not an int in [0, 127]"),
    (dict(mode=2), "field 'mode' must be 0 or 1, got int 2"),
    (dict(mode=True), "field 'mode' must be 0 or 1, got bool True"),
    (dict(seq=-1), "field 'seq': int -1 not in [0, "),
    (dict(policy="x" * 257), "field 'policy' must be a string of 1..256 chars"),
])
def test_bad_decisions_say_what_is_wrong(changes, text):
    with pytest.raises(WireError) as info:
        decode(_decision(**changes))
    assert text in str(info.value), str(info.value)


def test_decision_edges_pass():
    assert decode(_decision(steps=[127, 0])).steps == (127, 0)
    assert decode(_decision(policy="")).policy == ""
    grid = list(range(1, wire.MAX_GRID + 1))
    assert decode(_decision(grid=grid, steps=[1] * wire.MAX_GRID)).batch_grid == tuple(grid)
    with pytest.raises(WireError, match="must be a list of <= 256 ints"):
        decode(_decision(grid=[*grid, 257], steps=[1] * (wire.MAX_GRID + 1)))


def _hello(**changes) -> bytes:
    fields = dict(server="s", rank=0, schema=SCHEMA_VERSION, candidates=[0, 1], client="c",
                  pid=1)
    fields.update(changes)
    return msgpack.packb([WIRE_VERSION, 1, *fields.values()])


@pytest.mark.parametrize(("changes", "text"), [
    (dict(grid=[], steps=[]), "malformed: mode 1 (controller) needs at least one grid entry"),
    (dict(mode=0), "malformed: mode 0 (fallback) must not carry steps"),
    (dict(grid=[4, 4]), "malformed: field 'batch_grid' must strictly increase"),
])
def test_decision_errors_read_in_full(changes, text):
    with pytest.raises(WireError) as info:
        decode(_decision(**changes))
    assert str(info.value) == text


def test_an_entry_of_127_passes_and_one_of_128_is_a_negative_int8():
    frame = msgpack.packb(_telemetry(steps=127, accepted=bytes([127, 0]), total=127),
                          use_bin_type=True)
    for decoder in (decode, decode_general):
        assert decoder(frame).accepted_drafts.tolist() == [127, 0]
    with pytest.raises(WireError) as info:
        decode(msgpack.packb(_telemetry(steps=127, accepted=bytes([128, 0]), total=128),
                             use_bin_type=True))
    assert str(info.value) == "range: field 'accepted_drafts': negative entries"


@pytest.mark.parametrize("value", [{1: 2}, {"a": 1}, msgpack.ExtType(5, b"a")])
def test_maps_and_extension_types_anywhere_are_garbage(value):
    for kind in VALID:
        message = list(VALID[kind])
        message[-1] = value
        assert _kind(msgpack.packb(message, use_bin_type=True)) == "garbage"


def test_garbage_names_what_msgpack_said():
    with pytest.raises(WireError) as info:
        decode(b"\xc1")
    assert str(info.value).startswith("garbage: not a msgpack message (FormatError")


def test_names_of_the_largest_length_pass():
    name = "n" * wire.MAX_NAME_CHARS
    assert decode(_hello(server=name)).server == name


def test_an_int64_record_is_sent_as_int8_entries():
    record = StepRecord("s", 0, 1, 0.5, 3, 0, 3, 10, 100, 0, 3,
                        np.array([3, 0, 2], dtype=np.int64), 0.01)
    back = decode(encode_step(record))
    assert back.accepted_drafts.tolist() == [3, 0, 2] and back.accepted_drafts.dtype == np.int8


def test_hello_edges_and_errors():
    hello = decode(_hello(client="", rank=wire.MAX_RANK, candidates=[127]))
    assert (hello.client, hello.rank, hello.candidate_steps) == ("", wire.MAX_RANK, (127,))
    assert hello.schema_version == SCHEMA_VERSION
    for changes, field, text in [
        (dict(rank=wire.MAX_RANK + 1), "rank", f"not in [0, {wire.MAX_RANK}]"),
        (dict(candidates=[128]), "candidate_steps", "entry int 128 not an int in [0, 127]"),
        (dict(schema=99), "schema_version",
         f"schema version 99; this build speaks {SCHEMA_VERSION}"),
        (dict(pid=-1), "pid", "field 'pid': int -1"),
        (dict(server=""), "server", "field 'server' must be a string of 1..256 chars"),
    ]:
        with pytest.raises(WireError) as info:
            decode(_hello(**changes))
        assert info.value.field == field and text in str(info.value), (changes, info.value)


def test_the_top_level_errors_say_what_they_got():
    for frame, text in [
        (b"\x00" * (MAX_FRAME_BYTES + 1), f"frame of {MAX_FRAME_BYTES + 1} bytes > "),
        (b"\xc1", "not a msgpack message ("),
        (msgpack.packb("hello"), "expected an array [version, kind, ...], got str 'hello'"),
        (msgpack.packb([2, 2]), f"wire version int 2; this build speaks {WIRE_VERSION}"),
        (msgpack.packb([WIRE_VERSION, 9]), "unknown message kind int 9"),
        (msgpack.packb([WIRE_VERSION, 2, "s"]), "TELEMETRY has 3 items, expected 17 to 19"),
    ]:
        with pytest.raises(WireError) as info:
            decode(frame)
        assert text in str(info.value), str(info.value)
        assert info.value.field == ""


# -- the POLICY push (hub -> plugin) and the HELLO's policy digest ----------------------

DIGEST = hashlib.sha256(b"a policy file").hexdigest()


def _push(name="policy-v2", digest=DIGEST, blob=b"\x93\x01", extra=()) -> bytes:
    return msgpack.packb([WIRE_VERSION, int(Kind.POLICY), name, digest, blob, *extra],
                         use_bin_type=True)


@pytest.mark.parametrize("blob", [b"x", bytes(range(256)) * 4])
def test_a_small_policy_push_round_trips_whichever_side_decodes_it(blob):
    push = PolicyPush("policy-v2", DIGEST, blob)
    frame = encode_policy(push)
    assert frame == _push(blob=blob)  # the documented layout
    for decoder in (decode, decode_general):
        assert decoder(frame, accept_policy=True) == push
        assert decoder(frame) == push  # within MAX_FRAME_BYTES: any side may read it


def test_only_the_plugin_side_reads_a_policy_push_beyond_the_frame_limit():
    """The largest valid POLICY (the whole MAX_POLICY_BYTES, a name of MAX_NAME_CHARS
    4-byte UTF-8 characters) is read with ``accept_policy`` and refused unread without;
    one byte more is refused unread on either side."""
    push = PolicyPush("\U0001f600" * wire.MAX_NAME_CHARS, "f" * 64, bytes(MAX_POLICY_BYTES))
    frame = encode_policy(push)
    for decoder in (decode, decode_general):
        assert decoder(frame, accept_policy=True) == push
        with pytest.raises(WireError, match=rf"^oversized: frame of {len(frame)} bytes > "
                                            rf"{MAX_FRAME_BYTES}$"):
            decoder(frame)
        with pytest.raises(WireError, match=rf"^oversized: frame of {len(frame) + 1} bytes > "
                                            rf"{len(frame)}$"):
            decoder(frame + b"\x00", accept_policy=True)
        # accept_policy lifts the limit for a POLICY only.
        with pytest.raises(WireError, match=rf"> {MAX_FRAME_BYTES}$"):
            decoder(b"\x00" * (MAX_FRAME_BYTES + 1), accept_policy=True)


BAD_DIGESTS = [
    ("A" * 64, "str 'AAAA"),  # upper case
    (DIGEST.upper(), "str '"),
    ("X" * 64, "str 'XXXX"),  # a placeholder
    ("g" * 64, "str 'gggg"),
    (DIGEST[:63], "str '"), (DIGEST + "0", "str '"),
    (DIGEST.encode(), "bytes b'"), (7, "int 7"), (None, "NoneType None"),
]


@pytest.mark.parametrize(("changes", "field", "text"), [
    (dict(name=""), "name", "field 'name' must be a string of 1..256 chars, got str ''"),
    (dict(name="n" * 257), "name", "field 'name' must be a string of 1..256 chars"),
    (dict(name=b"p"), "name", "field 'name' must be a string of 1..256 chars, got bytes"),
    *[(dict(digest=digest), "digest",
       f"field 'digest' must be 64 lowercase hex digits, got {got}")
      for digest, got in BAD_DIGESTS],
    (dict(blob=b""), "policy",
     f"field 'policy' must be bin of 1..{MAX_POLICY_BYTES} bytes, got bytes b''"),
    (dict(blob="text"), "policy", "field 'policy' must be bin of 1..786432 bytes, got str"),
    (dict(blob=bytes(MAX_POLICY_BYTES + 1)), "policy",
     "field 'policy' must be bin of 1..786432 bytes, got bytes b'\\x00"),
])
def test_a_bad_policy_push_is_refused_naming_the_field(changes, field, text):
    with pytest.raises(WireError) as info:
        decode(_push(**changes), accept_policy=True)
    assert str(info.value).startswith(f"malformed: {text}"), str(info.value)
    assert info.value.kind == "malformed" and info.value.field == field


@pytest.mark.parametrize("digest", ["0" * 64, "f" * 64, "0123456789abcdef" * 4])
def test_every_lowercase_hex_digest_passes(digest):
    assert decode(_push(digest=digest)).digest == digest
    hello = Hello("s", 0, (0, 3), "c", 1, policy_digest=digest)
    assert decode(encode_hello(hello)).policy_digest == digest


def test_a_hello_carries_the_policy_digest_as_a_ninth_item_only_when_it_has_one():
    local = Hello("server-a", 2, (0, 3), "plugin", 9, policy_digest=DIGEST)
    frame = encode_hello(local)
    assert msgpack.unpackb(frame)[8:] == [DIGEST]
    for decoder in (decode, decode_general):
        assert decoder(frame) == local
    remote = Hello("server-a", 2, (0, 3), "plugin", 9)
    assert len(msgpack.unpackb(encode_hello(remote))) == 8
    assert decode(encode_hello(remote)) == remote


@pytest.mark.parametrize(("digest", "got"), BAD_DIGESTS)
def test_a_bad_digest_in_a_hello_is_refused_naming_the_field(digest, got):
    message = [*VALID[Kind.HELLO], digest]
    with pytest.raises(WireError) as info:
        decode(msgpack.packb(message, use_bin_type=True))
    assert str(info.value).startswith(
        f"malformed: field 'policy_digest' must be 64 lowercase hex digits, got {got}")
    assert info.value.field == "policy_digest"


@pytest.mark.parametrize(("message", "text"), [
    (VALID[Kind.HELLO][:7], "HELLO has 7 items, expected 8 to 9"),
    ([*VALID[Kind.HELLO], DIGEST, DIGEST], "HELLO has 10 items, expected 8 to 9"),
    ([*VALID[Kind.DECISION], 1, DIGEST], "DECISION has 10 items, expected 8 to 9"),
    ([*VALID[Kind.TELEMETRY], False, False, DIGEST], "TELEMETRY has 20 items, expected 17 to 19"),
    ([WIRE_VERSION, int(Kind.POLICY), "p", DIGEST, b"x", DIGEST, 1, 2, 3],
     "POLICY has 9 items, expected 5"),
    ([WIRE_VERSION, int(Kind.POLICY), "p", DIGEST], "POLICY has 4 items, expected 5"),
])
def test_only_a_hello_telemetry_or_decision_may_carry_optional_items(message, text):
    for accept_policy in (False, True):
        with pytest.raises(WireError) as info:
            decode(msgpack.packb(message, use_bin_type=True), accept_policy=accept_policy)
        assert str(info.value) == f"malformed: {text}" and info.value.field == ""


@pytest.mark.parametrize("decoder", [decode, decode_general])
def test_inside_a_policy_push_strings_and_arrays_keep_the_frame_limit(decoder):
    """``accept_policy`` lifts the limit for the policy's bytes only: a string or an
    array longer than MAX_FRAME_BYTES in a POLICY frame is refused by msgpack itself
    (garbage), one of exactly MAX_FRAME_BYTES is read (and refused by its field's check)."""
    for changes in (dict(name="n" * (MAX_FRAME_BYTES + 1)), dict(blob=[0] * (MAX_FRAME_BYTES + 1))):
        with pytest.raises(WireError, match=r"^garbage: not a msgpack message \(ValueError"):
            decoder(_push(**changes), accept_policy=True)
    for changes, field in ((dict(name="n" * MAX_FRAME_BYTES), "name"),
                           (dict(blob=[0] * MAX_FRAME_BYTES), "policy")):
        with pytest.raises(WireError, match=r"^malformed: ") as info:
            decoder(_push(**changes), accept_policy=True)
        assert info.value.field == field


# -- DecisionDecoder: decode's results, cheaper on repeated decision tails ---------------------

_TAILS = [("p", 1, [1, 8, 32], [3, 2, 0]), ("p", 1, [1, 8, 32], [3, 2, 1]), ("q", 0, [], []),
          ("p", 1, [8, 1], [3, 2]), ("p", 1, [1], [200]), ("", 2, [1], [1]), ("p", 0, [1], [3])]


def _uint_bytes(value: int, wide: bool) -> bytes:
    """``value`` as msgpack writes it, or in its widest unsigned form."""
    if wide and 0 <= value < 1 << 64:
        return b"\xcf" + value.to_bytes(8, "big")
    return msgpack.packb(value)


@st.composite
def _decision_frames(draw) -> bytes:
    # Mostly valid, from few tails, so that tails repeat within a list of frames.
    tail = msgpack.packb(list(draw(st.sampled_from(_TAILS[:3] * 3 + _TAILS[3:]))))[1:]
    ints = b"".join(
        _uint_bytes(draw(st.one_of(st.integers(0, 300),
                                   st.integers((1 << 63) - 2, (1 << 64) - 1),
                                   st.integers(-5, -1))), draw(st.booleans()))
        for _ in range(2))
    good = bytes([0x98, wire.WIRE_VERSION, int(Kind.DECISION)])
    head = draw(st.sampled_from([good] * 4 + [
        bytes([0x98, wire.WIRE_VERSION + 1, int(Kind.DECISION)]),
        bytes([0x97, wire.WIRE_VERSION, int(Kind.DECISION)])]))
    frame = head + ints + tail
    if draw(st.integers(0, 9)) == 0:
        frame += b"\x00"  # trailing bytes
    if draw(st.integers(0, 9)) == 0:
        frame = frame[:-1]  # cut short
    return frame


def _decoded(decoder, frame: bytes) -> object:
    try:
        return decoder(frame)
    except WireError as exc:
        return ("error", exc.kind, str(exc))


@settings(max_examples=400, deadline=None)
@given(st.lists(_decision_frames(), min_size=1, max_size=12))
def test_the_decision_decoder_gives_decodes_result_for_every_frame(frames):
    cached = wire.DecisionDecoder(accept_policy=True)
    for frame in frames:
        assert _decoded(cached, frame) == _decoded(
            lambda f: decode(f, accept_policy=True), frame)


def test_the_decision_decoder_reads_only_the_ints_of_a_repeated_tail(monkeypatch):
    cached = wire.DecisionDecoder()
    first = encode_decision(Decision(1, 3, "p", (1, 8), (3, 1)))
    assert cached(first) == decode(first)
    monkeypatch.setattr(wire, "decode", None)  # a repeated tail must not get there
    again = encode_decision(Decision(2, 1 << 40, "p", (1, 8), (3, 1)))
    assert cached(again) == Decision(2, 1 << 40, "p", (1, 8), (3, 1))
    with pytest.raises(TypeError):  # another tail goes to decode
        cached(encode_decision(Decision(3, 5, "p", (1, 8), (3, 2))))

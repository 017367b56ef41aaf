"""The wire protocol: round trips, and every kind of bad frame rejected with its kind."""

from __future__ import annotations

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
    MAX_STEP_LATENCY_S,
    MIN_STEP_LATENCY_S,
    TRANSPORT_MAX_MSG_BYTES,
    WIRE_VERSION,
    Decision,
    Hello,
    Kind,
    WireError,
    apply_socket_limits,
    decode,
    decode_general,
    encode_decision,
    encode_hello,
    encode_step,
    pack_telemetry,
)
from env.traces.schema import STEP_FIELDS, StepRecord

ints = st.integers(0, 2**32)
times = st.floats(0, 1e7, allow_nan=False, allow_infinity=False)
latencies = st.just(0.0) | st.floats(MIN_STEP_LATENCY_S, MAX_STEP_LATENCY_S)


@st.composite
def step_records(draw) -> StepRecord:
    batch = draw(st.integers(0, 300))
    steps = draw(st.integers(0, 7))
    accepted = draw(st.lists(st.integers(0, steps), max_size=batch)) if steps else []
    capacity = draw(st.integers(0, MAX_KV_TOKENS))
    return StepRecord(
        server=draw(st.text(min_size=1, max_size=40)), rank=draw(st.integers(0, 1024)),
        step_index=draw(st.integers(0, 2**62)), time_s=draw(times), batch_size=batch,
        waiting_requests=draw(ints), running_requests=draw(ints),
        kv_used_tokens=draw(st.integers(0, capacity or MAX_KV_TOKENS)),
        kv_capacity_tokens=capacity, prefill_tokens=draw(ints), steps_used=steps,
        accepted_drafts=np.array(accepted, dtype=np.int8), step_latency_s=draw(latencies),
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


@given(st.builds(
    Decision, seq=ints, apply_from_step=ints, policy=st.text(max_size=20),
    batch_grid=st.just((1, 8, 64)), steps=st.tuples(*[st.integers(0, 7)] * 3),
))
def test_decision_round_trip(decision):
    assert decode(encode_decision(decision)) == decision


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
        context.term()


def test_well_formed_telemetry_frame_passes():
    record = decode(msgpack.packb(_telemetry(), use_bin_type=True))
    assert record.accepted_drafts.tolist() == [1, 2] and record.steps_used == 3


@settings(max_examples=400)
@given(st.binary(max_size=300))
def test_decoder_never_raises_anything_but_wire_error_on_bytes(data):
    try:
        decode(data)
    except WireError as exc:
        assert exc.kind in ERROR_KINDS


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
        decode(msgpack.packb(message, use_bin_type=True))
    except WireError as exc:
        assert exc.kind in ERROR_KINDS


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
    message = _telemetry(accepted=bytes([1, 2, 3]), total=6, count=3, batch=4, steps=3)
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
])
def test_fast_and_general_decoding_agree_on_edge_cases(changes):
    _same_either_way(msgpack.packb(_telemetry(**changes), use_bin_type=True))
    _same_either_way(msgpack.packb(_telemetry(**changes), use_bin_type=True) + b"\x00")

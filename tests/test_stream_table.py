"""The daemon's stream table: LRU order across the table and within each connection."""

from __future__ import annotations

from controller.streams import StreamLimits, StreamTable


def _table(max_streams: int = 16, max_per_peer: int = 4) -> StreamTable[str]:
    return StreamTable(StreamLimits(max_streams, max_per_peer, 1e9), lambda key: key[1])


_clock = iter(range(1, 10**9))


def _open(table: StreamTable[str], key: tuple) -> str | None:
    """get_or_open a second later each time (the new-stream tokens refilled)."""
    return table.get_or_open(key, float(next(_clock)))


def _key(peer: int, server: str) -> tuple:
    return ((b"peer%d" % peer, ""), server, 0)


def test_a_peer_beyond_its_limit_loses_its_least_recently_active_stream():
    """get() marks a stream active within its connection: with two streams or more the
    one read last is the one kept when the connection opens one too many."""
    table = _table(max_per_peer=2)
    assert _open(table, _key(0, "a")) == "a"
    assert _open(table, _key(0, "b")) == "b"
    assert table.get(_key(0, "a")) == "a"  # now b is the connection's least recent
    assert _open(table, _key(0, "c")) == "c"
    assert table.get(_key(0, "b")) is None
    assert table.get(_key(0, "a")) == "a"
    assert table.evicted == 1


def test_a_full_table_loses_its_least_recently_active_stream():
    """Across connections (one stream each, as plugins connect) get() marks the table's
    order: the stream read last survives a full table's eviction."""
    table = _table(max_streams=2)
    _open(table, _key(0, "a"))
    _open(table, _key(1, "b"))
    assert table.get(_key(0, "a")) == "a"
    _open(table, _key(2, "c"))
    assert [s for s in table] == ["a", "c"]
    assert table.get(_key(1, "b")) is None
    assert table.get(_key(9, "nothing")) is None


def test_a_peers_order_follows_its_reads_at_its_limit():
    """Reads among a connection's four streams decide which goes at the fifth."""
    table = _table(max_per_peer=4)
    for name in "abcd":
        _open(table, _key(0, name))
    for name in "cadb":  # c is now the least recent
        table.get(_key(0, name))
    _open(table, _key(0, "e"))
    assert sorted(s for s in table) == ["a", "b", "d", "e"]

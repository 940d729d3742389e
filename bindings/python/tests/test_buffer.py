"""One rank's PD buffer driven from Python: a request's life, its cancellation in every state, the
lease and the generation that refuse a late write, and guards released once when collected."""

import gc
import time

import pytest

import baton_dataplane as bd


TINY = bd.KvGeometry(layers=2, kv_heads=2, head_dim=16, dtype_bytes=2, chunk_tokens=16)


def buffer(pages=8):
    return bd.RankBuffer(TINY, pages=pages)


def chunk_bytes(buf, request_id, chunk):
    """A page's worth of bytes that names its request and chunk."""
    seed = bytes([(request_id * 31 + chunk * 7 + i) % 251 for i in range(64)])
    return (seed * (buf.page_bytes // len(seed) + 1))[: buf.page_bytes]


def free(buf):
    s = buf.stats()
    assert s["accounting_errors"] == 0, s
    return s["free"]


def test_reserve_write_ready_consume_release():
    buf = buffer()
    assert buf.page_bytes == 2 * 2 * 2 * 16 * 2 * 16
    with buf.reserve(1, 3, 60_000) as r:
        addrs = r.publish()
        assert [c for c, _, _ in addrs] == [0, 1, 2]
        assert free(buf) == 5
        assert r.try_ready() is None, "nothing written yet"
        last = [buf.write_chunk(1, c, page, gen, chunk_bytes(buf, 1, c)) for c, page, gen in addrs]
        assert last == [False, False, True]
        # Written again: a duplicate, nothing changes.
        c, page, gen = addrs[0]
        assert buf.write_chunk(1, c, page, gen, chunk_bytes(buf, 1, c)) is False
        ready = r.try_ready()
        assert ready is not None and r.closed, "the reservation became the ready guard"
        with ready.consume() as moving:
            for c, _, _ in addrs:
                assert moving.read_chunk(c) == chunk_bytes(buf, 1, c)
            assert buf.stats()["consuming"] == 3
    assert free(buf) == 8
    assert buf.stats()["requests"] == 0


@pytest.mark.parametrize("state", ["reserved", "published", "partly_written", "ready", "consuming"])
def test_cancel_in_every_state_frees_every_page(state):
    buf = buffer()
    r = buf.reserve(2, 4, 60_000)
    guards = [r]
    if state != "reserved":
        addrs = r.publish()
        written = {"published": 0, "partly_written": 2}.get(state, 4)
        for c, page, gen in addrs[:written]:
            buf.write_chunk(2, c, page, gen, chunk_bytes(buf, 2, c))
        if state in ("ready", "consuming"):
            guards.append(r.try_ready())
        if state == "consuming":
            guards.append(guards[-1].consume())
    for g in guards:
        g.close()
    # Published pages that may still be written wait in quarantine for the producer: a cancel never
    # hands out a page a late write could land in. The reaper frees them at the deadline.
    s = buf.stats()
    assert s["reserved"] == 0 and s["consuming"] == 0 and s["filled"] == 0, s
    assert s["free"] + s["quarantined"] == 8, s
    if state in ("reserved", "ready", "consuming"):
        assert s["free"] == 8, s


def test_a_guard_is_used_once():
    buf = buffer()
    r = buf.reserve(3, 0, 60_000)
    ready = r.try_ready()
    assert ready is not None, "a request with no chunks is ready at once"
    with pytest.raises(bd.GuardClosed):
        r.try_ready()
    moving = ready.consume()
    with pytest.raises(bd.GuardClosed):
        ready.consume()
    moving.close()
    moving.close()
    assert moving.closed and ready.closed and r.closed
    assert free(buf) == 8


def test_a_collected_guard_releases_exactly_once():
    buf = buffer()
    r = buf.reserve(4, 5, 60_000)
    assert free(buf) == 3
    del r
    gc.collect()
    assert free(buf) == 8
    # The pages went back once: a new request of all 8 fits, a ninth page does not exist.
    with buf.reserve(5, 8, 60_000):
        assert free(buf) == 0
    with pytest.raises(bd.ReserveError):
        buf.reserve(6, 9, 60_000)
    assert buf.stats()["requests"] == 0


def test_the_lease_expires_and_a_late_write_is_refused():
    buf = buffer()
    r = buf.reserve(7, 2, 50)
    addrs = r.publish()
    time.sleep(0.1)
    assert buf.reap() == 1
    c, page, gen = addrs[0]
    with pytest.raises(bd.WriteError):
        buf.write_chunk(7, c, page, gen, chunk_bytes(buf, 7, c))
    with pytest.raises(bd.LeaseError):
        r.try_ready()
    # Its published pages wait in quarantine (the producer may still be writing) until it fences.
    assert buf.stats()["quarantined"] == 2
    assert buf.fence(7)
    assert free(buf) == 8
    # The page went to another request under a new generation: the old address cannot reach it.
    with buf.reserve(8, 8, 60_000) as other:
        new = dict((c, (p, g)) for c, p, g in other.publish())
        assert any(p == page and g != gen for p, g in new.values())
        with pytest.raises(bd.WriteError):
            buf.write_chunk(7, c, page, gen, chunk_bytes(buf, 7, c))


def test_refusals_are_data_plane_errors():
    buf = buffer(pages=2)
    with pytest.raises(bd.ReserveError) as e:
        buf.reserve(9, 3, 60_000)
    assert isinstance(e.value, bd.DataPlaneError)
    with buf.reserve(10, 1, 60_000) as r:
        (c, page, gen), = r.publish()
        with pytest.raises(bd.WriteError):
            buf.write_chunk(10, c, page, gen, b"too short")
        with pytest.raises(bd.ReserveError):
            buf.reserve(10, 1, 60_000)
    with pytest.raises(ValueError):
        bd.RankBuffer(
            bd.KvGeometry(layers=2, kv_heads=2, head_dim=16, dtype_bytes=2, chunk_tokens=16, tp_size=2),
            pages=1,
            rank=2,
        )

"""A decode rank's server and a prefill rank's producer in two processes, over TCP and over the
rank's shared-memory export; this process plays the gateway (reserve, cancel) and the decode
engine (take, ready, consume), and checks every byte the other process wrote."""

import json
import subprocess
import sys
import textwrap

import pytest

import baton_dataplane as bd

G = bd.KvGeometry(layers=2, kv_heads=2, head_dim=16, dtype_bytes=2, chunk_tokens=16, tp_size=2)

# The producer process: connects to rank RANK at ADDR, writes the chunks it is told to, each page
# the bytes `page(request, chunk)` below, then fences; prints what it did as one JSON line.
PRODUCER = textwrap.dedent(
    """
    import json, sys
    import baton_dataplane as bd
    job = json.loads(sys.argv[1])
    g = bd.KvGeometry(**job["geometry"])
    def page(request, chunk, n):
        seed = bytes((request * 131 + chunk * 17 + i) % 251 for i in range(97))
        return (seed * (n // len(seed) + 1))[:n]
    out = {"acks": [], "refused": []}
    with bd.Producer(job["addr"], g, rank=job["rank"], shared_memory=job["shm"]) as p:
        out["shared_memory"] = p.shared_memory
        for request, chunk, pg, gen in job["writes"]:
            try:
                out["acks"].append(p.write_chunk(request, chunk, pg, gen, page(request, chunk, p.page_bytes)))
            except bd.WriteError as e:
                out["refused"].append([request, chunk, str(e)])
        for request in sorted({w[0] for w in job["writes"]}):
            p.fence(request)
    print(json.dumps(out))
    """
)


def page(request, chunk, n):
    seed = bytes((request * 131 + chunk * 17 + i) % 251 for i in range(97))
    return (seed * (n // len(seed) + 1))[:n]


def produce(server, rank, writes, shm):
    job = {
        "geometry": {"layers": 2, "kv_heads": 2, "head_dim": 16, "dtype_bytes": 2, "chunk_tokens": 16, "tp_size": 2},
        "addr": server.address,
        "rank": rank,
        "writes": writes,
        "shm": shm,
    }
    r = subprocess.run(
        [sys.executable, "-c", PRODUCER, json.dumps(job)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shared-memory"])
def test_two_processes_move_every_byte(shm):
    with bd.RankServer(G, pages=16, rank=1) as server:
        gateway = bd.Control(server.address, G, rank=1)
        plan = {10: 3, 11: 5, 12: 1}
        addrs = {rid: gateway.reserve(rid, n, 60_000) for rid, n in plan.items()}
        assert server.stats()["reserved"] == 9
        writes = [[rid, c, pg, gen] for rid, a in addrs.items() for c, pg, gen in a]
        out = produce(server, 1, writes, shm)
        assert out["shared_memory"] is shm
        assert out["acks"] == [False] * 9 and out["refused"] == []
        for rid, n in plan.items():
            r = server.take(rid)
            assert r is not None and r.chunks == n and r.is_ready()
            assert server.take(rid) is None, "a reservation is handed out once"
            with r.try_ready().consume() as c:
                for chunk in range(n):
                    assert c.read_chunk(chunk) == page(rid, chunk, G.page_bytes), (rid, chunk)
        s = server.stats()
        assert (s["free"], s["requests"], s["accounting_errors"]) == (16, 0, 0), s
        gateway.close()


def test_a_cancelled_request_refuses_the_late_writes_and_the_fence_frees_its_pages():
    with bd.RankServer(G, pages=4, rank=0, quarantine_ms=60_000) as server:
        gateway = bd.Control(server.address, G, rank=0)
        a = gateway.reserve(20, 2, 60_000)
        gateway.cancel(20)
        # Pages whose addresses were handed out stay quarantined until the producer fences.
        assert server.stats()["quarantined"] == 2
        out = produce(server, 0, [[20, c, pg, gen] for c, pg, gen in a], False)
        assert out["acks"] == [] and len(out["refused"]) == 2
        s = server.stats()
        assert (s["free"], s["quarantined"]) == (4, 0), s
        # A write to a page reused by a newer reservation names an old generation: refused.
        b = gateway.reserve(21, 4, 60_000)
        old = [[21, c, pg, gen] for (c, pg, gen) in a[:1]]
        assert all(gen_new != gen for (_, pg_new, gen_new) in b for (_, _, pg, gen) in old if pg_new == pg)
        out = produce(server, 0, old, False)
        assert len(out["refused"]) == 1
        assert server.take(21) is not None
        gateway.close()


def test_refusals_at_the_handshake_are_transport_errors():
    with bd.RankServer(G, pages=2, rank=0) as server:
        other = bd.KvGeometry(layers=3, kv_heads=2, head_dim=16, dtype_bytes=2, chunk_tokens=16, tp_size=2)
        with pytest.raises(bd.TransportError):
            bd.Producer(server.address, other, rank=0)
        with pytest.raises(bd.TransportError):
            bd.Producer(server.address, G, rank=1)
        with pytest.raises(ValueError):
            bd.Producer("not an address", G)
    assert server.closed
    with pytest.raises(bd.TransportError):
        bd.Producer(server.address, G, rank=0, timeout_ms=2_000)


def test_a_full_buffer_refuses_a_reservation_whole():
    with bd.RankServer(G, pages=3) as server:
        gateway = bd.Control(server.address, G)
        gateway.reserve(1, 2, 60_000)
        with pytest.raises(bd.ReserveError, match="need 2"):
            gateway.reserve(2, 2, 60_000)
        assert server.stats()["reserved"] == 2
        # Addresses never handed to a producer: the pages come back at once.
        gateway.cancel(1, unsent=True)
        assert server.stats()["free"] == 3


def test_events_say_each_request_ready_once_and_its_pages_released_once():
    with bd.RankServer(G, pages=8, rank=0) as server:
        events = server.events()
        gateway = bd.Control(server.address, G, rank=0)
        a = gateway.reserve(30, 2, 60_000)
        with bd.Producer(server.address, G, rank=0) as p:
            for c, pg, gen in a:
                p.write_chunk(30, c, pg, gen, page(30, c, G.page_bytes))
        assert events.next(5_000) == {
            "type": "status", "request_id": 30, "epoch": 0, "rank": 0, "state": "ready", "chunks": 2,
            "bytes": 2 * G.page_bytes,
        }
        with server.take(30).try_ready().consume():
            pass
        released = events.next(5_000)
        assert (released["type"], released["request_id"], released["pages"], released["reason"]) == (
            "released", 30, 2, "consumed",
        )
        gateway.reserve(31, 3, 60_000, epoch=2)
        gateway.cancel(31, epoch=2, unsent=True)
        got = [events.next(5_000), events.next(5_000)]
        assert [(e["type"], e["epoch"]) for e in got] == [("status", 2), ("released", 2)]
        # An unsent cancel is a cancel and a fence at once: the pages come back as fenced.
        assert got[0]["state"] == "cancelled" and got[1]["reason"] == "fenced"
        assert events.next(50) is None, "one status and one release per request, nothing more"
        gateway.close()


def test_a_killed_ranks_shared_memory_is_reclaimed_by_the_next_buffer():
    import os
    import signal

    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import sys, time
            import baton_dataplane as bd
            g = bd.KvGeometry(layers=2, kv_heads=2, head_dim=16, dtype_bytes=2, chunk_tokens=16)
            s = bd.RankServer(g, pages=4)
            print(s.buffer.export, flush=True)
            time.sleep(60)
            """
        )],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        export = child.stdout.readline().strip()
        assert export and os.path.exists(export)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert os.path.exists(export), "a killed process cannot remove its own file"
    bd.RankBuffer(G, pages=1)
    assert not os.path.exists(export), "the next buffer reclaims it"


def test_write_chunks_pipelines_a_request_and_take_ready_waits_for_it():
    import threading
    import time

    with bd.RankServer(G, pages=8, rank=0, decode_waits=True) as server:
        assert server.decode_waits
        gateway = bd.Control(server.address, G, rank=0)
        a = gateway.reserve(40, 3, 60_000)
        got = {}

        def decode():
            t = time.monotonic()
            got["ready"] = server.take_ready(40, timeout_ms=10_000)
            got["waited"] = time.monotonic() - t

        waiter = threading.Thread(target=decode)
        waiter.start()
        time.sleep(0.2)
        assert "ready" not in got, "it waits while chunks are missing"
        with bd.Producer(server.address, G, rank=0) as p:
            assert p.write_chunks(40, [(c, pg, gen, page(40, c, G.page_bytes)) for c, pg, gen in a], fence=True) == 0
            # The connection is reused after a whole request.
            b = gateway.reserve(41, 1, 60_000)
            assert p.write_chunks(41, [(c, pg, gen, page(41, c, G.page_bytes)) for c, pg, gen in b]) == 0
            # The same chunk again: the rank already had it.
            assert p.write_chunks(41, [(c, pg, gen, page(41, c, G.page_bytes)) for c, pg, gen in b], fence=True) == 1
        waiter.join(10)
        ready = got["ready"]
        assert ready is not None and ready.chunks == 3 and 0.15 < got["waited"] < 10
        with ready.consume() as c:
            for chunk in range(3):
                assert c.read_chunk(chunk) == page(40, chunk, G.page_bytes)
        assert server.take_ready(40, timeout_ms=100) is None, "taken once"
        assert server.take_ready(41, timeout_ms=1_000).chunks == 1
        gateway.close()


def test_take_ready_ends_at_a_cancel_and_at_its_timeout():
    import threading
    import time

    with bd.RankServer(G, pages=8, rank=0) as server:
        assert not server.decode_waits
        gateway = bd.Control(server.address, G, rank=0)
        assert server.take_ready(50, timeout_ms=100) is None, "never reserved"
        gateway.reserve(50, 2, 60_000)
        t = time.monotonic()
        with pytest.raises(bd.WaitTimeout):
            server.take_ready(50, timeout_ms=150)
        assert 0.1 < time.monotonic() - t < 5
        # Still reserved after a timeout: the gateway's to cancel, which ends a wait at once (a
        # wait as long as a u64 of milliseconds holds too).
        threading.Timer(0.2, lambda: gateway.cancel(50, unsent=True)).start()
        t = time.monotonic()
        with pytest.raises(bd.LeaseError, match="cancel"):
            server.take_ready(50, timeout_ms=2**64 - 1)
        assert time.monotonic() - t < 5
        # fence=True fences: a cancelled request's quarantined pages come back with it.
        gateway.reserve(52, 2, 60_000)
        gateway.cancel(52)
        assert server.stats()["quarantined"] == 2
        with bd.Producer(server.address, G, rank=0) as p:
            assert p.write_chunks(52, [], fence=True) == 0
        assert server.stats()["quarantined"] == 0
        # A refused chunk is a WriteError and the connection is closed (its answers are out of step).
        a = gateway.reserve(51, 2, 60_000)
        p = bd.Producer(server.address, G, rank=0)
        (c0, pg0, gen0), (c1, pg1, gen1) = a
        with pytest.raises(bd.WriteError):
            p.write_chunks(51, [(c0, pg0, gen0 + 1, page(51, c0, G.page_bytes)), (c1, pg1, gen1, page(51, c1, G.page_bytes))])
        assert p.closed
        assert server.stats()["accounting_errors"] == 0
        gateway.close()

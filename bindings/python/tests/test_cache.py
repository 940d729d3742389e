"""Gather and scatter between chunk pages and an engine's paged cache given as numpy arrays, checked
against numpy's own indexing of the same arrays; and the descriptions of a cache that are refused."""

import numpy as np
import pytest

import baton_dataplane as bd

# 3 layers, 4 KV heads over TP 2 (2 per rank), 8 values of 2 bytes, 16-token chunks.
G = bd.KvGeometry(layers=3, kv_heads=4, head_dim=8, dtype_bytes=2, chunk_tokens=16, tp_size=2)
BLOCKS, BS, HEADS, HD = 12, 4, 2, 8


def nhd(rng):
    return [rng.integers(0, 1 << 16, size=(2, BLOCKS, BS, HEADS, HD), dtype=np.uint16) for _ in range(G.layers)]


def token_rows(layer, order, table, first, n):
    """The cache's values of tokens first..first+n as [kv, token, head, head_dim], by numpy."""
    rows = []
    for t in range(first, first + n):
        b, s = table[t // BS], t % BS
        rows.append(layer[:, b, s, :, :] if order == "nhd" else layer[:, b, :, s, :])
    return np.stack(rows, axis=1) if rows else np.zeros((2, 0, HEADS, HD), dtype=layer.dtype)


def page_rows(page, layer, n):
    """Tokens 0..n of one layer of a chunk page as [kv, token, head, head_dim]."""
    a = np.frombuffer(page, dtype=np.uint16).reshape(G.layers, 2, G.chunk_tokens, HEADS, HD)
    return a[layer, :, :n]


def test_gather_reads_what_numpy_indexes():
    rng = np.random.default_rng(1)
    layers = nhd(rng)
    cache = bd.PagedCache(layers, order="nhd")
    assert (cache.num_layers, cache.num_blocks, cache.block_size) == (3, BLOCKS, BS)
    table = [7, 2, 11, 0, 5, 9]  # 24 tokens in six scattered blocks
    for first, n in [(0, 16), (16, 8), (3, 16), (5, 0)]:
        page = cache.gather(G, table, first, n)
        assert len(page) == G.page_bytes
        for li, layer in enumerate(layers):
            assert np.array_equal(page_rows(page, li, n), token_rows(layer, "nhd", table, first, n))
        # Bytes past the span are zero.
        a = np.frombuffer(page, dtype=np.uint16).reshape(G.layers, 2, G.chunk_tokens, HEADS, HD)
        assert not a[:, :, n:].any()


def test_scatter_writes_what_gather_read_across_layouts_and_views():
    src_arrays = nhd(np.random.default_rng(2))
    src = bd.PagedCache(src_arrays, order="nhd")
    # The decoder's cache is head-major, and each layer a strided view into one larger array.
    big = np.zeros((G.layers, 2, BLOCKS, HEADS, BS * 2, HD), dtype=np.uint16)
    dst_layers = [big[i, :, :, :, ::2, :] for i in range(G.layers)]
    dst = bd.PagedCache(dst_layers, order="hnd")
    src_table, dst_table = [1, 3, 5, 7], [10, 0, 4, 8]
    buf = bd.RankBuffer(G, pages=4)
    with buf.reserve(1, 1, 60_000) as r:
        (c, page, gen), = r.publish()
        buf.write_chunk(1, c, page, gen, src.gather(G, src_table, 0, 13))
        with r.try_ready() as ready, ready.consume() as consuming:
            consuming.scatter_chunk(0, dst, dst_table, 0, 13)
    assert buf.stats()["free"] == 4
    # Compare through numpy: every scattered token equals its source, nothing else was touched.
    for li in range(G.layers):
        got = token_rows(dst_layers[li], "hnd", dst_table, 0, 13)
        assert np.array_equal(got, token_rows(src_arrays[li], "nhd", src_table, 0, 13))
    # Clear what the span covers: nothing else was written (the view's skipped rows included).
    for view in dst_layers:
        for t in range(13):
            view[:, dst_table[t // BS], :, t % BS, :] = 0
    assert not big.any(), "bytes outside the span were written"


def test_descriptions_and_spans_that_would_leave_the_arrays_are_refused():
    rng = np.random.default_rng(3)
    layers = nhd(rng)
    cache = bd.PagedCache(layers)
    with pytest.raises(bd.DeviceError, match="block 12 out of range"):
        cache.gather(G, [0, 12], 0, 8)
    with pytest.raises(bd.DeviceError, match="block table has 1 blocks"):
        cache.gather(G, [0], 0, 8)
    with pytest.raises(bd.DeviceError, match="exceeds chunk"):
        cache.gather(G, list(range(BLOCKS)), 0, 17)
    with pytest.raises(ValueError, match="shape"):
        bd.PagedCache([np.zeros((2, 4, 4, 8), dtype=np.uint16)])
    with pytest.raises(ValueError, match="order"):
        bd.PagedCache(layers, order="thd")
    with pytest.raises(ValueError, match="differs"):
        bd.PagedCache([layers[0], layers[1].astype(np.uint32)])
    with pytest.raises(ValueError, match="contiguous"):
        bd.PagedCache([np.zeros((2, 4, 4, 2, 16), dtype=np.uint16)[..., ::2]])
    with pytest.raises(TypeError):
        bd.PagedCache([b"not an array"])
    # A cache of other head sizes than the geometry's is refused before any byte moves.
    other = bd.PagedCache([np.zeros((2, 4, 4, 2, 4), dtype=np.uint16)] * 3)
    with pytest.raises(bd.DeviceError, match="heads of"):
        other.gather(G, [0], 0, 1)
    # A read-only cache can be gathered from, never scattered into.
    ro = [a.copy() for a in layers]
    for a in ro:
        a.setflags(write=False)
    ro_cache = bd.PagedCache(ro)
    ro_cache.gather(G, [0], 0, 1)
    buf = bd.RankBuffer(G, pages=1)
    with buf.reserve(2, 1, 60_000) as r:
        (c, page, gen), = r.publish()
        buf.write_chunk(2, c, page, gen, bytes(G.page_bytes))
        with r.try_ready().consume() as consuming:
            with pytest.raises(bd.DeviceError, match="read-only"):
                consuming.scatter_chunk(0, ro_cache, [0], 0, 1)
            before = [a.copy() for a in layers]
            with pytest.raises(bd.DeviceError, match="layers"):
                consuming.scatter_chunk(0, bd.PagedCache(layers[:2]), [0], 0, 1)
            assert all(np.array_equal(a, b) for a, b in zip(layers, before))
    assert buf.stats()["free"] == 1


def test_the_arrays_live_as_long_as_the_cache():
    cache = bd.PagedCache([np.ones((2, 2, 4, 2, 8), dtype=np.uint16) for _ in range(3)])
    import gc

    gc.collect()
    page = cache.gather(G, [1], 0, 4)
    assert np.frombuffer(page, dtype=np.uint16).reshape(3, 2, 16, 2, 8)[:, :, :4].all()

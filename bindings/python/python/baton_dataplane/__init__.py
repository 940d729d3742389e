"""baton's PD data plane, for engine ranks written in Python.

A rank's paged PD buffer (:class:`RankBuffer`) hands out guards, one per state of a request:
:class:`Reservation` (pages held while chunks arrive), :class:`Ready` (every chunk in),
:class:`Consuming` (the engine moving the pages into its cache). Each releases what it holds when
it is closed, when its ``with`` block ends, or when it is garbage-collected: exactly once.
Errors are :class:`DataPlaneError` and its subclasses, named as in the Rust crate.

Over the network: a decode rank serves its buffer with :class:`RankServer` (the gateway reserves
through it, prefill ranks write into it, the engine ``take``s each request's reservation); a prefill
rank writes chunks with a :class:`Producer` (over TCP, or into the rank's shared-memory export on
the same host). :class:`PagedCache` describes an engine's paged KV cache (numpy arrays, one per
layer) for ``PagedCache.gather`` (prefill) and ``Consuming.scatter_chunk`` (decode).
:class:`KvGeometry` is the shape every side agrees on. ``docs/engines.md`` has the calls in order.
"""

from ._native import (
    Consuming,
    Control,
    DataPlaneError,
    DeviceError,
    Events,
    GuardClosed,
    KvGeometry,
    LeaseError,
    PagedCache,
    Producer,
    RankBuffer,
    RankServer,
    Ready,
    Reservation,
    ReserveError,
    TransportError,
    WaitTimeout,
    WriteError,
)

__all__ = [
    "Consuming",
    "Control",
    "DataPlaneError",
    "DeviceError",
    "Events",
    "GuardClosed",
    "KvGeometry",
    "LeaseError",
    "PagedCache",
    "Producer",
    "RankBuffer",
    "RankServer",
    "Ready",
    "Reservation",
    "ReserveError",
    "TransportError",
    "WaitTimeout",
    "WriteError",
]

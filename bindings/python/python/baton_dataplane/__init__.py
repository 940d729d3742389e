"""baton's PD data plane, for engine ranks written in Python.

A rank's paged PD buffer (:class:`RankBuffer`) hands out guards, one per state of a request:
:class:`Reservation` (pages held while chunks arrive), :class:`Ready` (every chunk in),
:class:`Consuming` (the engine moving the pages into its cache). Each releases what it holds when
it is closed, when its ``with`` block ends, or when it is garbage-collected: exactly once.
Errors are :class:`DataPlaneError` and its subclasses, named as in the Rust crate.
"""

from ._native import (
    Consuming,
    DataPlaneError,
    DeviceError,
    GuardClosed,
    LeaseError,
    RankBuffer,
    Ready,
    Reservation,
    ReserveError,
    WriteError,
)

__all__ = [
    "Consuming",
    "DataPlaneError",
    "DeviceError",
    "GuardClosed",
    "LeaseError",
    "RankBuffer",
    "Ready",
    "Reservation",
    "ReserveError",
    "WriteError",
]

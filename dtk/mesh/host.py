"""Reads of host tensors that wait for no device.

On a GPU, reading a device value into Python (`.item()`, `.tolist()`) waits for all the
work queued before it. Some reads are of host tensors instead - a vote on a gloo group, a
copy to pinned memory that has arrived - and wait for nothing. They run inside
`host_only()`, which says so to a reader of the code and to the test that counts the
training loop's host-device syncs (tests/test_host_syncs.py), which leaves them out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_HOST = threading.local()


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    """Marks reads of host tensors (a gloo vote, an arrived pinned copy): no device wait."""
    _HOST.depth = getattr(_HOST, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST.depth -= 1


def in_host_only() -> bool:
    return getattr(_HOST, "depth", 0) > 0

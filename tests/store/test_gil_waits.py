"""A host-store call lets the GIL go, and waits, only where it must (issue
20): in a server the backup and prefetch threads share the GIL with a busy
scheduler thread, and every release may cost up to the 5 ms switch
interval to get it back. Counted with the bench's own harness
(``tools/bench/backup_gil``) on a store in its own process."""

from __future__ import annotations

import socket

import pytest

from sglang_simm.tools.bench.backup_gil import Counts, CountingSocket

pytestmark = pytest.mark.host


def test_the_counting_socket_counts_a_reply_read_in_pieces_as_one_wait():
    a, b = socket.socketpair()
    try:
        counts = Counts()
        sock = CountingSocket(a, counts)
        sock.sendall(b"request")
        b.sendall(b"rep")
        assert sock.recv(3) == b"rep"
        b.sendall(b"ly")
        assert sock.recv(2) == b"ly"
        assert (counts.releases, counts.waits) == (3, 1)  # a send, two receives; one reply waited for
        b.sendall(b"unasked")
        assert sock.recv(16) == b"unasked"  # nothing was asked since: no wait
        assert (counts.releases, counts.waits) == (4, 1)
        sock.sent_held()  # a request sent holding the GIL: its reply is still waited for
        b.sendall(b"x")
        sock.recv(1)
        assert (counts.releases, counts.waits) == (5, 2)
    finally:
        a.close()
        b.close()

"""Subscribers of SGLang KV event streams, for the tests and the bench.

:class:`Subscriber` reads a stream on a thread of its own and decodes every
message with SGLang's own classes (``KVEventBatch`` through msgspec, as
SGLang's publisher encodes it), keeping ``(topic, seq, batch)``: it is the
consumer that is not ours, reduced to what a router's reader does.
:class:`StalledSubscriber` connects and never reads: ZMQ queues up to the
publisher's high-water mark for it and then drops, which is what a router
that hangs looks like to a publisher.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Received", "StalledSubscriber", "Subscriber", "links", "local_endpoint", "replay"]


def local_endpoint(endpoint: str) -> str:
    """Where a subscriber on this host connects for a publisher's endpoint:
    the wildcard hosts (``*``, ``0.0.0.0``) become 127.0.0.1."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint


def links(events: Any) -> dict[int, int | None]:
    """block hash -> parent hash over ``BlockStored`` events, in order,
    whether an event holds one page or a chain of them (SGLang's recorder
    merges a chain into one event)."""
    out: dict[int, int | None] = {}
    for e in events:
        parent = e.parent_block_hash
        for h in e.block_hashes:
            out[h] = parent
            parent = h
    return out


@dataclass(frozen=True)
class Received:
    topic: bytes
    seq: int
    batch: Any  # sglang.srt.disaggregation.kv_events.KVEventBatch


class Subscriber:
    """A SUB socket on ``endpoint`` (a publisher's, wildcards allowed),
    every message decoded and kept, in arrival order, until ``close()``."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        self.endpoint = local_endpoint(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.endpoint)
        self._lock = threading.Lock()
        self._received: list[Received] = []
        self.undecodable = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-subscriber", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            topic, seq, payload = self._socket.recv_multipart()
            try:
                batch = self._decoder.decode(payload)
            except Exception:
                self.undecodable += 1
                continue
            with self._lock:
                self._received.append(Received(topic, int.from_bytes(seq, "big"), batch))

    @property
    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def events(self, kind: str | None = None, medium: str | None = None) -> list[Any]:
        """Every event received so far, in order; ``kind``: the class name
        (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); ``medium``:
        its medium's value (``GPU``, ``CPU_PINNED``, ``EXTERNAL``, ...)."""
        out = []
        for r in self.received:
            for e in r.batch.events:
                if kind is not None and type(e).__name__ != kind:
                    continue
                if medium is not None and getattr(getattr(e, "medium", None), "value", getattr(e, "medium", None)) != medium:
                    continue
                out.append(e)
        return out

    def wait_for(self, done: Callable[[Subscriber], bool], timeout: float = 60.0) -> bool:
        """Poll ``done(self)`` until it holds or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done(self):
                return True
            time.sleep(0.05)
        return done(self)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)


class StalledSubscriber:
    """A SUB socket that connects to ``endpoint`` and never reads (its
    receive high-water mark ``rcvhwm`` messages), until ``close()``."""

    def __init__(self, endpoint: str, rcvhwm: int = 10) -> None:
        import zmq

        self.endpoint = local_endpoint(endpoint)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.endpoint)

    def close(self) -> None:
        self._socket.close(linger=0)


def replay(endpoint: str, start_seq: int, timeout_s: float = 10.0) -> list[Received]:
    """Ask a publisher's replay endpoint (SGLang's ROUTER) for every batch
    from ``start_seq`` on, as SGLang's protocol has it: an 8-byte big-endian
    start (after the empty delimiter frame), answered by ``(topic, seq,
    payload)`` messages and an end marker whose sequence is -1."""
    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    # DEALER, not REQ: the ROUTER answers one request with many messages
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.connect(local_endpoint(endpoint))
    out = []
    try:
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        while True:
            _empty, topic, seq, payload = sock.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return out
            out.append(Received(topic, number, decoder.decode(payload)))
    finally:
        sock.close(linger=0)

"""The ``kv_events`` setting, in the shape of SGLang's ``--kv-events-config``
(``KVEventsConfig``): the same keys with the same meaning, plus ``medium``
and ``remember_pages``. Standard library only, so ``import
sglang_simm.config`` stays cheap. Where it differs from SGLang's, and why
(unknown keys refused, port 5570, a queue that drops, lower ``hwm`` and
``buffer_steps``): docs/kv-events.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sglang_simm.values import InvalidValue, parse_bool

__all__ = ["DEFAULT_ENDPOINT", "MEDIA", "KVEventsSettings", "parse_kv_events"]

#: where the plugin publishes unless told: not SGLang's 5557 (nor its
#: conventional replay port 5558), so both streams can be on with defaults
DEFAULT_ENDPOINT = "tcp://*:5570"

#: ``medium`` choices: ``auto`` picks by where L3 lives (``events_publisher.medium_of``);
#: the others are SGLang's ``StorageMedium`` values for a tier below the host
#: pool. GPU and CPU_PINNED are SGLang's own L1 and L2: announcing L3 pages
#: under them would let SGLang's removals from those tiers cancel ours.
MEDIA = ("auto", "EXTERNAL", "DISK")

_PUBLISHERS = ("null", "zmq")
_FORMATS = ("default", "dynamo")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsSettings:
    """One server's L3 event stream (the ``kv_events`` config field)."""

    publisher: str = "null"
    """``zmq`` publishes; ``null`` (SGLang's default too) publishes nothing."""

    endpoint: str = DEFAULT_ENDPOINT
    """The PUB socket's address: a wildcard host or ``ipc://``/``inproc://``
    binds, a concrete host connects (unless ``bind`` says otherwise), as
    SGLang's; DP rank r publishes on PORT + r."""

    bind: bool | None = None
    """Bind (true) or connect (false) the PUB socket; unset: by the endpoint."""

    replay_endpoint: str | None = None
    """A ROUTER address where a subscriber asks for missed batches by
    sequence number (SGLang's replay protocol); unset: no replay."""

    buffer_steps: int = 1000
    """Batches kept for replay (only with ``replay_endpoint``)."""

    hwm: int = 10_000
    """ZMQ's high-water mark per subscriber, in batches: past it, ZMQ drops
    that subscriber's batches silently (a stopped subscriber costs at most this)."""

    max_queue_size: int = 65_536
    """Pages waiting to be published, at most; past it new events are
    dropped and counted (``sglang_simm:kv_events_dropped_pages_total``)."""

    topic: str = ""
    """The topic frame of every message (SGLang's first frame)."""

    format: str = "default"
    """SGLang's ``format`` (``default`` or ``dynamo``): both give the same
    hashes here (docs/kv-events.md)."""

    medium: str = "auto"
    """The ``medium`` of every event: ``EXTERNAL``, ``DISK`` or ``auto``
    (``events_publisher.medium_of``)."""

    remember_pages: int = 65_536
    """Pages announced as stored that this server remembers, so that a
    lookup or read that misses one announces its removal. Past it, the
    oldest is announced removed and forgotten."""

    @property
    def enabled(self) -> bool:
        return self.publisher != "null"

    def sglang_config(self, *, inner_queue: int) -> dict[str, Any]:
        """The keys SGLang's ``KVEventsConfig`` reads, for its publisher
        factory. ``inner_queue`` bounds SGLang's own queue of batches,
        which sits behind ours; ``buffer_steps`` is 1 without a replay
        endpoint (SGLang keeps the buffer whether or not anyone can ask)."""
        out = {
            "publisher": self.publisher, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps if self.replay_endpoint else 1, "hwm": self.hwm,
            "max_queue_size": inner_queue, "topic": self.topic, "format": self.format,
        }
        if self.bind is not None:  # a key SGLang 0.5.23 has and older releases lack
            out["bind"] = self.bind
        return out


_KEYS = tuple(f.name for f in dataclasses.fields(KVEventsSettings))

_ACCEPTED = (
    'a JSON object shaped like SGLang\'s --kv-events-config, e.g. {"publisher": "zmq", '
    f'"endpoint": "{DEFAULT_ENDPOINT}", "topic": "l3"}}; keys: {", ".join(_KEYS)}; or null (off)'
)


def parse_kv_events(value: Any) -> KVEventsSettings | None:
    """A dict, its JSON text or settings already built -> the settings; None
    or an empty text: off."""
    if value is None or isinstance(value, KVEventsSettings):
        return value
    data = value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidValue(f"is not valid JSON ({exc})", _ACCEPTED) from None
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise InvalidValue(f"is not an object ({type(data).__name__})", _ACCEPTED)
    unknown = [k for k in data if k not in _KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), _KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidValue(f"has the unknown key {unknown[0]!r}{hint}", _ACCEPTED)
    out: dict[str, Any] = {}
    for key, raw in data.items():
        try:
            out[key] = _PARSERS[key](raw)
        except InvalidValue as exc:
            raise InvalidValue(f"has {key}={raw!r}, which {exc.problem}", exc.accepted) from None
    return KVEventsSettings(**out)


def _choice(choices: tuple[str, ...], *, upper: bool = False):
    def parse(value: Any) -> str:
        if isinstance(value, str):
            text = value.strip().upper() if upper else value.strip().lower()
            for choice in choices:
                if text == (choice.upper() if upper else choice):
                    return choice
        raise InvalidValue("is not one of the choices", " or ".join(repr(c) for c in choices))
    return parse


def _count(lo: int, hi: int):
    def parse(value: Any) -> int:
        accepted = f"an integer in {lo}..{hi}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidValue("is not an integer", accepted)
        if not lo <= value <= hi:
            raise InvalidValue("is out of range", accepted)
        return value
    return parse


def _endpoint(value: Any) -> str:
    accepted = "a ZeroMQ address: tcp://*:PORT (binds), tcp://HOST:PORT (connects), ipc://PATH or inproc://NAME"
    if not isinstance(value, str) or not value.strip().startswith(_SCHEMES):
        raise InvalidValue("is not a ZeroMQ address", accepted)
    text = value.strip()
    if text.startswith("tcp://"):
        port = text.rpartition(":")[2]
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidValue("has no port in 1..65535 after its last ':'", accepted)
    return text


def _optional(parse):
    return lambda value: None if value is None else parse(value)


def _topic(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidValue("is not a string", "a string (the first frame of every message), e.g. \"l3\"")
    return value


_PARSERS = {
    "publisher": _choice(_PUBLISHERS),
    "endpoint": _endpoint,
    "bind": _optional(parse_bool),
    "replay_endpoint": _optional(_endpoint),
    "buffer_steps": _count(1, 1_000_000),
    "hwm": _count(1, 10_000_000),
    "max_queue_size": _count(1, 10_000_000),
    "topic": _topic,
    "format": _choice(_FORMATS),
    "medium": _choice(MEDIA, upper=True),
    "remember_pages": _count(0, 100_000_000),
}
assert set(_PARSERS) == set(_KEYS), "every kv_events key needs a parser"

"""A server's L3 event stream, built: which rank publishes (one per server,
as SGLang's own stream), on which port, under which medium, through SGLang's
own publisher (``EventPublisherFactory``, so topic, sequence numbers,
replay and high-water mark are SGLang's code). The rules and why:
docs/kv-events.md, "The medium", "One publisher per server" and "The
transport: SGLang's own".
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from sglang_simm.events import NO_EVENTS, L3Events, NoEvents
from sglang_simm.events_config import KVEventsSettings

__all__ = ["INNER_QUEUE", "events_for", "medium_of", "publisher_slot"]

logger = logging.getLogger("sglang_simm.events")

#: batches SGLang's publisher may queue behind ours: its ``publish`` blocks
#: when full, which only ever holds our publishing thread, and ours is the
#: queue that counts what it drops
INNER_QUEUE = 16

#: how long a bind may find the port still held by the publisher of a
#: backend this process just closed (SGLang detached and attached again)
BIND_RETRY_S = 2.0


def events_for(storage_config: Any, config: Any) -> NoEvents:
    """The backend's event stream: ``L3Events`` on the publishing rank when
    ``kv_events`` is on, else ``NO_EVENTS``. Raises (failing the attach)
    when SGLang has no KV events or the endpoint cannot be bound."""
    settings: KVEventsSettings | None = config.kv_events
    if settings is None or not settings.enabled:
        return NO_EVENTS
    slot = publisher_slot(storage_config)
    if slot is None:
        return NO_EVENTS
    publisher, endpoint = open_publisher(settings, slot)  # first: it says what an SGLang without KV events lacks
    from sglang.srt.disaggregation.kv_events import StorageMedium

    medium = StorageMedium(medium_of(settings, config))
    events = L3Events(publisher, medium=medium, max_queue_pages=settings.max_queue_size,
                      remember_pages=settings.remember_pages)
    logger.info("sglang-simm kv_events: announcing L3 pages as medium %s on %s (topic %r%s), at most %d pages "
                "queued, %d remembered", getattr(medium, "value", medium), endpoint, settings.topic,
                f", replay on {settings.replay_endpoint}" if settings.replay_endpoint else "",
                settings.max_queue_size, settings.remember_pages)
    return events


def publisher_slot(storage_config: Any) -> int | None:
    """This scheduler's port offset if it publishes, else None. The storage
    config's ``tp_rank`` is the attention-TP rank under DP attention and the
    TP rank otherwise: 0 on exactly the ranks SGLang publishes from."""
    for name in ("tp_rank", "pp_rank", "attn_cp_rank"):
        if int(getattr(storage_config, name, 0) or 0) != 0:
            return None
    try:  # SGLang 0.5.23: the DP index its own publisher takes
        from sglang.srt.disaggregation.kv_events import select_kv_publisher_dp_rank
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return int(select_kv_publisher_dp_rank(parallel.attn_dp_size, parallel.attn_dp_rank, parallel.dp_rank))
    except Exception:  # older releases: the attention-DP rank, as their schedulers passed
        return int(getattr(storage_config, "dp_rank", 0) or 0)


def medium_of(settings: KVEventsSettings, config: Any) -> str:
    """``settings.medium``, or where L3 lives when it is ``auto``."""
    if settings.medium != "auto":
        return settings.medium
    if not config.is_local_store or config.local_store_scope == "process":
        return "EXTERNAL"  # a SiMM cluster; the in-process store is this process's memory
    from sglang_simm.config import local_store_place
    from sglang_simm.local_store.admin import medium_of as store_medium

    return "DISK" if store_medium(local_store_place(config)[0]) == "disk" else "EXTERNAL"


def open_publisher(settings: KVEventsSettings, slot: int) -> tuple[Any, str]:
    """SGLang's publisher for ``settings`` at DP index ``slot``, and the
    endpoint it serves."""
    try:
        from sglang.srt.disaggregation.kv_events import EventPublisherFactory, ZmqEventPublisher
    except ImportError as exc:
        raise RuntimeError(
            f"kv_events needs SGLang's KV events (sglang.srt.disaggregation.kv_events), which this SGLang "
            f"lacks ({exc}); remove kv_events from the extra config or upgrade SGLang") from exc
    endpoint = ZmqEventPublisher.offset_endpoint_port(settings.endpoint, slot) or settings.endpoint
    text = json.dumps(settings.sglang_config(inner_queue=INNER_QUEUE))
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return EventPublisherFactory.create(text, slot), endpoint
        except Exception as exc:  # zmq.ZMQError; SGLang's own exceptions
            if "in use" in str(exc) and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            raise RuntimeError(
                f"kv_events: cannot open the publisher on {endpoint} ({type(exc).__name__}: {exc}); "
                f"give kv_events an endpoint no other socket holds (not --kv-events-config's, nor its "
                f"replay port: DP rank r adds r to the port)") from exc

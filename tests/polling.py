"""Waiting in tests for what another thread or process does: poll a
condition until it holds, with a deadline that fails the test naming what
it waited for. No test asserts a time: the deadline only bounds a hang."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def until(predicate: Callable[[], T], what: str, timeout: float = 30.0, every: float = 0.01,
          why: Callable[[], str] = lambda: "") -> T:
    """``predicate()``'s first true value, polled every ``every`` seconds;
    AssertionError naming ``what`` (and ``why()``, the story so far) once
    ``timeout`` seconds pass without one."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{why()}")
        time.sleep(every)

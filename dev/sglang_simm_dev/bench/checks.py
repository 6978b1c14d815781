"""What the bench verified of every backend's results, so a fast wrong answer never counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Checks:
    """Every result the bench verified: ``what`` -> ok, with a detail on failure."""

    items: dict[str, bool] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def expect(self, what: str, ok: bool, detail: str = "") -> None:
        self.items[what] = self.items.get(what, True) and bool(ok)
        if not ok:
            self.failures.append(f"{what}: {detail}" if detail else what)

    @property
    def ok(self) -> bool:
        return not self.failures


def check_result(checks: Checks, what: str, op: str, result: Any, n: int) -> None:
    if op == "exists":
        checks.expect(what, result == n, f"batch_exists answered {result}, expected {n}")
    else:
        good = isinstance(result, list) and len(result) == n and all(result)
        checks.expect(what, good, f"{sum(bool(x) for x in result or [])}/{n} pages True")

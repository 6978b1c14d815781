"""``pytest benchmarks`` needs pytest-benchmark: say so and stop, rather
than skip every benchmark without a word."""

from __future__ import annotations

import pytest

INSTALL_HINT = (
    "pytest benchmarks needs the pytest-benchmark plugin: pip install -e './dev[bench]' "
    "(or pip install pytest-benchmark), then run: pytest benchmarks"
)


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("benchmark"):
        raise pytest.UsageError(INSTALL_HINT)

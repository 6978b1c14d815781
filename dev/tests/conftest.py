"""The instruments' own tests run on the suite's fixtures and hooks
(``tests/suite.py``: the session's store directory, the client's flags
restored after each test, ``store_name``, ``attach``, the tiers by file and
the longest files first), loaded once with ``tests/``'s when a run collects
both, and on its helpers (``tests/pages.py``)."""

import os
import sys

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

pytest_plugins = ["suite"]

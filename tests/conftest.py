"""The suite's fixtures and hooks are a plugin of their own (``suite.py``),
shared with the instruments' tests in ``dev/tests``: loaded once, whichever
of the two trees a run collects."""

pytest_plugins = ["suite"]

"""The instruments of sglang-simm, run from a clone: the demo, the bench, and
what runs SGLang on a CPU for them and for the tests (CPU stand-ins, the CPU
server launcher, tiny models, host pools, the compat probe, the null client).

Not part of the ``sglang-simm`` wheel: ``dev/`` is a project of its own
(``dev/pyproject.toml``), installed editable by ``scripts/test.sh`` and
``scripts/demo.sh`` into the test venv. It imports the plugin; the plugin
never imports it (``tests/test_layout.py``).
"""

__version__ = "0.1.0"

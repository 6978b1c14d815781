"""``python -m sglang_simm_dev``: the ``sglang-simm-dev`` command (``sglang_simm_dev.cli``)."""

import sys

from sglang_simm_dev.cli import main

sys.exit(main())

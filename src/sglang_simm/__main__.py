"""``python -m sglang_simm``: the ``sglang-simm`` command (``sglang_simm.tools.cli``)."""

import sys

from sglang_simm.tools.cli import main

sys.exit(main())

import sys

from sglang_simm.cli import main

sys.exit(main())

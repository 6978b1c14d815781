"""Deprecated: the local store is ``sglang_simm.local_store`` (this name is
read until the next minor release)."""

import sys
import warnings

from sglang_simm import local_store

warnings.warn("sglang_simm.embedded is deprecated: import sglang_simm.local_store (the old name is read until "
              "the next minor release)", FutureWarning, stacklevel=2)
sys.modules[__name__] = local_store

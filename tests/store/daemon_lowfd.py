"""The store process under a hard descriptor limit it cannot raise, with
``max_connections`` above what that limit allows: accept() itself runs out
of descriptors (EMFILE), as under systemd's default of 1024."""

import resource
import sys

from sglang_simm.local_store import _server

n = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
_server._fd_limit = lambda: 1 << 20  # let max_connections stand: the kernel's limit is what is hit
sys.exit(_server.main(sys.argv[2:]))

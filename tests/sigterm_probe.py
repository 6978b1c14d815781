"""Run by ``test_server_launch``'s SIGTERM test only (not collected: no ``test_``
prefix): opens a local store in the session's store directory, says so, and
waits to be signalled."""

import os
import time


def test_waits_with_a_host_store_open():
    from sglang_simm.local_store._handle import StoreHandle

    root = os.environ["SGLANG_SIMM_STORE_DIR"]
    store = StoreHandle("sigterm-probe", root=root, capacity=1 << 20)
    store.open()
    print(f"READY {root} {store.pid}", flush=True)
    time.sleep(600)

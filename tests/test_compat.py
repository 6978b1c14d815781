"""Older SGLang releases, each in its own virtual environment (scripts/test.sh
builds them and names their pythons in SGLANG_SIMM_COMPAT_PYTHONS): the
installed wheel, both routes where the release has them, MHA and MLA pages
round-tripped through SGLang's factory, v2 where it exists, and every pool
stack of ``sglang_simm_dev.hybrid_pools`` the release can build
(``sglang_simm_dev.compat_probe``, the check scripts/compat.sh runs on every
release).

The probes are started when collection ends (tests/suite.py calls
``start_probes``), so they run beside the rest of the suite; each test waits
for its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile

import pytest

PYTHONS = os.environ.get("SGLANG_SIMM_COMPAT_PYTHONS", "").split()
#: an upper bound on one probe (it takes 1-3 minutes on 2 loaded cores)
PROBE_TIMEOUT_S = 1200

_probes: dict[str, tuple[subprocess.Popen, str]] = {}
_store_dir: list[str] = []


def start_probes() -> None:
    """One probe process per release, each writing to files of its own."""
    if _probes or not PYTHONS:
        return
    root = tempfile.mkdtemp(prefix="sglang-simm-compat-")
    os.chmod(root, 0o700)
    _store_dir.append(root)
    for i, python in enumerate(PYTHONS):
        out = os.path.join(root, f"probe-{i}.out")
        with open(out, "w") as stdout, open(out + ".err", "w") as stderr:
            proc = subprocess.Popen(
                [python, "-W", "ignore", "-m", "sglang_simm_dev.compat_probe"],
                stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                env={**os.environ, "SGLANG_SIMM_STORE_DIR": root},
            )
        _probes[python] = (proc, out)


def stop_probes() -> None:
    """Ends probes still running and the store processes they left."""
    for proc, _out in _probes.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for root in _store_dir:
        for entry in os.listdir(root):
            if entry.endswith(".pid"):
                try:
                    with open(os.path.join(root, entry)) as f:
                        os.kill(int(f.read().strip()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
        shutil.rmtree(root, ignore_errors=True)
    _probes.clear()
    _store_dir.clear()


@pytest.mark.skipif(not PYTHONS, reason="SGLANG_SIMM_COMPAT_PYTHONS is not set (scripts/test.sh sets it)")
@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: p.split("/")[-3] if p.count("/") > 2 else p)
def test_older_release_round_trips_pages_through_sglangs_factory(python):
    from sglang_simm_dev.compat_probe import PLUGINS_SINCE, failures

    start_probes()  # a no-op when collection started them
    proc, out = _probes[python]
    returncode = proc.wait(timeout=PROBE_TIMEOUT_S)
    with open(out) as f, open(out + ".err") as e:
        stdout, stderr = f.read(), e.read()
    assert returncode == 0, stderr[-4000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert "site-packages" in result["package"], "the compat venv must run the installed wheel"
    assert failures(result) == [], failures(result)
    assert "dynamic-mha" in result and "dynamic-mla" in result
    release = tuple(int(x) for x in result["sglang"].split(".")[:3])
    if release >= PLUGINS_SINCE:  # plugin entry points: load_plugins() made `simm` ours
        assert "simm-mha" in result and "simm-mla" in result
    # every stack, round-tripped where the release builds it (failures() holds
    # those to their bytes), else skipped naming what the release lacks
    from sglang_simm_dev.hybrid_pools import STACKS

    assert list(result["pools"]) == [*STACKS, "mxfp8"]
    for label, r in result["pools"].items():
        assert set(r) in ({"skipped"}, {"stored", "bytes_equal", "kv_hit"}, {"refused"}), (label, r)

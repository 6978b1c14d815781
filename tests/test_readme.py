"""What the README promises a newcomer stays true of the code: the venvs the
full suite builds, where the demo keeps its model and its server's log,
the rows of the demo's table, and how to run a server for ``doctor --server``."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_names_every_venv_the_full_suite_builds():
    script = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    versions = re.search(r"COMPAT_SGLANGS=\(([^)]*)\)", script).group(1).replace('"', "").split()
    assert versions
    for version in versions:
        assert f".venv-sglang-{version}" in README, version


def test_the_readme_says_where_the_demo_keeps_its_model_and_its_servers_log(monkeypatch):
    from sglang_simm_dev import server_demo

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    home = os.path.expanduser("~")
    folder = server_demo._default_workdir()
    models = os.path.dirname(server_demo._default_model_dir("llama-demo", 0))
    for path in (folder, os.path.join(folder, "demo-server.log"), models):
        assert path.startswith(home + os.sep)
        assert "~" + path[len(home):] in README, path


def test_the_readmes_demo_table_has_the_demos_rows_in_its_order():
    from sglang_simm_dev.server_demo import TIERS

    [table] = [b for b in re.findall(r"```text\n(.*?)```", README, re.S) if "TTFT ms" in b]
    tiers = [tier for line in table.splitlines() for tier in TIERS if tier in line]
    assert tiers == list(TIERS)


def test_the_readme_shows_a_server_to_run_for_doctor_server_and_the_demo_takes_its_flags():
    from sglang_simm_dev import cli

    line = next(li for li in README.splitlines() if "sglang-simm-dev demo" in li and "--keep-running" in li)
    argv = line.split("#")[0].split()[1:]  # the command after the program's path
    args = cli.build_parser().parse_args(argv)
    assert args.server and args.keep_running
    assert "sglang-simm doctor --server http://127.0.0.1:PORT" in README

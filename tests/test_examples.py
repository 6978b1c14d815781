"""The shipped examples carry configurations that validate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sglang_simm.config import load_config
from sglang_simm.tools.doctor import RECOMMENDED

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _launched_argv(script: str, tmp_path) -> list[str]:
    """What ``script`` hands ``python``: run with a stand-in ``python`` on
    PATH that writes its arguments down."""
    import os
    import subprocess
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "json.dump(sys.argv[1:], open(os.environ['ARGV_OUT'], 'w'))\n")
    fake.chmod(0o755)
    out = tmp_path / "argv.json"
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "ARGV_OUT": str(out)}
    subprocess.run(["bash", str(EXAMPLES / script)], env=env, check=True, timeout=60)
    return json.loads(out.read_text())


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("launch_*.sh")))
def test_launch_scripts_give_sglang_valid_flags_the_recommended_settings_and_a_valid_config(script, tmp_path):
    import argparse

    server_args = pytest.importorskip("sglang.srt.server_args")
    argv = _launched_argv(script, tmp_path)
    assert argv[:2] == ["-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv[2:])  # SGLang's own parser: every flag and choice exists
    for flag, _why in RECOMMENDED:
        name, value = flag.removeprefix("--").replace("-", "_").split(" ")
        assert str(getattr(args, name)) in (value, f"{value}.0"), (flag, getattr(args, name))
    raw = args.hicache_storage_backend_extra_config
    extra = json.loads(Path(raw[1:]).read_text() if raw.startswith("@") else raw)
    resolved = load_config(extra, environ={})
    assert resolved.config.manager_address == "10.0.0.1:30001"
    if args.hicache_storage_backend == "dynamic":
        assert extra["interface_v1"] == 1 and extra["module_path"] == "sglang_simm"


def _flags_of_engine_example() -> dict[str, object]:
    import ast

    tree = ast.parse((EXAMPLES / "engine.py").read_text())
    [call] = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "Engine"]
    return {kw.arg: kw.value.value for kw in call.keywords if isinstance(kw.value, ast.Constant)}


def test_the_engine_example_carries_the_recommended_settings():
    kwargs = _flags_of_engine_example()
    for flag, _why in RECOMMENDED:
        name, value = flag.removeprefix("--").replace("-", "_").split(" ")
        assert str(kwargs.get(name)) == value, (name, kwargs)


def test_every_launch_line_of_the_readme_carries_the_recommended_settings_and_says_what_the_ratio_needs():
    readme = (EXAMPLES.parent / "README.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "sglang.launch_server" in b]
    assert len(blocks) >= 2
    for block in blocks:
        for flag, _why in RECOMMENDED:
            assert flag in block, (flag, block)
        comments = " ".join(line for line in block.splitlines() if line.lstrip().startswith("#"))
        assert "--hicache-ratio 2" in comments and "host memory" in comments, block


def test_config_file_through_the_env_var(monkeypatch):
    env = {"SGLANG_HICACHE_SIMM_CONFIG_PATH": str(EXAMPLES / "simm-config.json")}
    resolved = load_config({}, environ=env)
    assert resolved.config.clnt_threadpool_size == 16
    assert resolved.sources["manager_address"].startswith("file:")

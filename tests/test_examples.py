"""The shipped examples carry configurations that validate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sglang_simm.config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("launch_*.sh")))
def test_launch_lines_validate(script):
    text = (EXAMPLES / script).read_text()
    match = re.search(r"--hicache-storage-backend-extra-config '(\{.*\})'", text)
    if match is None:
        match = re.search(r'--hicache-storage-backend-extra-config "@\$HERE/([^"]+)"', text)
        extra = json.loads((EXAMPLES / match.group(1)).read_text())
    else:
        extra = json.loads(match.group(1))
    resolved = load_config(extra, environ={})
    assert resolved.config.manager_address == "10.0.0.1:30001"
    if "dynamic" in text.split("--hicache-storage-backend ")[1][:8]:
        assert extra["interface_v1"] == 1 and extra["module_path"] == "sglang_simm"


def test_config_file_through_the_env_var(monkeypatch):
    env = {"SGLANG_HICACHE_SIMM_CONFIG_PATH": str(EXAMPLES / "simm-config.json")}
    resolved = load_config({}, environ=env)
    assert resolved.config.clnt_threadpool_size == 16
    assert resolved.sources["manager_address"].startswith("file:")

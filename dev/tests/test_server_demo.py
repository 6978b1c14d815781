"""``sglang-simm-dev demo --server``, the main job, end to end on a small model:
every answer matches its fresh computation and the last one comes from L3."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e


def test_server_demo_restores_from_l3_with_the_same_answers(tmp_path, capsys):
    from sglang_simm_dev.cli import main

    out = tmp_path / "demo.json"
    code = main([
        "demo", "--server", "--preset", "llama-tiny", "--model-dir", str(tmp_path / "model"),
        "--workdir", str(tmp_path / "server"),
        "--system-tokens", "512", "--question-tokens", "32", "--new-tokens", "4", "--json", str(out),
    ])
    captured = capsys.readouterr()
    text = captured.out
    # a failed start's reason goes to stderr: shown, not swallowed by capsys
    assert code == 0, text + captured.err
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["tier"] for r in rows] == [  # nearest tier first, then none
        "device hit (L1)", "host-tier hit (L2)", "L3 hit (SiMM)", "computed from scratch"]
    assert all(r["matches_fresh"] for r in rows), rows
    l3, scratch = rows[2], rows[3]
    assert scratch["cached_tokens"] == 0
    assert l3["cached_tokens"] == 512 and l3["kv_bytes_moved"] > 0
    assert "Time to first token" in text
    # the backend's own L3 writes (not SGLang's device-to-host backup bytes)
    assert data["metrics"].get("sglang:backup_pgs_sum", 0) > 0, data["summary"]["L3 written"]
    # the notes, in every run: the floor the cached rows share, and why their times come in no order
    notes = " ".join(text.split())
    assert "floor no tier removes" in notes and "timing noise" in notes, text
    # the server's log is kept where the summary says, its temporary files gone
    assert data["summary"]["server log"] == str(tmp_path / "server" / "demo-server.log")
    assert (tmp_path / "server" / "demo-server.log").exists() and not (tmp_path / "server" / "tmp").exists()

"""The ``sglang-simm`` command's handling of bad input: every mistake is one
line naming the option, what is wrong and an example; never a traceback."""

from __future__ import annotations

import sys
import tomllib

import pytest

from sglang_simm.tools import cli
from sglang_simm_dev import cli as dev_cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def test_bad_json_names_the_option_and_an_example():
    with pytest.raises(ValueError) as info:
        cli.parse_extra_config('{"manager_address": local}')
    text = str(info.value)
    assert text.startswith("--extra-config is not valid JSON")
    assert "line 1 column 21" in text and "'{\"manager_address\": local}'" in text
    assert '\'{"manager_address": "10.0.0.1:30001"}\'' in text and "double quotes" in text


def test_bad_json_on_the_command_line_is_one_error_line(capsys):
    code, out = run(capsys, "doctor", "--extra-config", "{not json")
    assert code == 2
    assert "error: --extra-config is not valid JSON" in out and "Example:" in out
    assert "Traceback" not in out


def test_extra_config_must_be_an_object():
    with pytest.raises(ValueError, match=r"--extra-config must hold a JSON object .*got list"):
        cli.parse_extra_config("[1, 2]")


@pytest.mark.parametrize(
    "name, body, problem",
    [
        ("c.json", "{oops", "is not valid JSON"),
        ("c.yaml", "a: [1, 2", "is not valid YAML"),
        ("c.toml", "a = ", "is not valid TOML"),
        ("c.cfg", "{}", "by its extension"),
        ("c.json", b"\xff\xfe{}", "not UTF-8"),
    ],
    ids=["json", "yaml", "toml", "extension", "binary"],
)
def test_bad_files_name_the_file(capsys, tmp_path, name, body, problem):
    path = tmp_path / name
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    code, out = run(capsys, "doctor", "--extra-config", f"@{path}")
    assert code == 2, out
    assert f"--extra-config @{path}" in out and problem in out
    assert "Traceback" not in out


def test_missing_file(capsys, tmp_path):
    code, out = run(capsys, "doctor", "--extra-config", f"@{tmp_path}/absent.json")
    assert code == 2 and "cannot read the file" in out and "Traceback" not in out


def test_toml_file_is_read(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('manager_address = "local"\nextra_backend_tag = "t1"\n')
    assert cli.parse_extra_config(f"@{path}") == {"manager_address": "local", "extra_backend_tag": "t1"}


@pytest.fixture
def python_310(monkeypatch):
    """Imports as on Python 3.10: no tomllib in the standard library."""
    monkeypatch.setitem(sys.modules, "tomllib", None)  # None makes ``import tomllib`` fail
    monkeypatch.setitem(sys.modules, "tomli", None)


def test_toml_without_tomllib_or_tomli_says_what_to_do(capsys, tmp_path, python_310):
    path = tmp_path / "c.toml"
    path.write_text('manager_address = "local"\n')
    code, out = run(capsys, "doctor", "--extra-config", f"@{path}")
    assert code == 2
    assert "Python 3.11+ or the tomli package" in out and "pip install tomli" in out
    assert ".json or .yaml" in out and "Traceback" not in out


def test_toml_falls_back_to_tomli(tmp_path, python_310, monkeypatch):
    # tomli is the package tomllib was made from: same API, same errors
    monkeypatch.setitem(sys.modules, "tomli", tomllib)
    path = tmp_path / "c.toml"
    path.write_text('manager_address = "local"\n')
    assert cli.parse_extra_config(f"@{path}") == {"manager_address": "local"}


def test_without_rich_the_command_names_an_install_that_works(capsys, monkeypatch):
    # no index has sglang-simm yet: the hint names rich itself and the clone's extra
    monkeypatch.setitem(sys.modules, "rich.console", None)
    code, out = run(capsys, "doctor", "--manager", "local")
    assert code == 2 and "pip install 'rich>=13'" in out and "pip install '.[cli]'" in out
    assert "sglang-simm[" not in out


def test_server_demo_without_sglang_is_one_line_that_says_how_to_get_it(capsys, monkeypatch):
    # it was a 27-line traceback naming a log in a folder already removed
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang now fails, as where it is missing
    assert dev_cli.main(["demo", "--server"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert "SGLang is not installed here" in err and "pip install 'sglang>=0.5.8,<0.6'" in err


@pytest.mark.parametrize("flag", [["--model", "llama3-8b"], ["--pages", "8"], ["--direct"]])
def test_server_demo_refuses_the_kv_demos_options_instead_of_ignoring_them(capsys, flag):
    assert dev_cli.main(["demo", "--server", *flag]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert f"{flag[0]} belong to the KV demo" in out and "--preset (" in out and "llama-tiny" in out


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_the_demo_and_the_bench_left_the_package_and_say_where_they_went(capsys, command):
    # any arguments, --help included: the answer is where the command went, not a usage error
    code, out = run(capsys, command, "--server", "--json", "out[1].json", "--help")
    assert code == 2
    assert f"sglang-simm {command}` is not part of the sglang-simm package" in out
    assert f"sglang-simm-dev {command} --server --json 'out[1].json' --help" in out
    assert "bash scripts/demo.sh" in out and "pip install -e './dev[bench]'" in out

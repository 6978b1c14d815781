"""The value parsers the configuration and the local store share."""

from __future__ import annotations

import pytest

from sglang_simm import local_store
from sglang_simm.config import load_config
from sglang_simm.values import FALSE_WORDS, TRUE_WORDS, InvalidValue, parse_bool, parse_byte_size

SPELLINGS = (
    [(w, True) for w in ("true", "TRUE", "True", "t", "T", "yes", "Yes", "y", "on", "On", "1", " true ")]
    + [(w, False) for w in ("false", "False", "f", "F", "no", "No", "n", "off", "OFF", "0")]
)


@pytest.mark.parametrize(("text", "expected"), SPELLINGS, ids=lambda v: repr(v))
def test_parse_bool_spellings(text, expected):
    assert parse_bool(text) is expected


@pytest.mark.parametrize("value", [True, False, 1, 0], ids=repr)
def test_parse_bool_json_values(value):
    assert parse_bool(value) is bool(value)


@pytest.mark.parametrize("value", ["maybe", "", "2", "tru", "yess", 2, -1, None, 1.0, [], "1.0"], ids=repr)
def test_parse_bool_refuses_everything_else_naming_the_forms(value):
    with pytest.raises(InvalidValue, match="is not a boolean; accepted: true/false") as info:
        parse_bool(value)
    assert info.value.problem == "is not a boolean" and "t/f" in info.value.accepted


def test_the_words_are_disjoint_and_lower_case():
    assert not TRUE_WORDS & FALSE_WORDS
    assert all(w == w.strip().lower() for w in TRUE_WORDS | FALSE_WORDS)


@pytest.mark.parametrize(("text", "expected"), SPELLINGS, ids=lambda v: repr(v))
def test_config_and_the_local_store_take_the_same_spellings(text, expected):
    assert load_config({"manager_address": "local", "warmup": text}, {}).config.warmup is expected
    before = local_store.get_flag("clnt_syncreq_enable_retry")
    try:
        assert local_store.set_flag("clnt_syncreq_enable_retry", text) is True
        assert local_store.get_flag("clnt_syncreq_enable_retry") == ("true" if expected else "false")
    finally:
        local_store.set_flag("clnt_syncreq_enable_retry", before)


def test_byte_size_errors_name_the_value_and_the_forms():
    with pytest.raises(InvalidValue, match=r"byte size '1 parsec' is not a byte size; accepted: .*512MiB"):
        parse_byte_size("1 parsec")
    with pytest.raises(ValueError, match="is not positive"):
        parse_byte_size(0)
    with pytest.raises(ValueError, match="is a bool"):
        parse_byte_size(True)
    assert parse_byte_size("1.5G") == int(1.5 * 1024**3) and parse_byte_size("8GB") == 8 * 10**9

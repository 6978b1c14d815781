"""Small value parsers of the configuration: booleans, byte sizes.

Standard library only, so ``import sglang_simm.config`` stays cheap. Each
parser returns the value or raises ``InvalidValue``, which says what is wrong
and what would be accepted; callers add the field and where it came from.
"""

from __future__ import annotations

import re

__all__ = ["BOOL_FORMS", "FALSE_WORDS", "TRUE_WORDS", "InvalidValue", "parse_bool", "parse_byte_size"]

_UNSET = object()


class InvalidValue(ValueError):
    """A value a parser refuses: ``problem`` says why, ``accepted`` what would do."""

    def __init__(self, problem: str, accepted: str, *, value: object = _UNSET, what: str = "value") -> None:
        shown = f"{what} {value!r} {problem}" if value is not _UNSET else problem
        super().__init__(f"{shown}; accepted: {accepted}")
        self.problem = problem
        self.accepted = accepted


#: Boolean words, any case, surrounding blanks ignored: the configuration's
#: and the SiMM client's flag spellings together (gflags takes t/f, y/n).
TRUE_WORDS = frozenset({"true", "t", "yes", "y", "on", "1"})
FALSE_WORDS = frozenset({"false", "f", "no", "n", "off", "0"})
BOOL_FORMS = "true/false, yes/no, on/off, t/f, y/n, 1/0 (any case), or a JSON bool"


def parse_bool(value: object) -> bool:
    """A JSON bool, 0/1, or one of ``TRUE_WORDS`` / ``FALSE_WORDS``."""
    if isinstance(value, bool):
        return value
    # The in-tree backend took truthy JSON numbers ("enable_profile": 1).
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
    raise InvalidValue("is not a boolean", BOOL_FORMS)


_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    # bare and binary suffixes are powers of 1024 (as ``ls -h`` and docker)
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
    # SI suffixes are powers of 1000
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE_FORMS = 'a positive byte count: an integer or a string like "512MiB", "4GiB", "1.5G", "8GB"'


def parse_byte_size(value: object) -> int:
    """``4294967296``, ``"512MiB"``, ``"4GiB"``, ``"1.5G"`` -> bytes (> 0), by ``_SIZE_UNITS``."""

    def invalid(problem: str) -> InvalidValue:
        return InvalidValue(problem, _SIZE_FORMS, value=value, what="byte size")

    if isinstance(value, bool):
        raise invalid("is a bool, not a size")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value.strip())
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise invalid("is not a byte size")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise invalid(f"is not a byte size ({type(value).__name__})")
    if size <= 0:
        raise invalid("is not positive")
    return size

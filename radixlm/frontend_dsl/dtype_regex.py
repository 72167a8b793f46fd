"""Regexes behind `gen(dtype=...)`, as in SGLang's frontend (sglang/lang/ir.py).

The trailing `[ \\n]*` on numbers lets the model end a number the way it naturally would
(a space or newline) instead of being forced to stop mid-thought; callers strip it.
"""

from __future__ import annotations

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""  # SGLang's: a quoted run of word characters and whitespace

_BY_NAME = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}


def dtype_to_regex(dtype: type | str) -> str:
    """The regex for `dtype`: int, float, bool or str (the type or its name)."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", repr(dtype))
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r} for gen(); expected one of {sorted(_BY_NAME)}"
        ) from None

"""Typed values of request inputs: each parser names the input it refuses (RequestError)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hsserve.request import RequestError


def as_int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer, float, np.floating)):
        raise RequestError(name, f"expected an integer, got {type(v).__name__} {v!r}")
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v) or v != int(v):
            raise RequestError(name, f"expected an integer, got {v!r}")
    iv = int(v)
    if not lo <= iv <= hi:
        raise RequestError(name, f"{iv} is outside {lo}..{hi}")
    return iv


def as_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise RequestError(name, f"expected a number, got {type(v).__name__} {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise RequestError(name, f"expected a finite number, got {v!r}")
    return f


def as_bool(name: str, v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise RequestError(name, f"expected true or false, got {v!r}")


def as_str(name: str, v: Any) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(name, "is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise RequestError(name, f"expected a string, got {type(v).__name__} {v!r}")


def as_str_list(name: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, (str, bytes)):
        return (as_str(name, v),)
    if isinstance(v, (list, tuple, np.ndarray)):
        return tuple(as_str(name, x) for x in v)
    raise RequestError(name, f"expected a string or a list of strings, got {v!r}")


def as_int_list(name: str, v: Any, lo: int, hi: int) -> tuple[int, ...]:
    if isinstance(v, (list, tuple, np.ndarray)):
        return tuple(as_int(name, x, lo, hi) for x in v)
    return (as_int(name, v, lo, hi),)

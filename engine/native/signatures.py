"""The native library's function types, read from their one declaration in `kernels.h`:
the bindings type each function they call from here, so no signature is written twice."""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEADER = Path(__file__).with_name("kernels.h")

CType = type[ctypes.c_int | ctypes.c_int64 | ctypes.c_float | ctypes.c_void_p]

# The types the header passes by value; every pointer, to numbers or to a struct, is an
# address (c_void_p).
_VALUES: dict[str, CType] = {
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}


@dataclass(frozen=True, slots=True)
class Signature:
    restype: CType | None
    argtypes: tuple[CType, ...]


def declared(library: ctypes.CDLL, name: str) -> Callable[..., Any]:
    """The library's function `name`, with the argument and return types kernels.h gives it."""
    signature = signatures()[name]
    function = getattr(library, name)
    function.restype = signature.restype
    function.argtypes = signature.argtypes
    return function


@functools.cache
def signatures() -> dict[str, Signature]:
    """kernels.h's functions, by name."""
    return parse(HEADER.read_text())


def parse(header: str) -> dict[str, Signature]:
    """Each function prototype of a C header -> its ctypes types, by name. Prototypes only:
    no function pointers or variadic functions, and each parameter named."""
    code = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    code = re.sub(r"^\s*#[^\n]*", "", code, flags=re.M)
    found = {}
    for statement in code.split(";"):
        prototype = re.fullmatch(r"\s*(.+?)\b(\w+)\s*\((.*)\)\s*", statement, flags=re.S)
        if prototype is None:
            continue
        result, name, parameters = prototype.groups()
        found[name] = Signature(
            None if result.split() == ["void"] else _ctype(result),
            tuple(
                _ctype(parameter, named=True)
                for parameter in parameters.split(",")
                if parameter.split() != ["void"]
            ),
        )
    return found


def _ctype(declaration: str, named: bool = False) -> CType:
    """'const float *q' (named) or 'int' -> the ctypes type passing it."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = [word for word in declaration.split() if word != "const"]
    c_type = " ".join(words[:-1] if named else words)
    if c_type not in _VALUES:
        raise ValueError(f"kernels.h: no ctypes type for {declaration.strip()!r}")
    return _VALUES[c_type]

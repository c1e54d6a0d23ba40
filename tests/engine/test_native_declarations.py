"""The native library's one declaration of its functions (`kernels.h`), and the ctypes
mirrors of decode_step.c's structs, against the C sources."""

from __future__ import annotations

import ctypes
import re

import pytest

from engine.models import native_decoder
from engine.native import library
from engine.native.signatures import Signature, parse, signatures

DECODE_STEP_C = next(source for source in library.SOURCES if source.name == "decode_step.c")


def _code(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def test_every_function_the_sources_define_is_declared_in_kernels_h() -> None:
    declared = set(signatures())
    for source in library.SOURCES:
        text = source.read_text()
        # Including it is what makes the compiler check each definition against it.
        assert '#include "kernels.h"' in text, source.name
        defined = re.findall(r"^(?!static)\w[\w \t*]*?\b(tollgate_\w+)\s*\(", _code(text), re.M)
        assert defined, source.name
        assert set(defined) <= declared, source.name


def test_prototypes_read_as_ctypes_types() -> None:
    header = """
    #include <stdint.h>
    /* a comment; with (parentheses) */
    struct Model;
    int f(const float *x, int64_t n, float scale, int threads);
    void g(const struct Model *m,
           uint8_t *out);
    int h(void);
    """
    assert parse(header) == {
        "f": Signature(
            ctypes.c_int, (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int)
        ),
        "g": Signature(None, (ctypes.c_void_p, ctypes.c_void_p)),
        "h": Signature(ctypes.c_int, ()),
    }


def test_a_type_without_a_ctypes_counterpart_is_refused() -> None:
    with pytest.raises(ValueError, match="double"):
        parse("double f(double x);")


def _c_structs(text: str) -> dict[str, list[tuple[str, str]]]:
    """Each `typedef struct ... {fields} Name;` -> its fields (name, type) in order, every
    pointer's type "pointer"."""
    structs = {}
    for body, name in re.findall(r"typedef struct\s*\w*\s*\{(.*?)\}\s*(\w+);", _code(text), re.S):
        fields = []
        for declaration in filter(str.strip, body.split(";")):
            first, *rest = declaration.split(",")
            match = re.fullmatch(r"(.*?)\s*(\**\s*\w+)", first.strip())
            assert match is not None, declaration
            base = " ".join(word for word in match[1].split() if word != "const")
            for declarator in (match[2], *rest):
                kind = "pointer" if "*" in declarator else base
                fields.append((declarator.strip(" *"), kind))
        structs[name] = fields
    return structs


def _ctypes_fields(struct: type[ctypes.Structure]) -> list[tuple[str, str]]:
    names = {ctypes.c_int64: "int64_t", ctypes.c_float: "float", ctypes.c_void_p: "pointer"}
    fields = []
    for name, kind, *_ in struct._fields_:
        if isinstance(kind, type) and issubclass(kind, ctypes.Structure):
            fields.append((name, kind.__name__))
        elif isinstance(kind, type) and issubclass(kind, ctypes._Pointer):
            fields.append((name, "pointer"))
        else:
            fields.append((name, names[kind]))
    return fields


@pytest.mark.parametrize(
    "struct",
    [native_decoder.Projection, native_decoder.DecoderLayer, native_decoder.Decoder],
    ids=lambda struct: struct.__name__,
)
def test_the_decoder_structs_mirror_decode_step_c(struct: type[ctypes.Structure]) -> None:
    assert _ctypes_fields(struct) == _c_structs(DECODE_STEP_C.read_text())[struct.__name__]


def test_the_projection_kinds_are_decode_step_c_s() -> None:
    enum = re.search(r"enum \{(.*?)\};", _code(DECODE_STEP_C.read_text()), re.S)
    assert enum is not None
    kinds = {name: int(value) for name, value in re.findall(r"(\w+) = (\d+)", enum[1])}
    assert kinds == {
        "FLOAT_PANELS": native_decoder.FLOAT_PANELS,
        "INT8_PANELS": native_decoder.INT8_PANELS,
        "INTEGER_PANELS": native_decoder.INTEGER_PANELS,
    }

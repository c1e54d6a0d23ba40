"""Arbitrary messages of any public request type, built from its protobuf descriptor.

Every field may be left unset or given a value a careless or hostile client could send:
text with U+0000, control characters, any Unicode and up to 70,000 characters; integers
across their whole wire range; floats including NaN, infinities and subnormals; repeated
fields a few items long or hundreds (but not hundreds of hundreds: a repeated field inside
an item repeated hundreds of times has a few items of short text, so that a message stays
within a few times what a server receives); timestamps and durations out of their range.
`hints` give some fields, by name, values that reach further into the services (a known
run id, the served model, a valid max_tokens), mixed with the arbitrary ones, so that
requests are admitted too, with arbitrary text in them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

# Calls made and status codes seen, by method: printed at the end of the test run.
TALLY: dict[str, Counter[str]] = {}

# Any character a protobuf string can hold (not the surrogates, which UTF-8 cannot encode).
UNICODE = st.characters(codec="utf-8")
_LONG = st.builds(
    lambda char, n: char * n,
    UNICODE,
    st.sampled_from([129, 201, 257, 4000, 20_000, 70_000]),
)
TEXT = st.one_of(
    st.text(max_size=16),
    st.text(UNICODE, max_size=300),
    st.sampled_from(["", "a\x00b", "\x00", "run_\x00", "é" * 100, "\U0001f600", "\t\n"]),
    _LONG,
)


def _ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    edges = sorted({low, high, 0, 1, max(low, -1), min(high, 2**63), min(high, 2**31)})
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


_SCALARS: Mapping[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_STRING: TEXT,
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_INT32: _ints(32, True),
    FieldDescriptor.TYPE_INT64: _ints(64, True),
    FieldDescriptor.TYPE_UINT32: _ints(32, False),
    FieldDescriptor.TYPE_UINT64: _ints(64, False),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
}


SHORT_TEXT = st.one_of(st.text(max_size=16), st.text(UNICODE, max_size=100))


def requests(
    descriptor: Descriptor, hints: Mapping[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type: wild ones, any subset of their fields set to any
    value; and tame ones, whose hinted fields are set, each to its hint nine times in ten."""
    return st.one_of(_message(descriptor, hints, tame=False), _message(descriptor, hints, True))


def _message(
    descriptor: Descriptor,
    hints: Mapping[str, st.SearchStrategy[Any]],
    tame: bool,
    multiplied: bool = False,
) -> st.SearchStrategy[Message]:
    """`multiplied`: the message is an item repeated many times, so it stays small."""
    fields = {f.name: _field(f, hints, tame, multiplied) for f in descriptor.fields}
    required = {
        n: v for n, v in fields.items() if tame and _hinted(descriptor.fields_by_name[n], hints)
    }
    optional = {n: v for n, v in fields.items() if n not in required}
    return st.fixed_dictionaries(required, optional=optional).map(
        lambda values: _build(descriptor, values)
    )


def _hinted(field: FieldDescriptor, hints: Mapping[str, Any], depth: int = 0) -> bool:
    if field.name in hints:
        return True
    if field.type != FieldDescriptor.TYPE_MESSAGE or depth > 3:
        return False
    return any(_hinted(f, hints, depth + 1) for f in field.message_type.fields)


def _field(
    field: FieldDescriptor,
    hints: Mapping[str, st.SearchStrategy[Any]],
    tame: bool,
    multiplied: bool,
) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        one: st.SearchStrategy[Any] = st.deferred(
            lambda: _message(field.message_type, hints, tame, multiplied)
        )
        # The item of a field repeated many times; built on demand, as `one` is.
        item: st.SearchStrategy[Any] = st.deferred(
            lambda: _message(field.message_type, hints, tame, multiplied=True)
        )
    elif field.type == FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        one = item = st.one_of(st.sampled_from(numbers), st.integers(-3, 100))
    elif field.type == FieldDescriptor.TYPE_STRING and multiplied:
        one = item = SHORT_TEXT
    else:
        one = item = _SCALARS[field.type]
    if field.name in hints:
        hint, wild, wild_item = hints[field.name], one, item
        # The hint nine times in ten when tame, else about half the time.
        one = st.integers(0, 9).flatmap(lambda n: wild if n == 5 or not tame and n < 5 else hint)
        item = st.integers(0, 9).flatmap(
            lambda n: wild_item if n == 5 or not tame and n < 5 else hint
        )
    if not field.is_repeated:
        return one
    if tame or multiplied:
        return st.lists(one, max_size=3 if tame else 4)
    # A few items, or one item many times (past any count limit, cheap to generate).
    many = st.tuples(item, st.sampled_from([9, 65, 257, 300])).map(lambda t: [t[0]] * t[1])
    return st.one_of(st.lists(one, max_size=4), many)


def _build(descriptor: Descriptor, values: Mapping[str, Any]) -> Message:
    message = GetMessageClass(descriptor)()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        target = getattr(message, name)
        if _is_map(field):
            for entry in value:  # each an entry message: its key and value
                target[entry.key] = entry.value
        elif field.is_repeated and field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        elif field.is_repeated:
            target.extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def _is_map(field: FieldDescriptor) -> bool:
    entry = field.message_type
    return entry is not None and entry.GetOptions().map_entry


_PART = re.compile(r"(\w+)(?:\[(\d+)\])?")


def is_field_path(descriptor: Descriptor, path: str) -> bool:
    """Whether `path` ("sampling.max_tokens", "messages[3].content") names a field of
    `descriptor`'s messages, as a BadRequest field violation must."""
    current: Descriptor | None = descriptor
    for part in path.split("."):
        match = _PART.fullmatch(part)
        field = current.fields_by_name.get(match.group(1)) if match and current else None
        if field is None or (match and match.group(2) is not None and not field.is_repeated):
            return False
        current = field.message_type
    return True

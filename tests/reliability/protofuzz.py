"""Hypothesis strategies for any protobuf message: every field may be absent, empty, huge, negative or NaN."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor, names: Sequence[str]) -> st.SearchStrategy[Any]:
    t = field.type
    if t in INT_RANGES:
        low, high = INT_RANGES[t]
        return st.one_of(st.integers(-3, 3), st.integers(low, high)).filter(lambda v: low <= v <= high)
    if t == FieldDescriptor.TYPE_ENUM:
        enum: Any = field.enum_type
        return st.one_of(st.sampled_from([v.number for v in enum.values]), st.integers(-5, 1000))
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(width=32) if t == FieldDescriptor.TYPE_FLOAT else st.floats()
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from([*names, ""]), st.text(max_size=40))
    return st.binary(max_size=40)


@st.composite
def messages(draw: st.DrawFn, cls: type[Message], names: Sequence[str] = (), depth: int = 3) -> Message:
    """A `cls` with a random subset of its fields set to random values (`names`: strings worth trying)."""
    message = cls()
    _fill(draw, message, message.DESCRIPTOR, names, depth)
    return message


def _fill(draw: st.DrawFn, message: Message, descriptor: Any, names: Sequence[str], depth: int) -> None:
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0:
                continue
            sub_descriptor: Any = field.message_type
            if sub_descriptor.GetOptions().map_entry:
                key_field, value_field = sub_descriptor.fields_by_name["key"], sub_descriptor.fields_by_name["value"]
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    continue
                items = draw(st.dictionaries(_scalar(key_field, names), _scalar(value_field, names), max_size=3))
                getattr(message, field.name).update(items)
                continue
            count = draw(st.integers(0, 2)) if _repeated(field) else 1
            for _ in range(count):
                child = getattr(message, field.name).add() if _repeated(field) else getattr(message, field.name)
                if not _repeated(field):
                    child.SetInParent()
                _fill(draw, child, sub_descriptor, names, depth - 1)
        elif _repeated(field):
            getattr(message, field.name).extend(draw(st.lists(_scalar(field, names), max_size=3)))
        else:
            setattr(message, field.name, draw(_scalar(field, names)))


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)

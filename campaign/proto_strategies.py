"""Hypothesis strategies built from protobuf descriptors: random messages of any type, and mutations of valid ones.

- :func:`message_strategy` draws a message of a ``Descriptor``'s type field by field: every scalar type with its
  edge values (0, -1, the int32/int64/uint64 extremes, NaN, +-inf, subnormals, empty/huge/non-ASCII/NUL strings,
  random bytes), enums including values the proto does not define, nested messages down to a depth bound,
  repeated fields and maps of a few entries, oneofs (one member or none).
- :func:`mutated` draws a changed copy of a valid message: a few mutations, each at a random field path (a
  field set to an edge value or to a random value of its type, a field cleared, a repeated field grown, cut,
  or its elements swapped, a nested message replaced by a random one).
- :func:`mutated_bytes` draws damaged wire bytes of a message (bit flips, cuts, inserted or repeated bytes);
  the receiver's parser sees them.

Purely random messages rarely get past an RPC's first check; mutations of messages a real run sent (see
:mod:`campaign.fuzz_capture`) reach the deep paths. Every strategy is pure hypothesis, so a run is reproduced
from its seed.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor

INT32 = (0, 1, -1, 2**31 - 1, -(2**31), 2**16, 255)
INT64 = (0, 1, -1, 2**63 - 1, -(2**63), 2**32, 2**53 + 1, 10**9)
UINT32 = (0, 1, 2**32 - 1, 2**31)
UINT64 = (0, 1, 2**64 - 1, 2**63)
FLOATS = (0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e300, -1e300, 5e-324, 1e-45, 3.4e38)
STRINGS = ("", " ", "a" * 70_000, "é" * 5_000, "\x00", "../../etc/passwd", "/tmp/x", "💥" * 100, "\u202e",
           "0" * 64, "f" * 64, "site-a", "site-b", "scientist", "NaN", "-1", "raw", "fp16", "int8+topk:0.1",
           "%s%n", "'; DROP TABLE tasks; --")
BYTES = (b"", b"\x00", b"\xff" * 33, bytes(range(256)), b"\x00" * 70_000)

_RANGES = {F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
           F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
           F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
           F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_UINT64: (0, 2**64 - 1),
           F.TYPE_FIXED64: (0, 2**64 - 1)}
_EDGES = {F.TYPE_INT32: INT32, F.TYPE_SINT32: INT32, F.TYPE_SFIXED32: INT32, F.TYPE_INT64: INT64,
          F.TYPE_SINT64: INT64, F.TYPE_SFIXED64: INT64, F.TYPE_UINT32: UINT32, F.TYPE_FIXED32: UINT32,
          F.TYPE_UINT64: UINT64, F.TYPE_FIXED64: UINT64}


@functools.lru_cache(maxsize=None)
def scalar_strategy(field: FieldDescriptor) -> st.SearchStrategy:
    """Values for one non-message field: edge values half of the time, random values of its type otherwise."""
    t = field.type
    if t in _RANGES:
        lo, hi = _RANGES[t]
        return st.one_of(st.sampled_from(_EDGES[t]), st.integers(lo, hi), st.integers(-3, 300).filter(
            lambda v: lo <= v <= hi))
    if t == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True))
    if t == F.TYPE_FLOAT:
        return st.one_of(st.sampled_from((0.0, -1.0, math.nan, math.inf, -math.inf, 3.4e38, 1e-45)),
                         st.floats(width=32, allow_nan=True, allow_infinity=True))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        # text from one bytes draw (st.text draws per character, ten times slower): Latin-1 and UTF-8 (with
        # replacement characters for invalid sequences) spread over many code points
        return st.one_of(st.sampled_from(STRINGS), st.binary(max_size=48).map(lambda b: b.decode("latin-1")),
                         st.binary(max_size=48).map(lambda b: b.decode("utf-8", "replace")))
    if t == F.TYPE_BYTES:
        return st.one_of(st.sampled_from(BYTES), st.binary(max_size=64))
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from((-1, 2**31 - 1, max(known) + 1)))
    raise TypeError(f"no strategy for field type {t} ({field.full_name})")


def _is_map(field: FieldDescriptor) -> bool:
    return (field.type == F.TYPE_MESSAGE and field.is_repeated
            and field.message_type.GetOptions().map_entry)


@functools.lru_cache(maxsize=None)
def field_value_strategy(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    """A value for ``field`` as :func:`set_field` takes it: a list for a repeated field, a dict for a map, a
    message for a message field, a scalar otherwise."""
    if _is_map(field):
        key_f = field.message_type.fields_by_name["key"]
        val_f = field.message_type.fields_by_name["value"]
        val = (message_strategy(val_f.message_type, depth - 1) if val_f.type == F.TYPE_MESSAGE
               else scalar_strategy(val_f))
        return st.dictionaries(scalar_strategy(key_f), val, max_size=3)
    one = (message_strategy(field.message_type, depth - 1) if field.type == F.TYPE_MESSAGE
           else scalar_strategy(field))
    if field.is_repeated:
        return st.lists(one, max_size=4)
    return one


def set_field(msg: Message, field: FieldDescriptor, value: Any) -> None:
    """Store ``value`` (as :func:`field_value_strategy` draws it) in ``msg.field``, replacing what was there."""
    name = field.name
    msg.ClearField(name)
    if _is_map(field):
        target = getattr(msg, name)
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        if field.type == F.TYPE_MESSAGE:
            getattr(msg, name).extend(value)
        else:
            getattr(msg, name).extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(msg, name).CopyFrom(value)
    else:
        setattr(msg, name, value)


@functools.lru_cache(maxsize=None)
def message_strategy(descriptor: Descriptor, depth: int = 3) -> st.SearchStrategy:
    """Random messages of ``descriptor``'s type; nested messages below ``depth`` are left empty."""
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(descriptor)
    if depth <= 0:
        return st.builds(cls)
    plain = [f for f in descriptor.fields if f.containing_oneof is None]
    oneofs = list(descriptor.oneofs)

    @st.composite
    def build(draw) -> Message:
        msg = cls()
        for f in plain:
            if draw(st.booleans()):
                set_field(msg, f, draw(field_value_strategy(f, depth)))
        for o in oneofs:
            f = draw(st.one_of(st.none(), st.sampled_from(list(o.fields))))
            if f is not None:
                set_field(msg, f, draw(field_value_strategy(f, depth)))
        return msg

    return build()


def _paths(msg: Message, prefix: tuple = (), depth: int = 4) -> list[tuple]:
    """Every (field path) in ``msg`` worth mutating: each field of each set nested message (repeated message
    elements addressed by index), set or not."""
    out: list[tuple] = []
    for f in msg.DESCRIPTOR.fields:
        out.append(prefix + (f.name,))
        if depth <= 0 or f.type != F.TYPE_MESSAGE or _is_map(f):
            continue
        if f.is_repeated:
            for i, sub in enumerate(getattr(msg, f.name)):
                out += _paths(sub, prefix + (f.name, i), depth - 1)
        elif msg.HasField(f.name):
            out += _paths(getattr(msg, f.name), prefix + (f.name,), depth - 1)
    return out


def _resolve(msg: Message, path: tuple) -> tuple[Message, FieldDescriptor]:
    for step in path[:-1]:
        msg = msg[step] if isinstance(step, int) else getattr(msg, step)
    return msg, msg.DESCRIPTOR.fields_by_name[path[-1]]


@st.composite
def _mutate_once(draw, msg: Message) -> None:
    parent, field = _resolve(msg, draw(st.sampled_from(_paths(msg))))
    op = draw(st.sampled_from(("edge", "random", "clear", "grow", "cut", "swap")))
    if op == "clear":
        parent.ClearField(field.name)
    elif field.is_repeated and not _is_map(field) and op in ("grow", "cut", "swap"):
        seq = getattr(parent, field.name)
        if op == "grow":
            extra = draw(st.lists(message_strategy(field.message_type, 2) if field.type == F.TYPE_MESSAGE
                                  else scalar_strategy(field), min_size=1, max_size=3))
            if seq and draw(st.booleans()):
                extra = [seq[draw(st.integers(0, len(seq) - 1))]] * len(extra)  # duplicates of an existing one
            seq.extend(extra)
        elif op == "cut" and seq:
            del seq[draw(st.integers(0, len(seq) - 1))]
        elif op == "swap" and len(seq) > 1:
            items = list(seq)
            items = draw(st.permutations(items))
            parent.ClearField(field.name)
            getattr(parent, field.name).extend(items)
    elif op == "edge" and field.type != F.TYPE_MESSAGE and not field.is_repeated:
        set_field(parent, field, draw(scalar_strategy(field)))
    else:
        set_field(parent, field, draw(field_value_strategy(field, 2)))


@st.composite
def mutated(draw, valid: Message, max_mutations: int = 3) -> Message:
    """A copy of ``valid`` with 1..``max_mutations`` mutations (module docstring)."""
    msg = type(valid)()
    msg.CopyFrom(valid)
    for _ in range(draw(st.integers(1, max_mutations))):
        draw(_mutate_once(msg))
    return msg


@st.composite
def mutated_bytes(draw, data: bytes) -> bytes:
    """``data`` (a serialized message) damaged on the wire: flipped bits, a cut, inserted or repeated bytes."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "cut", "insert", "repeat", "varint")))
        pos = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "repeat" and buf:
            end = draw(st.integers(pos, len(buf)))
            buf[pos:pos] = buf[pos:end]
        elif op == "varint":  # an overlong or maximal varint where a length or number may be
            buf[pos:pos] = b"\xff" * draw(st.integers(1, 10)) + b"\x01"
    return bytes(buf)


def any_or_mutated(descriptor: Descriptor, valid: list[Message]) -> st.SearchStrategy:
    """Mostly mutations of the ``valid`` examples of ``descriptor``'s type (unchanged ones too), random
    messages otherwise."""
    random_msgs = message_strategy(descriptor)
    if not valid:
        return random_msgs
    base = st.sampled_from(valid)
    return st.one_of(base.flatmap(mutated), base.flatmap(mutated), base, random_msgs)

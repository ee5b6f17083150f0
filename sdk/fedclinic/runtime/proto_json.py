"""Protobuf messages as JSON for people and scripts: 64-bit integers stay numbers.

``google.protobuf.json_format`` follows the proto3 JSON mapping, which writes every int64, uint64, sint64,
fixed64 and sfixed64 field as a *string* ("1700000000") because JavaScript's numbers lose integers above 2**53.
fedclinic's ``--json`` outputs are read by Python, ``jq`` and spreadsheets, where a byte count or a seed that is a
string breaks arithmetic and sorting; they use :func:`message_to_dict` / :func:`message_to_json`, which write those
fields as JSON numbers (exact: Python's ``json`` prints integers of any size digit for digit). Everything else is
json_format's mapping (field names as in the .proto, enums by name, bytes as base64, well-known types as
their JSON forms).
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

_INT64_TYPES = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64})


def message_to_dict(message: Message) -> dict[str, Any]:
    """``message`` as a JSON-ready dict (json_format's mapping, proto field names), with every 64-bit integer
    field (also in repeated fields and map values, at any depth) as an ``int``."""
    doc = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return _numbers(message.DESCRIPTOR, doc)


def message_to_json(message: Message, *, indent: int | None = 2) -> str:
    """:func:`message_to_dict` serialized (``indent`` as json.dumps takes it)."""
    return json.dumps(message_to_dict(message), indent=indent)


def _numbers(descriptor: Descriptor, doc: dict[str, Any]) -> dict[str, Any]:
    if descriptor.full_name.startswith("google.protobuf."):  # well-known types keep their own JSON forms
        return doc
    for field in descriptor.fields:
        if field.name not in doc:
            continue
        value = doc[field.name]
        if _is_map(field):
            value_field = field.message_type.fields_by_name["value"]
            doc[field.name] = {k: _convert(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            doc[field.name] = [_convert(field, v) for v in value]
        else:
            doc[field.name] = _convert(field, value)
    return doc


def _convert(field: FieldDescriptor, value: Any) -> Any:
    if field.type in _INT64_TYPES and isinstance(value, str):
        return int(value)
    if field.type == FieldDescriptor.TYPE_MESSAGE and isinstance(value, dict):
        return _numbers(field.message_type, value)
    return value


def _is_map(field: FieldDescriptor) -> bool:
    return (field.type == FieldDescriptor.TYPE_MESSAGE and field.is_repeated
            and field.message_type.GetOptions().map_entry)


__all__ = ["message_to_dict", "message_to_json"]

"""Every wire Struct of the protocol modules comes back from the codec equal to what was
sent. The structs are found by walking ``omnistage.protocol``, and each is filled from
its own field types, so a new message (or a new field) is covered without a test edit."""

from __future__ import annotations

import enum
import importlib
import pkgutil
import re
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

import omnistage.protocol
from omnistage.protocol import codec
from omnistage.protocol.chunk_meta import TensorMeta
from omnistage.protocol.enums import Modality
from omnistage.protocol.messages import OutputChunk
from omnistage.protocol.registration import RegisterReply, RegisterRequest
from omnistage.protocol.tags import TAGS


def _wire_structs() -> list[type[msgspec.Struct]]:
    found: dict[str, type[msgspec.Struct]] = {}
    for info in pkgutil.iter_modules(omnistage.protocol.__path__):
        module = importlib.import_module(f"omnistage.protocol.{info.name}")
        for name, obj in vars(module).items():
            if (
                isinstance(obj, type)
                and issubclass(obj, msgspec.Struct)
                and obj.__module__ == module.__name__
            ):
                found[f"{module.__name__}.{name}"] = obj
    return [found[k] for k in sorted(found)]


STRUCTS = _wire_structs()


def _int(t: mi.IntType) -> int:
    low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
    high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
    value = 7 if low is None else max(low, 7)
    return value if high is None else min(value, high)


def _float(t: mi.FloatType) -> float:
    low = t.ge if t.ge is not None else t.gt
    high = t.le if t.le is not None else t.lt
    value = 0.5 if low is None else low + 0.5
    return value if high is None else min(value, (high + (low or 0.0)) / 2)


def _str(t: mi.StrType) -> str:
    text = "x" * max(t.min_length or 0, 1)
    if t.pattern is None:
        return text
    fits = [s for s in (text, "7", "x7", "a-b.c") if re.search(t.pattern, s)]
    assert fits, f"no sample string matches {t.pattern!r}: add one"
    return fits[0]


def _sample(t: mi.Type, member: int = 0) -> Any:
    """A value of type ``t``, unlike any default (an optional field gets its value, not
    None). ``member``: which struct of a union of several to make."""
    if isinstance(t, mi.IntType):
        return _int(t)
    if isinstance(t, mi.FloatType):
        return _float(t)
    if isinstance(t, mi.BoolType):
        return True
    if isinstance(t, mi.StrType):
        return _str(t)
    if isinstance(t, (mi.BytesType, mi.ByteArrayType)):
        return b"\x00\xff" * max(t.min_length or 0, 1)
    if isinstance(t, mi.AnyType):
        return {"any": [1, "two"]}
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.EnumType):
        return list(t.cls)[-1]
    if isinstance(t, mi.LiteralType):
        return t.values[-1]
    if isinstance(t, mi.ListType):
        return [_sample(t.item_type)]
    if isinstance(t, mi.VarTupleType):
        return (_sample(t.item_type), _sample(t.item_type))
    if isinstance(t, mi.TupleType):
        return tuple(_sample(item) for item in t.item_types)
    if isinstance(t, mi.DictType):
        return {_sample(t.key_type): _sample(t.value_type)}
    if isinstance(t, mi.StructType):
        return _instance(t)
    if isinstance(t, mi.UnionType):
        options = [o for o in t.types if not isinstance(o, mi.NoneType)]
        structs = [o for o in options if isinstance(o, mi.StructType)]
        return _sample(structs[member % len(structs)] if structs else options[0])
    raise AssertionError(f"no sample for {t!r}: teach _sample this type")


def _instance(t: mi.StructType) -> msgspec.Struct:
    return t.cls(**{f.name: _field_sample(f) for f in t.fields})


def _field_sample(f: mi.Field) -> Any:
    if isinstance(f.type, mi.BoolType) and f.default is True:
        return False
    return _sample(f.type)


def _filled(cls: type[msgspec.Struct]) -> msgspec.Struct:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return _instance(info)


def _round_trip(msg: msgspec.Struct) -> Any:
    """Through the codec's own path for the message: tagged frames, the registration
    maps, or (a struct nested in a message) msgpack bound to its type."""
    if type(msg) in TAGS:
        tag, body = codec.encode(msg)
        return codec.decode(tag, body)
    if isinstance(msg, RegisterRequest):
        return codec.decode_register_request(codec.encode_raw(msg))
    if isinstance(msg, RegisterReply):
        return codec.decode_register_reply(codec.encode_register_reply(msg))
    return msgspec.msgpack.decode(codec.encode_raw(msg), type=type(msg))


def test_the_walk_finds_the_messages_of_every_protocol_module() -> None:
    names = {cls.__name__ for cls in STRUCTS}
    assert {cls.__name__ for cls in TAGS} <= names
    assert {"Usage", "TextMeta", "TensorMeta", "StageParams", "RegisterRequest"} <= names


@pytest.mark.parametrize("cls", STRUCTS, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_wire_struct_round_trips_through_the_codec(cls: type[msgspec.Struct]) -> None:
    msg = _filled(cls)
    assert _round_trip(msg) == msg
    default = _defaults_only(cls)
    if default is not None:
        assert _round_trip(default) == default


def _defaults_only(cls: type[msgspec.Struct]) -> msgspec.Struct | None:
    """The struct with only its required fields set (the rest at their defaults)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return cls(**{f.name: _sample(f.type) for f in info.fields if f.required})


def _union_fields() -> list[Any]:
    """A param (where, field type, member) for each struct member of each field typed as
    a union of several structs (a tagged union, as ``OutputChunk.meta``)."""
    out = []
    for cls in STRUCTS:
        for field in msgspec.structs.fields(cls):
            info = mi.type_info(field.type)
            if isinstance(info, mi.UnionType):
                structs = [o for o in info.types if isinstance(o, mi.StructType)]
                where = f"{cls.__name__}.{field.name}"
                if len(structs) > 1:
                    out += [
                        pytest.param(where, field.type, i, id=f"{where}-{s.cls.__name__}")
                        for i, s in enumerate(structs)
                    ]
    return out


UNIONS = _union_fields()


def test_a_union_of_structs_is_found() -> None:
    assert sum(p.values[0] == "OutputChunk.meta" for p in UNIONS) >= 7


@pytest.mark.parametrize(("where", "type_", "member"), UNIONS)
def test_each_member_of_a_tagged_union_decodes_as_itself(
    where: str, type_: Any, member: int
) -> None:
    value = _sample(mi.type_info(type_), member)
    decoded = msgspec.msgpack.decode(codec.encode_raw(value), type=type_)
    assert type(decoded) is type(value) and decoded == value, where


def test_a_chunk_carries_each_kind_of_meta_through_the_codec() -> None:
    chunk = _filled(OutputChunk)
    for where, type_, member in (p.values for p in UNIONS):
        if where == "OutputChunk.meta":
            sent = msgspec.structs.replace(chunk, meta=_sample(mi.type_info(type_), member))
            assert _round_trip(sent) == sent


def test_a_tensor_comes_back_as_the_same_array() -> None:
    np = pytest.importorskip("numpy")
    hidden = np.arange(2 * 3 * 4, dtype=np.float16).reshape(2, 3, 4)
    meta = TensorMeta("hidden_states", str(hidden.dtype), hidden.shape)
    sent = OutputChunk("r", 0, 0, 0, 0, Modality.TEXT, data=hidden.tobytes(), meta=meta)
    got = _round_trip(sent)
    assert isinstance(got.meta, TensorMeta) and got.meta == meta
    back = np.frombuffer(got.data, dtype=got.meta.dtype).reshape(got.meta.shape)
    assert np.array_equal(back, hidden)


def test_the_samples_are_not_the_defaults() -> None:
    # A field left at its default would round-trip even if the codec dropped it.
    for cls in STRUCTS:
        msg = _filled(cls)
        for field in msgspec.structs.fields(cls):
            if field.default is not msgspec.NODEFAULT and not isinstance(field.default, enum.Enum):
                assert getattr(msg, field.name) != field.default, f"{cls.__name__}.{field.name}"

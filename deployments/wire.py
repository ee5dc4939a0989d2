"""The channel's encoding: msgpack with typed decoding (msgspec), never pickle.

A frame can only decode into the type its method declares (``deployments/messages.py``: the step
items and their answers, the engine's ``Proposal`` and ``VerifyResult``, ``str``, ``int``): msgspec
builds those dataclasses field by field and checks every field's type, so bytes from the network
cannot name a class to construct or a function to call, as a pickle can. vLLM's engine/worker
traffic does the same (``vllm/v1/serial_utils.py``: msgpack, tensors as raw buffers).

Two extensions of plain msgspec:
- a ``torch.Tensor`` (a proposal's draft distributions q) goes as ``[dtype, shape, raw bytes]``;
  decoding checks the dtype against a short list and the byte count against the shape;
- a list whose items are one of several dataclasses (``list[Proposal | Resync | ItemFailed]``)
  goes as ``[index of the item's type, item]`` pairs, since msgspec decodes a union of
  several dataclasses only when they are its own tagged Structs.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import is_dataclass
from typing import Any

import msgspec
import torch

TENSOR_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16,
                                                             torch.int64, torch.int32)}
MAX_TENSOR_DIMS = 4


def _encode_tensor(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return [str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()]
    raise NotImplementedError(f"cannot encode {type(obj).__name__} on a channel")


def _decode_tensor(expected: type, obj: Any) -> Any:
    if expected is not torch.Tensor:
        raise NotImplementedError(f"cannot decode {expected}")
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ValueError("a tensor is [dtype, shape, bytes]")
    dtype, shape, data = obj
    if dtype not in TENSOR_DTYPES:
        raise ValueError(f"tensor dtype {dtype!r} not accepted")
    if not (isinstance(shape, list) and len(shape) <= MAX_TENSOR_DIMS
            and all(type(n) is int and n >= 0 for n in shape) and isinstance(data, bytes)):
        raise ValueError("tensor shape must be a short list of sizes, its data bytes")
    torch_dtype = TENSOR_DTYPES[dtype]
    if math.prod(shape) * torch_dtype.itemsize != len(data):
        raise ValueError(f"tensor of shape {shape} and dtype {dtype} cannot hold {len(data)} bytes")
    if not data:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


def _alternatives(tp: Any) -> tuple[type, ...] | None:
    """The item types of ``list[A | B | ...]`` when more than one is a dataclass, else None."""
    if typing.get_origin(tp) is not list:
        return None
    (item,) = typing.get_args(tp)
    if typing.get_origin(item) not in (typing.Union, types.UnionType):
        return None
    options = typing.get_args(item)
    return options if sum(map(is_dataclass, options)) > 1 else None


class Codec:
    """Encodes values of ``tp`` and decodes bytes into ``tp`` only (``msgspec.ValidationError`` or
    ``msgspec.DecodeError`` otherwise)."""

    def __init__(self, tp: Any):
        self._options = _alternatives(tp)
        wire_type = tp if self._options is None else list[tuple[int, msgspec.Raw]]
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_tensor)
        self._decoder = msgspec.msgpack.Decoder(wire_type, dec_hook=_decode_tensor)
        self._item_decoders = [msgspec.msgpack.Decoder(t, dec_hook=_decode_tensor) for t in self._options or ()]

    def encode(self, value: Any) -> bytes:
        if self._options is not None:
            value = [(self._options.index(type(item)), item) for item in value]
        return self._encoder.encode(value)

    def decode(self, data: bytes | memoryview) -> Any:
        value = self._decoder.decode(data)
        if self._options is None:
            return value
        out = []
        for index, raw in value:
            if not 0 <= index < len(self._item_decoders):
                raise msgspec.ValidationError(f"item type {index} out of range")
            out.append(self._item_decoders[index].decode(raw))
        return out


class Call(msgspec.Struct, array_like=True):
    """Loop owner -> replica: run ``method`` on ``argument`` (encoded by that method's codec)."""

    call_id: int
    method: str
    argument: msgspec.Raw


class Reply(msgspec.Struct, array_like=True):
    """Replica -> loop owner: the method's result (its codec), or the failure's message (a str)."""

    call_id: int
    ok: bool
    result: msgspec.Raw


CALL = msgspec.msgpack.Decoder(Call)
REPLY = msgspec.msgpack.Decoder(Reply)
ENVELOPE = msgspec.msgpack.Encoder()
MESSAGE = Codec(str)

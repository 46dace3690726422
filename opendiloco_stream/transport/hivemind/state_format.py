"""The wire format of a state download (``state.py``): a manifest (the state's structure with tensors
replaced by references, each tensor's dtype and shape, a BLAKE2b digest per tensor and the total
bytes), then every tensor's raw bytes in parts of ``PART_BYTES``. No networking here."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import numpy as np
import torch

PART_BYTES = 1 << 20
_REF = "__ods_tensor__"
_SCALARS = (int, float, bool, str, bytes, type(None))


_TUPLE_EXT = 0x40  # msgpack extension type of a tuple (msgpack has lists only)


def _pack_tuple(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE_EXT, _dumps(list(obj)))
    raise TypeError(f"cannot serialize a {type(obj).__name__}")


def _unpack_ext(code: int, data: bytes) -> Any:
    if code == _TUPLE_EXT:
        return tuple(_loads(data))
    return msgpack.ExtType(code, data)


def _dumps(obj: Any) -> bytes:
    """msgpack, with tuples kept as tuples (an extension type)."""
    return msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_pack_tuple)


def _loads(data: bytes) -> Any:
    # map keys may be ints (optimizer state dicts are keyed by parameter index)
    return msgpack.unpackb(data, ext_hook=_unpack_ext, raw=False, strict_map_key=False)


class StateError(ValueError):
    """A download that does not match its manifest (truncated, wrong dtype or shape)."""


def flatten_state(state: Any) -> tuple[dict, list[torch.Tensor]]:
    """Split a nested state (dicts, lists, tuples; tensors and plain scalars) into a manifest and tensors."""
    tensors: list[torch.Tensor] = []

    def walk(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach().cpu().contiguous())
            return {_REF: len(tensors) - 1}
        if isinstance(obj, dict):
            return {k: walk(v, f"{where}[{k!r}]") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return tuple(items) if isinstance(obj, tuple) else items
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, _SCALARS):
            return obj
        raise TypeError(f"state{where}: cannot share a {type(obj).__name__}; use tensors, numbers, strings, dicts, lists")

    structure = walk(state, "")
    specs = [[str(t.dtype).replace("torch.", ""), list(t.shape)] for t in tensors]
    return {"v": 2, "structure": structure, "tensors": specs, "digests": [tensor_digest(t) for t in tensors],
            "bytes": sum(t.numel() * t.element_size() for t in tensors)}, tensors


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_digest(t: torch.Tensor) -> str:
    """BLAKE2b-128 of a tensor's dtype, shape and bytes: equal digests, equal tensors."""
    h = hashlib.blake2b(f"{t.dtype}{list(t.shape)}".encode(), digest_size=16)
    h.update(tensor_bytes(t.detach().cpu().contiguous()))
    return h.hexdigest()


def unflatten_state(manifest: dict, tensors: list[torch.Tensor]) -> Any:
    """Inverse of ``flatten_state``; checks the tensors against the manifest."""
    specs = manifest["tensors"]
    if len(tensors) != len(specs):
        raise StateError(f"got {len(tensors)} tensors, the manifest lists {len(specs)}")
    for i, (t, (dtype, shape)) in enumerate(zip(tensors, specs)):
        if str(t.dtype).replace("torch.", "") != dtype or list(t.shape) != list(shape):
            raise StateError(f"tensor {i} is {t.dtype}{list(t.shape)}, the manifest says {dtype}{shape}")

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {_REF}:
                return tensors[obj[_REF]]
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(manifest["structure"])

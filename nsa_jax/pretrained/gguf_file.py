"""A GGUF file's metadata and tensors, read without a copy: the header parsed once, tensors memory-mapped.

GGUF (version 2 and 3, little-endian): the magic `GGUF`, the version, the tensor and
key-value counts; the key-value pairs (a key string, a value type, the value: a scalar, a
string or an array of them); each tensor's name, dims (ggml order: the fastest axis first),
type and offset; then, aligned to `general.alignment` (32 by default), the tensors' data.
Metadata arrays of strings (a tokenizer's 49k tokens and merges) become Python lists and
numeric arrays numpy arrays, so the header costs a few MB, not a Python object per byte.
Dequantizing is the `gguf` package's (gguf.quants); this module only finds the bytes.
"""

from __future__ import annotations

import pathlib
import struct

import gguf
import ml_dtypes
import numpy as np

from nsa_jax.pretrained import PretrainedError

# Value types of the key-value pairs: struct format per scalar type; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16)}


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            elem, count = self.take("<I"), self.take("<Q")
            if elem == STRING:
                return [self.string() for _ in range(count)]
            if elem in _NUMPY:
                arr = np.frombuffer(self.buf, _NUMPY[elem], count, self.pos).copy()
                self.pos += arr.nbytes
                return arr
            return [self.value(elem) for _ in range(count)]
        return self.take(_SCALARS[kind])


class GGUFFile:
    """`metadata` {key: value}, `tensors` {name: (shape in numpy order, type name)}, `raw(name)`."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        try:
            if bytes(self._map[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            cur.pos = 4
            version = cur.take("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version}, expected 2 or 3")
            n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
            self.metadata = {}
            for _ in range(n_kv):
                key = cur.string()
                self.metadata[key] = cur.value(cur.take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
                infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
        except (struct.error, ValueError, IndexError) as e:
            raise PretrainedError(f"{self.path}: not a readable GGUF file ({e})") from None
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        self.tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        self._where: dict[str, tuple[int, int, int]] = {}  # name: (byte offset, rows, bytes a row)
        for name, dims, kind, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise PretrainedError(f"{self.path.name}: tensor {name} has GGUF type id {kind}, unknown") from None
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows = int(np.prod(dims[1:], dtype=np.int64))
            self.tensors[name] = (tuple(int(d) for d in reversed(dims)), qtype.name)
            self._where[name] = (start + offset, rows, dims[0] // block * size)
        # Every tensor's data within the file, checked before any is read: a truncated download is one line.
        size = len(self._map)
        for name, (offset, rows, row_bytes) in self._where.items():
            if offset + rows * row_bytes > size:
                raise PretrainedError(
                    f"{self.path} is not a complete GGUF file: tensor {name}'s data ends at byte "
                    f"{offset + rows * row_bytes:,}, the file has {size:,}; download it again"
                )

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, memory-mapped: [rows, bytes a row] (float types: the values, numpy order)."""
        offset, rows, row_bytes = self._where[name]
        data = self._map[offset : offset + rows * row_bytes]
        shape, kind = self.tensors[name]
        if kind in FLOATS:
            return data.view(FLOATS[kind]).reshape(shape)
        return data.reshape(rows, row_bytes)

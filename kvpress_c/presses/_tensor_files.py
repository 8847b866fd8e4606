"""Tensors of the hub-file presses from local files, with NumPy only: safetensors (F32, F16, BF16, F64; the
`safetensors` package cannot give bf16 to NumPy, and statistics saved from a bf16 model are bf16) and .npz;
a safetensors writer for the statistics kvpress_c produces."""
from __future__ import annotations

import json
import os
import struct

import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """name -> array (BF16 widened to float32) of a .safetensors file; ValueError on a malformed one."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        (hlen,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + hlen].decode("utf-8"))
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
    out, data = {}, memoryview(raw)[8 + hlen:]
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"{path}: tensor {name!r} has no dtype/shape/data_offsets entry")
        dtype = _DTYPES.get(info.get("dtype"))
        offsets, shape = info.get("data_offsets"), info.get("shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
                and isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)):
            raise ValueError(f"{path}: tensor {name!r} has a malformed shape or data_offsets")
        begin, end = offsets
        shape = tuple(shape)
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r} (need F32, F16, BF16 or F64)")
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= len(data) or end - begin != count * np.dtype(dtype).itemsize:
            raise ValueError(f"{path}: tensor {name!r} does not fit its data offsets")
        a = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = np.array(a)
    return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """A .safetensors file of float32 tensors (the layout safetensors' save_file writes)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        blobs.append(a.tobytes())
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def read_tensors(path: str) -> dict[str, np.ndarray]:
    """name -> float32 array from a .safetensors or .npz file."""
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:
            return {k: np.asarray(z[k], dtype=np.float32) for k in z.files}
    return {k: np.asarray(v, dtype=np.float32) for k, v in read_safetensors(path).items()}

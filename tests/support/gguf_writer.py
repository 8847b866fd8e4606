"""A small hand-written GGUF writer for tests: full control over the version, alignment, metadata
types and tensor bytes, and a record of where every field landed in the file (so that fuzzers can
lie about a specific count, length, dimension, type or offset).

Layout (little-endian): "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv x (string key, u32 type,
value); n_tensors x (string name, u32 n_dims, n_dims x u64 ne, u32 ggml type, u64 offset); padding
to the alignment; tensor data (offsets relative to its start, each aligned). Strings are a u64
length and bytes; arrays are a u32 element type, a u64 count and the elements.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

# GGUF metadata value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q", I64: "<q",
           F64: "<d"}

# ggml tensor types: id, values per block, bytes per block
GGML = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
        "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
        "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "IQ2_XXS": (16, 256, 66), "BF16": (30, 1, 2)}
# byte offsets of the fp16 scale fields inside a block (random blocks keep these sane)
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,)}


@dataclass
class Field:
    kind: str   # "n_tensors", "n_kv", "key_len", "value_type", "array_type", "array_len", "str_len",
                # "name_len", "n_dims", "ne", "ggml_type", "offset", "alignment", "value" (a scalar's bytes)
    pos: int
    size: int   # 4 or 8 ("value": 1 to 8)
    owner: str = ""
    vtype: int = -1  # "value": its GGUF value type


@dataclass
class Layout:
    fields: list = field(default_factory=list)
    info_end: int = 0    # end of the tensor infos (header + metadata + infos)
    data_start: int = 0


@dataclass
class Lazy:
    """Tensor bytes made when the file is written (write() streams them: a multi-GB file is never in memory)."""
    nbytes: int
    make: object  # () -> bytes-like of nbytes

    def __len__(self):
        return self.nbytes


class GGUFFile:
    def __init__(self, version: int = 3, alignment: int | None = None):
        self.version = version
        self.alignment = alignment
        self.kv: list[tuple[str, int, object, int | None]] = []
        self.tensors: list[tuple[str, list[int], int, bytes]] = []

    # -- metadata -------------------------------------------------------------------------------
    def add(self, key: str, vtype: int, value, elem_type: int | None = None):
        """A scalar (vtype != ARRAY) or an array (vtype == ARRAY, elem_type given, value a list)."""
        self.kv.append((key, vtype, value, elem_type))
        return self

    def u32(self, key, v): return self.add(key, U32, v)
    def f32(self, key, v): return self.add(key, F32, v)
    def str(self, key, v): return self.add(key, STRING, v)
    def arr(self, key, elem_type, values): return self.add(key, ARRAY, list(values), elem_type)

    # -- tensors --------------------------------------------------------------------------------
    def tensor(self, name: str, ne: list[int], ggml_type: int, data: bytes):
        """ne in ggml order (contiguous dimension first)."""
        self.tensors.append((name, list(ne), ggml_type, data if isinstance(data, Lazy) else bytes(data)))
        return self

    def add_array(self, name: str, x: np.ndarray, type_name: str = "F32", rng=None):
        """A NumPy array ([rows, cols] or [cols]) encoded as `type_name` (see encode())."""
        self.tensors.append((name, list(reversed(x.shape)), GGML[type_name][0], encode(x, type_name, rng)))
        return self

    # -- serialisation --------------------------------------------------------------------------
    def to_bytes(self) -> tuple[bytes, Layout]:
        out, lay, offsets = self._header()
        for (name, ne, t, data), off in zip(self.tensors, offsets):
            assert len(out) - lay.data_start == off
            out.extend(data.make() if isinstance(data, Lazy) else data)
            out.extend(b"\0" * (-len(out) % (self.alignment or 32)))
        return bytes(out), lay

    def _header(self) -> tuple[bytearray, Layout, list]:
        """Header, metadata, tensor infos and the padding up to the data; the data offsets."""
        out = bytearray()
        lay = Layout()

        def mark(kind, size, owner=""):
            lay.fields.append(Field(kind, len(out), size, owner))

        def put_str(s, kind, owner=""):
            b = s.encode() if isinstance(s, str) else bytes(s)
            mark(kind, 8, owner)
            out.extend(struct.pack("<Q", len(b)))
            out.extend(b)

        def put_value(t, v, owner, scalar=False):
            if t == STRING:
                put_str(v, "str_len", owner)
            else:
                if scalar:
                    lay.fields.append(Field("value", len(out), struct.calcsize(_SCALAR[t]), owner, t))
                out.extend(struct.pack(_SCALAR[t], v))

        out.extend(b"GGUF")
        out.extend(struct.pack("<I", self.version))
        mark("n_tensors", 8)
        out.extend(struct.pack("<Q", len(self.tensors)))
        mark("n_kv", 8)
        out.extend(struct.pack("<Q", len(self.kv)))
        for key, t, v, et in self.kv:
            put_str(key, "key_len", key)
            mark("value_type", 4, key)
            out.extend(struct.pack("<I", t))
            if t == ARRAY:
                mark("array_type", 4, key)
                out.extend(struct.pack("<I", et))
                mark("array_len", 8, key)
                out.extend(struct.pack("<Q", len(v)))
                for x in v:
                    put_value(et, x, key)
            else:
                if key == "general.alignment":
                    mark("alignment", struct.calcsize(_SCALAR[t]), key)
                put_value(t, v, key, scalar=True)
        align = self.alignment or 32
        offset = 0
        offsets = []
        for name, ne, t, data in self.tensors:
            put_str(name, "name_len", name)
            mark("n_dims", 4, name)
            out.extend(struct.pack("<I", len(ne)))
            for d in ne:
                mark("ne", 8, name)
                out.extend(struct.pack("<Q", d))
            mark("ggml_type", 4, name)
            out.extend(struct.pack("<I", t))
            mark("offset", 8, name)
            out.extend(struct.pack("<Q", offset))
            offsets.append(offset)
            offset += (len(data) + align - 1) // align * align
        lay.info_end = len(out)
        out.extend(b"\0" * (-len(out) % align))
        lay.data_start = len(out)
        return out, lay, offsets

    def write(self, path: str) -> Layout:
        """Header first, then each tensor's bytes as they are made (Lazy tensors one at a time)."""
        out, lay, offsets = self._header()
        align = self.alignment or 32
        with open(path, "wb") as fh:
            fh.write(out)
            pos = 0
            for (name, ne, t, data), off in zip(self.tensors, offsets):
                assert pos == off
                b = data.make() if isinstance(data, Lazy) else data
                assert len(b) == len(data), name
                fh.write(b)
                pad = -len(b) % align
                fh.write(b"\0" * pad)
                pos += len(b) + pad
        return lay


# -- tensor encodings (round-to-nearest quantisers written from the block layouts) ---------------

def _f16_bytes(x) -> bytes:
    return np.asarray(x, dtype=np.float16).tobytes()


def encode(x: np.ndarray, type_name: str, rng=None) -> bytes:
    """Encode float values row by row. F32/F16/BF16 round; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 quantise; the
    k-quants (Q2_K..Q6_K) and IQ2_XXS get random blocks with small fp16 scales (the values of x
    only fix the size), which is all the loader tests need."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1)
    if type_name == "F32":
        return flat.tobytes()
    if type_name == "F16":
        return flat.astype(np.float16).tobytes()
    if type_name == "BF16":
        bits = flat.view(np.uint32)
        rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.tobytes()
    _, be, bb = GGML[type_name]
    assert x.shape[-1] % be == 0, f"{type_name} rows must be a multiple of {be}"
    blocks = flat.reshape(-1, be).astype(np.float64)
    out = bytearray()
    if type_name in ("Q4_0", "Q5_0", "Q8_0"):
        bits = {"Q4_0": 4, "Q5_0": 5, "Q8_0": 8}[type_name]
        half = 1 << (bits - 1)
        for b in blocks:
            amax = np.max(np.abs(b))
            d = np.float16(amax / (half - 1) if amax > 0 else 0.0)
            q = np.zeros(32, dtype=np.int64) if d == 0 else np.clip(np.rint(b / np.float64(d)), -half, half - 1).astype(np.int64)
            if type_name == "Q8_0":
                out += _f16_bytes(d) + q.astype(np.int8).tobytes()
                continue
            u = q + half  # stored unsigned
            lo = (u[:16] & 15) | ((u[16:] & 15) << 4)
            if type_name == "Q4_0":
                out += _f16_bytes(d) + lo.astype(np.uint8).tobytes()
            else:
                qh = sum(int((u[j] >> 4) & 1) << j for j in range(32))
                out += _f16_bytes(d) + struct.pack("<I", qh) + lo.astype(np.uint8).tobytes()
        return bytes(out)
    if type_name in ("Q4_1", "Q5_1"):
        levels = 15 if type_name == "Q4_1" else 31
        for b in blocks:
            lo_v, hi_v = b.min(), b.max()
            d = np.float16((hi_v - lo_v) / levels)
            m = np.float16(lo_v)
            q = np.zeros(32, dtype=np.int64) if d == 0 else np.clip(np.rint((b - np.float64(m)) / np.float64(d)), 0, levels).astype(np.int64)
            lo = (q[:16] & 15) | ((q[16:] & 15) << 4)
            if type_name == "Q4_1":
                out += _f16_bytes(d) + _f16_bytes(m) + lo.astype(np.uint8).tobytes()
            else:
                qh = sum(int((q[j] >> 4) & 1) << j for j in range(32))
                out += _f16_bytes(d) + _f16_bytes(m) + struct.pack("<I", qh) + lo.astype(np.uint8).tobytes()
        return bytes(out)
    rng = rng if rng is not None else np.random.default_rng(0)
    return random_blocks(rng, type_name, blocks.shape[0])


def random_blocks(rng, type_name: str, n_blocks: int, scale: float = 0.01) -> bytes:
    """Random blocks of a block-quantised type with small, finite fp16 scale fields."""
    _, be, bb = GGML[type_name]
    raw = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8)
    for off in SCALE_FIELDS[type_name]:
        raw[:, off:off + 2] = rng.uniform(-scale, scale, size=n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.tobytes()


# -- a tiny Llama-family model --------------------------------------------------------------------

def tiny_model(arch: str = "llama", *, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
               ffn: int = 64, vocab: int = 64, head_dim: int | None = None, types: dict | None = None, default_type: str = "F32", bias: bool = False,
               tied: bool = True, rope_freqs=None, seed: int = 0, version: int = 3, alignment: int | None = None,
               meta: dict | None = None, skip_meta: tuple = (), tokens: bool = True, weights: dict | None = None) -> GGUFFile:
    """A GGUF Llama/Qwen2/Qwen3-style model with random weights (qwen3: per-head q/k norms). `types` maps a tensor suffix (e.g. "attn_q",
    "token_embd", "output") to an encoding; `meta` adds or overrides `{arch}.*` keys (name without
    the prefix -> (type, value)); `skip_meta` drops keys (names without the prefix); `weights`
    receives name -> (type name, ggml ne, encoded bytes) for every tensor written."""
    rng = np.random.default_rng(seed)
    types = types or {}
    head_dim = head_dim or hidden // heads
    g = GGUFFile(version=version, alignment=alignment)
    g.str("general.architecture", arch)
    if alignment is not None:
        g.u32("general.alignment", alignment)
    keys = {"block_count": (U32, layers), "context_length": (U32, 256), "embedding_length": (U32, hidden),
            "feed_forward_length": (U32, ffn), "attention.head_count": (U32, heads),
            "attention.head_count_kv": (U32, kv_heads), "rope.freq_base": (F32, 10000.0),
            "attention.layer_norm_rms_epsilon": (F32, 1e-5), "rope.dimension_count": (U32, head_dim),
            "vocab_size": (U32, vocab)}
    keys.update(meta or {})
    for k, (t, v) in keys.items():
        if k not in skip_meta:
            g.add(f"{arch}.{k}", t, v)
    if tokens:
        g.arr("tokenizer.ggml.tokens", STRING, [f"<t{i}>" for i in range(vocab)])
        g.u32("tokenizer.ggml.bos_token_id", 1)
        g.u32("tokenizer.ggml.eos_token_id", 2)

    def add(name, shape):
        x = (rng.standard_normal(shape) * (1.0 if name.endswith("norm.weight") else 0.1)).astype(np.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        key = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        tname = types.get(key, "F32" if len(shape) == 1 else default_type)
        data = encode(x, tname, rng)
        if weights is not None:
            weights[name] = (tname, list(reversed(shape)), data)
        g.tensor(name, list(reversed(shape)), GGML[tname][0], data)

    add("token_embd.weight", (vocab, hidden))
    add("output_norm.weight", (hidden,))
    if not tied:
        add("output.weight", (vocab, hidden))
    qd, kd = heads * head_dim, kv_heads * head_dim
    for l in range(layers):
        add(f"blk.{l}.attn_norm.weight", (hidden,))
        add(f"blk.{l}.attn_q.weight", (qd, hidden))
        add(f"blk.{l}.attn_k.weight", (kd, hidden))
        add(f"blk.{l}.attn_v.weight", (kd, hidden))
        add(f"blk.{l}.attn_output.weight", (hidden, qd))
        if arch == "qwen3":
            add(f"blk.{l}.attn_q_norm.weight", (head_dim,))
            add(f"blk.{l}.attn_k_norm.weight", (head_dim,))
        if bias:
            add(f"blk.{l}.attn_q.bias", (qd,))
            add(f"blk.{l}.attn_k.bias", (kd,))
            add(f"blk.{l}.attn_v.bias", (kd,))
        add(f"blk.{l}.ffn_norm.weight", (hidden,))
        add(f"blk.{l}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{l}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{l}.ffn_down.weight", (hidden, ffn))
    if rope_freqs is not None:
        g.add_array("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    return g


# -- a minimal reader (tests only: an implementation independent of the C parser) ----------------

def read_gguf(path: str):
    """-> (metadata {key: value or list}, tensors {name: (ggml type id, ne, file offset, nbytes)})."""
    meta, tensors, _ = _parse_gguf(path)
    return meta, tensors


def gguf_layout(path: str) -> Layout:
    """Where every field of any GGUF file lies (as GGUFFile.write records it for its own files): for fuzzers."""
    return _parse_gguf(path)[2]


def _parse_gguf(path: str):
    with open(path, "rb") as fh:
        buf = fh.read()
    pos = 0
    lay = Layout()

    def take(fmt, kind=None, owner="", vtype=-1):
        nonlocal pos
        if kind:
            lay.fields.append(Field(kind, pos, struct.calcsize(fmt), owner, vtype))
        v = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v[0]

    def string(kind, owner=""):
        nonlocal pos
        n = take("<Q", kind, owner)
        s = buf[pos:pos + n].decode("utf-8", errors="replace")
        pos += n
        return s

    def value(t, owner, scalar=False):
        if t == STRING:
            return string("str_len", owner)
        return take(_SCALAR[t], "value" if scalar else None, owner, t)

    assert buf[:4] == b"GGUF"
    pos = 4
    take("<I")
    n_tensors, n_kv = take("<Q", "n_tensors"), take("<Q", "n_kv")
    meta = {}
    for _ in range(n_kv):
        key = string("key_len")
        t = take("<I", "value_type", key)
        if t == ARRAY:
            et, n = take("<I", "array_type", key), take("<Q", "array_len", key)
            meta[key] = [value(et, key) for _ in range(n)]
        else:
            if key == "general.alignment":
                lay.fields.append(Field("alignment", pos, struct.calcsize(_SCALAR[t]), key))
            meta[key] = value(t, key, scalar=True)
    infos = []
    for _ in range(n_tensors):
        name = string("name_len")
        nd = take("<I", "n_dims", name)
        ne = [take("<Q", "ne", name) for _ in range(nd)]
        infos.append((name, take("<I", "ggml_type", name), ne, take("<Q", "offset", name)))
    lay.info_end = pos
    align = meta.get("general.alignment", 32)
    data_start = (pos + align - 1) // align * align
    lay.data_start = data_start
    by_id = {v[0]: (v[1], v[2]) for v in GGML.values()}
    tensors = {}
    for name, t, ne, off in infos:
        n = int(np.prod(ne))
        be, bb = by_id[t]
        tensors[name] = (t, ne, data_start + off, n // be * bb)
    return meta, tensors, lay

#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Cross-reader test of gradjit's safetensors files (ctest safetensors_cross_reader).

  cross_reader.py ST_XCHECK WORKDIR

1. st_xcheck writes a file with gradjit; this script reads it with its own
   small reader (struct + json + numpy.frombuffer, no safetensors package),
   checks the layout the format requires (header length, '{', padding to 8,
   offsets tiling the data region) and compares every value bit for bit
   (bf16 through its uint16 patterns, floats through their integer views).
2. This script writes a file with numpy (pretty-printed JSON header, keys in
   another order than the data, an 8-byte-aligned header as the reference
   pads it) and st_xcheck reads it with gradjit and compares.
"""
import json
import math
import os
import struct
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    sys.exit("cross_reader.py: numpy is missing: apt install python3-numpy (scripts/deps.sh)")

DTYPES = {"F32": "<f4", "F64": "<f8", "BF16": "<u2", "I64": "<i8"}
SIZES = {"F32": 4, "F64": 8, "BF16": 2, "I64": 8}


def fail(msg):
    sys.exit("cross_reader.py: " + msg)


def read_safetensors(path):
    """An independent reader: returns ({name: ndarray}, metadata, header order)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        fail(f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        fail(f"{path}: header length {n} beyond the file")
    if (8 + n) % 8 != 0:
        fail(f"{path}: header not padded to a multiple of 8 (8 + {n})")
    text = raw[8:8 + n].decode("utf-8")
    if not text.startswith("{"):
        fail(f"{path}: header does not start with '{{'")
    if text.rstrip(" ") != text.rstrip():
        fail(f"{path}: padding is not spaces")
    pairs = json.loads(text, object_pairs_hook=lambda kv: kv)
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        fail(f"{path}: duplicate keys")
    header = dict(pairs)
    meta = dict(header.pop("__metadata__", []) or [])
    data = raw[8 + n:]
    spans, out = [], {}
    for name, info in header.items():
        info = dict(info)
        if set(info) != {"dtype", "shape", "data_offsets"}:
            fail(f"{name}: fields {sorted(info)}")
        dt, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        count = math.prod(shape)
        if e - b != count * SIZES[dt]:
            fail(f"{name}: {e - b} bytes for {dt} {shape}")
        if b % SIZES[dt] != 0:
            fail(f"{name}: offset {b} not aligned to {SIZES[dt]}")
        spans.append((b, e, name))
        out[name] = np.frombuffer(data[b:e], dtype=DTYPES[dt]).reshape(shape), dt
    pos = 0
    for b, e, name in sorted(spans):
        if b != pos:
            fail(f"{name}: starts at {b}, expected {pos} (gap or overlap)")
        pos = e
    if pos != len(data):
        fail(f"data region is {len(data)} bytes, tensors cover {pos}")
    return out, meta, [k for k in keys if k != "__metadata__"]


def same_bits(got, want, name):
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    if g.shape != w.shape or g.dtype.itemsize != w.dtype.itemsize:
        fail(f"{name}: shape/dtype {g.shape} {g.dtype} vs {w.shape} {w.dtype}")
    view = {2: "<u2", 4: "<u4", 8: "<u8"}[g.dtype.itemsize]
    if g.size and not np.array_equal(g.view(view), w.view(view)):
        i = int(np.argmax(g.view(view).ravel() != w.view(view).ravel()))
        fail(f"{name}: element {i} is {g.ravel()[i]!r}, expected {w.ravel()[i]!r}")


def check_gradjit_file(path):
    got, meta, order = read_safetensors(path)
    want = {
        "gj.f32": ("F32", (np.arange(12, dtype=np.float32) * np.float32(0.5)
                           - np.float32(3)).reshape(3, 4)),
        "gj.f64": ("F64", np.array([math.pi, -1e300, 5e-324, math.inf, -0.0], dtype="<f8")),
        "gj.bf16": ("BF16", np.array([0x3f80, 0xbf80, 0x7fc0, 0x0001, 0xff80, 0x4049],
                                     dtype="<u2").reshape(2, 3)),
        "gj.i64": ("I64", np.array([-2**63, -1, 0, 2**63 - 1], dtype="<i8")),
        "gj.scalar": ("F32", np.array(2.5, dtype="<f4")),
        "gj.empty": ("F32", np.zeros((0, 3), dtype="<f4")),
    }
    if set(got) != set(want):
        fail(f"names {sorted(got)}, expected {sorted(want)}")
    for name, (dt, arr) in want.items():
        a, gdt = got[name]
        if gdt != dt:
            fail(f"{name}: dtype {gdt}, expected {dt}")
        same_bits(a, arr.astype(a.dtype) if dt != "BF16" else arr, name)
    # bf16 values as floats: the upper half of an f32
    bf = (got["gj.bf16"][0].astype("<u4") << 16).view("<f4")
    if bf[0, 0] != 1.0 or bf[0, 1] != -1.0 or not math.isnan(bf[0, 2]):
        fail(f"gj.bf16 as f32: {bf}")
    torch = optional_torch()
    if torch is not None:  # PyTorch's own bf16 decoding of the same bytes
        t = torch.frombuffer(bytearray(got["gj.bf16"][0].tobytes()), dtype=torch.bfloat16)
        v = t.float().tolist()
        if v[0] != 1.0 or v[1] != -1.0 or not math.isnan(v[2]) or v[4] != -math.inf \
                or v[5] != 3.140625 or v[3] != 2.0 ** -133:
            fail(f"gj.bf16 through torch.bfloat16: {v}")
        print(f"cross_reader.py: torch {torch.__version__} decodes gj.bf16 as {v}")
    if meta != {"format": "pt", "unicode": "\u00e9\u20ac \"q\""}:
        fail(f"metadata {meta}")
    # the reference's order: larger dtypes first, then by name
    rank = {"I64": 3, "F64": 2, "F32": 1, "BF16": 0}
    ref = sorted(want, key=lambda k: (-rank[want[k][0]], k))
    if order != ref:
        fail(f"header order {order}, the reference writes {ref}")
    print(f"cross_reader.py: {path}: numpy read 6 tensors and the metadata, bit for bit")


def optional_torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def write_numpy_file(path):
    tensors = {  # in this (deliberately unsorted) header order
        "py.bf16": ("BF16", bf16_bits([2.0, -3.0, 0.0, -0.0])),
        "py.f32": ("F32", (np.arange(6, dtype=np.float32) * np.float32(0.25)
                           - np.float32(1)).reshape(2, 3)),
        "py.i64 \u2713": ("I64", np.array([[2**40, -5], [7, -2**62]], dtype="<i8")),
        "py.f64": ("F64", np.array([1 / 3, -2.5, 1e-310], dtype="<f8")),
        "py.one": ("F64", np.array([42.0], dtype="<f8")),
    }
    # data laid out in reverse header order, 8-byte tensors first for alignment
    layout = sorted(tensors, key=lambda k: (-SIZES[tensors[k][0]], k), reverse=False)
    header, blobs, pos = {"__metadata__": {"writer": "numpy"}}, [], 0
    offsets = {}
    for name in layout:
        dt, arr = tensors[name]
        b = np.ascontiguousarray(arr).tobytes()
        offsets[name] = (pos, pos + len(b))
        blobs.append(b)
        pos += len(b)
    for name, (dt, arr) in tensors.items():
        header[name] = {"shape": list(arr.shape), "dtype": dt,
                        "data_offsets": list(offsets[name])}
    text = json.dumps(header, indent=1, ensure_ascii=True).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def bf16_bits(values):
    """bf16 bit patterns of values: by PyTorch when present, else by
    truncating f32 (exact for these values)."""
    torch = optional_torch()
    if torch is not None:
        t = torch.tensor(values, dtype=torch.bfloat16).view(torch.int16)
        return np.array(t.tolist(), dtype="<i2").view("<u2")
    return (np.array(values, dtype="<f4").view("<u4") >> 16).astype("<u2")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    xcheck, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    a = os.path.join(work, "from_gradjit.safetensors")
    b = os.path.join(work, "from_numpy.safetensors")
    subprocess.run([xcheck, "write", a], check=True)
    check_gradjit_file(a)
    write_numpy_file(b)
    # our own reader accepts what we wrote (a check of the writer above)
    read_safetensors(b)
    subprocess.run([xcheck, "read", b], check=True)
    print(f"cross_reader.py: numpy {np.__version__}: both directions agree")


if __name__ == "__main__":
    main()

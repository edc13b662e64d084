"""Reads a zoffload checkpoint with the safetensors package and compares it with what
zc_tensor_read returned (raw fp32 files NAME.STATE.f32 in RAW), and checks each array's
CRC-32C in the metadata.  Compressed moments (BF16; U8 codes with F32 per-block scales)
are decoded here, written from the definition in kernels/quant.h in float32 numpy, and
must equal zc_tensor_read's bits.  Usage: read_safetensors.py CKPT_DIR RAW_DIR FORMAT"""
import glob
import json
import os
import sys

import numpy
from safetensors import safe_open
from safetensors.numpy import load_file

BLOCK = 256
OFFSET = numpy.float32(2.0 ** -15)
BIAS = 112 << 23
RCP_M = numpy.float32(1.0 / (1.875 - 2.0 ** -15))
RCP_V = numpy.float32(1.0 / (1.9375 - 2.0 ** -15))
DTYPES = {"fp32": "F32", "bf16-moments": "BF16", "q8-moments": "U8"}


def crc32c(data):
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def load(path):
    """Every array of the file as numpy, BF16 as its uint16 bits (numpy has no bfloat16)."""
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
    try:
        return load_file(path), meta
    except TypeError:
        pass
    import torch
    arrays = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            if t.dtype == torch.bfloat16:
                arrays[key] = t.view(torch.int16).numpy().view(numpy.uint16)
            else:
                arrays[key] = t.numpy()
    return arrays, meta


def f32_of_bits(bits):
    return numpy.asarray(bits, dtype=numpy.uint32).view(numpy.float32)


def q8_value(codes, mant):
    return f32_of_bits((codes.astype(numpy.uint32) << (23 - mant)) + BIAS) - OFFSET


def decode(arrays, name, state):
    """exp_avg or exp_avg_sq of tensor name as float32, as the daemon decodes it."""
    a = arrays[name + "/" + state]
    if a.dtype == numpy.float32:
        return a
    if a.dtype == numpy.uint16:
        return f32_of_bits(a.astype(numpy.uint32) << 16)
    assert a.dtype == numpy.uint8, (name, state, a.dtype)
    scale = arrays[name + "/" + state + "_scale"]
    assert scale.dtype == numpy.float32 and scale.shape == ((a.size + BLOCK - 1) // BLOCK,)
    per = numpy.repeat(scale, BLOCK)[: a.size]
    if state == "exp_avg":
        u = per * RCP_M
        mag = q8_value(a & 0x7F, 3) * u
        bits = mag.view(numpy.uint32) | ((a.astype(numpy.uint32) & 0x80) << 24)
        return bits.view(numpy.float32)
    r = q8_value(a, 4) * (per * RCP_V)
    return r * r


def main():
    ckpt, raw, fmt = sys.argv[1], sys.argv[2], sys.argv[3]
    files = sorted(glob.glob(os.path.join(ckpt, "rank-*-of-*.safetensors")))
    assert files, "no rank files in " + ckpt
    checked = 0
    for path in files:
        arrays, meta = load(path)
        assert meta["format"] == "zoffload.checkpoint.1", meta["format"]
        json.loads(meta["hyperparameters"])
        for key, arr in arrays.items():
            crc = int(meta[key + "/crc32c"], 16)
            assert crc32c(arr.tobytes()) == crc, key + ": CRC-32C differs"
            assert arr.ndim == 1, (key, arr.shape)
            checked += 1
        for key in arrays:
            name, state = key.rsplit("/", 1)
            if state not in ("master", "exp_avg", "exp_avg_sq"):
                continue
            assert meta[name + "/state_format"] == fmt, (name, meta[name + "/state_format"])
            if state != "master":
                # Saved as the format keeps them: no decoded copy.
                want_dtype = {"F32": numpy.float32, "BF16": numpy.uint16,
                              "U8": numpy.uint8}[DTYPES[fmt]]
                assert arrays[key].dtype == want_dtype, (key, arrays[key].dtype)
            got = decode(arrays, name, state) if state != "master" else arrays[key]
            assert got.dtype == numpy.float32
            want = numpy.fromfile(os.path.join(raw, name + "." + state + ".f32"),
                                  dtype=numpy.float32)
            assert want.shape == got.shape, (key, want.shape, got.shape)
            assert want.tobytes() == got.tobytes(), key + " differs from zc_tensor_read"
            assert int(meta[name + "/step"]) > 0
        scales = [k for k in arrays if k.endswith("_scale")]
        assert (len(scales) > 0) == (fmt == "q8-moments"), scales
    print("%d arrays in %d files (%s) equal zc_tensor_read" % (checked, len(files), fmt))


main()

"""Reads a zoffload checkpoint with the safetensors package and compares it with what
zc_tensor_read returned (raw fp32 files NAME.STATE.f32 in RAW), and checks each array's
CRC-32C in the metadata.  Usage: read_safetensors.py CKPT_DIR RAW_DIR"""
import glob
import json
import os
import sys

import numpy
from safetensors import safe_open
from safetensors.numpy import load_file


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


def main():
    ckpt, raw = sys.argv[1], sys.argv[2]
    files = sorted(glob.glob(os.path.join(ckpt, "rank-*-of-*.safetensors")))
    assert files, "no rank files in " + ckpt
    checked = 0
    for path in files:
        arrays = load_file(path)
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata()
        assert meta["format"] == "zoffload.checkpoint.1", meta["format"]
        json.loads(meta["hyperparameters"])
        for key, arr in arrays.items():
            name, state = key.rsplit("/", 1)
            assert arr.dtype == numpy.float32 and arr.ndim == 1, (key, arr.dtype, arr.shape)
            want = numpy.fromfile(os.path.join(raw, name + "." + state + ".f32"),
                                  dtype=numpy.float32)
            assert want.shape == arr.shape, (key, want.shape, arr.shape)
            assert want.tobytes() == arr.tobytes(), key + " differs from zc_tensor_read"
            crc = int(meta[key + "/crc32c"], 16)
            assert crc32c(arr.tobytes()) == crc, key + ": CRC-32C differs"
            assert int(meta[name + "/step"]) > 0
            checked += 1
    print("%d arrays in %d files equal zc_tensor_read" % (checked, len(files)))


main()

#!/usr/bin/env python3
"""Rewrites a .cu file into host C++ for the CUDA stand-in (zs_kernel.h is force-included).

Only the launch syntax changes: `kernel<<<cfg>>>(args)` becomes
`zs::make_launcher(coop, kernel, cfg)(args)`, on the same line, so compiler
messages keep the .cu's line numbers (#line).  coop is 1 when the kernel's
body uses __syncthreads or a warp shuffle: its threads then run as fibers.
"""
import re
import sys


def kernel_bodies(text):
    """{name: body} for every __global__ function defined in text."""
    out = {}
    for m in re.finditer(r'__global__\s+void\s+(\w+)\s*\(', text):
        start = text.index('{', m.end())
        depth = 0
        for i in range(start, len(text)):
            if text[i] == '{':
                depth += 1
            elif text[i] == '}':
                depth -= 1
                if depth == 0:
                    out[m.group(1)] = text[start:i + 1]
                    break
    return out


def main():
    src, dst = sys.argv[1], sys.argv[2]
    text = open(src).read()
    coop = {name: bool(re.search(r'__syncthreads|__shfl_\w*sync', body))
            for name, body in kernel_bodies(text).items()}

    def launch(m):
        name = m.group(1)
        base = re.sub(r'<.*', '', name).strip()
        if base not in coop:
            sys.exit(f'{src}: launch of {base}, which is not a __global__ function here')
        return f'zs::make_launcher({int(coop[base])}, {name}, {m.group(2)})('

    out, n = re.subn(r'(\w+(?:<[\w\s:*,]*>)?)\s*<<<(.*?)>>>\s*\(', launch, text, flags=re.S)
    if '<<<' in out:
        sys.exit(f'{src}: a launch cu2cc.py cannot rewrite is left')
    with open(dst, 'w') as f:
        f.write(f'#line 1 "{src}"\n' + out)


if __name__ == '__main__':
    main()

#!/usr/bin/env python3
"""Counts, in each kernel of a CUDA object file, the register moves that read
a register last written by a global load: such a move waits for the load,
so a fetch meant to be in flight across a loop round is waited for where
the move stands (cuda/NOTES.md, "One block in flight").

    scripts/sass-moves.py build-cuda/CMakeFiles/luma_objects.dir/cuda/matmul.cu.o [REGEX]

REGEX (default: mmv_direct at one activation row) selects kernels by their
mangled names. cuobjdump comes from $CUOBJDUMP, else the PATH (the CUDA
toolkit's, or the one in Triton's wheel: triton/backends/nvidia/bin)."""
import os
import re
import subprocess
import sys

CUOBJDUMP = os.environ.get("CUOBJDUMP", "cuobjdump")
LOAD_WIDTH = {".128": 4, ".64": 2}


def kernels(obj, pattern):
    out = subprocess.run([CUOBJDUMP, "-res-usage", obj], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"Function (\S+):", line)
        if m and re.search(pattern, m.group(1)):
            regs = re.search(r"REG:(\d+)", lines[i + 1]) if i + 1 < len(lines) else None
            yield m.group(1), regs.group(1) if regs else "?"


def instructions(obj, name):
    out = subprocess.run([CUOBJDUMP, "-sass", "-fun", name, obj], capture_output=True, text=True, check=True).stdout
    return [m.group(1) for m in (re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", l) for l in out.splitlines()) if m]


def waiting_moves(ins, window=80):
    """Moves whose source register was last written by a global load."""
    n = 0
    for i, x in enumerate(ins):
        m = re.match(r"(@!?P\d\s+)?IMAD\.MOV\.U32 R(\d+), RZ, RZ, R(\d+)$", x)
        if not m:
            continue
        src = int(m.group(3))
        for y in reversed(ins[max(0, i - window):i]):
            d = re.match(r"(@!?P\d\s+)?(\S+)\s+R(\d+)", y)
            if not d:
                continue
            op, r = d.group(2), int(d.group(3))
            width = next((w for k, w in LOAD_WIDTH.items() if k in op), 1)
            if r <= src < r + width:
                n += op.startswith("LDG")
                break
    return n


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    obj = sys.argv[1]
    pattern = sys.argv[2] if len(sys.argv) > 2 else r"^_Z10mmv_direct.*Li1ELi1ELb[01]E"
    for name, regs in sorted(kernels(obj, pattern)):
        ins = instructions(obj, name)
        print(f"{waiting_moves(ins):3d} waiting moves  {regs:>3} registers  {len(ins):5d} instructions  {name}")


if __name__ == "__main__":
    main()

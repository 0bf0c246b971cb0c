#!/usr/bin/python3
"""Checks that the kernels compiled for an instruction set leak no code for it into symbols other
code can link to (src/kernels/isa.h): in the object files of every set above the baseline, each
function the linker may pick (global or weak, e.g. a std:: template instantiation) must either sit
in that set's namespace r3::kernels::<set> or contain no VEX/EVEX instruction. A leak would let
the linker keep an AVX copy of a function that baseline code also calls, and the build would die
with SIGILL on a CPU without AVX.

usage: check_kernel_isolation.py BUILD_DIR
"""
import pathlib
import re
import subprocess
import sys

SETS = ["avx2", "avx512", "avx512bf16"]
VECTOR = re.compile(r"\t(v[a-z0-9]+|k[a-z]+[bwdq])\s|%[yz]mm|%k[0-7]")


def functions(obj):
    """{name: [instruction lines]} of the functions in obj, demangled."""
    out = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(obj)], check=True,
                         capture_output=True, text=True).stdout
    funcs, current = {}, None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            current = m.group(1)
            funcs.setdefault(current, [])
        elif current and line.startswith(" "):
            funcs[current].append(line)
    return funcs


def linkable(obj):
    """Demangled names of the functions in obj other objects can bind to (global or weak)."""
    out = subprocess.run(["nm", "-C", "--defined-only", str(obj)], check=True, capture_output=True,
                         text=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in ("T", "W", "i", "u"):
            names.add(parts[2])
    return names


def main():
    build = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "build")
    problems, checked = [], 0
    for isa in SETS:
        objs = sorted((build / "CMakeFiles" / f"r3kernels_{isa}.dir").rglob("*.o"))
        if not objs:
            sys.exit(f"check_kernel_isolation: no object files for {isa} under {build}")
        for obj in objs:
            exported = linkable(obj)
            for name, lines in functions(obj).items():
                if name not in exported:
                    continue
                checked += 1
                if f"r3::kernels::{isa}::" in name:
                    continue
                vector = [l for l in lines if VECTOR.search(l)]
                if vector:
                    problems.append(f"{obj.name} ({isa}): {name}\n    {vector[0].strip()}")
    if problems:
        print("kernel code for a wider instruction set leaked into linkable symbols:")
        print("\n".join(problems))
        sys.exit(1)
    print(f"check_kernel_isolation: {checked} linkable functions in {len(SETS)} kernel sets, no leak")


if __name__ == "__main__":
    main()

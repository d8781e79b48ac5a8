"""Counts SASS opcodes per kernel of a cubin, on a machine without a GPU: the instructions a
change adds or removes, kernel by kernel (e.g. generic loads `LD` that re-read a parameter block
inside a loop, docs/PERF.md "The pre-activation stores' parameter loads").

    python3 benches/sass_opcodes.py target/ptx/mok_sm90a.cubin [OPCODE ...] [--kernel SUBSTRING]
    python3 benches/sass_opcodes.py old.cubin new.cubin LD ST   # the kernels whose counts differ

OPCODE is an opcode's first part (`LD` counts `LD.E`, `LD.E.64`, ...; default: LD ST LDG STG
LDS STS HGMMA and all instructions). nvdisasm comes from NVIDIA's PyPI wheel
(`pip download --no-deps nvidia-cuda-nvdisasm`, unzip it: nvidia/cu13/bin/nvdisasm), or
$NVDISASM names it.
"""
import os
import sys

from same_sass import kernels  # the script's own folder is on sys.path


def opcode(line):
    """The opcode of one instruction line of `same_sass.kernels` (`@!P0 LDG.E.128 R56, ...;`, its
    predicate dropped), or None for anything else (labels, directives)."""
    if not line.endswith(";"):
        return None
    words = line.rstrip(";").split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else None


def counts(cubin, nvdisasm):
    """Per kernel of `cubin`, how many instructions of each opcode (and `all`)."""
    tables = {}
    for name, lines in kernels(cubin, nvdisasm).items():
        table = tables.setdefault(name, {})
        for op in filter(None, map(opcode, lines)):
            table[op] = table.get(op, 0) + 1
            table["all"] = table.get("all", 0) + 1
    return tables


def main(argv):
    nvdisasm = os.environ.get("NVDISASM", "nvdisasm")
    kernel_filter, rest = None, []
    args = iter(argv)
    for a in args:
        if a == "--kernel":
            kernel_filter = next(args, None)
            if kernel_filter is None:
                sys.exit("--kernel needs a name (a substring)")
        elif a.startswith("--kernel="):
            kernel_filter = a.split("=", 1)[1]
        elif a.startswith("-"):
            sys.exit(f"unknown option {a}\n{__doc__}")
        else:
            rest.append(a)
    cubins = [a for a in rest if os.path.isfile(a)]
    ops = [a for a in rest if not os.path.isfile(a)] or ["LD", "ST", "LDG", "STG", "LDS", "STS", "HGMMA", "all"]
    if not 1 <= len(cubins) <= 2:
        sys.exit(__doc__)
    if any("." in op for op in ops):
        sys.exit("an opcode is its first part (LD counts LD.E, LD.E.64, ...): " + " ".join(ops))
    tables = [counts(c, nvdisasm) for c in cubins]
    print("kernel".ljust(40) + "".join(op.rjust(18) for op in ops))
    names = list(dict.fromkeys(name for t in tables for name in t))
    for name in names:
        if kernel_filter and kernel_filter not in name:
            continue
        rows = [[t.get(name, {}).get(op, 0) for op in ops] for t in tables]
        if len(rows) == 2 and rows[0] == rows[1]:
            continue
        cells = [f"{a} -> {b}" for a, b in zip(*rows)] if len(rows) == 2 else [str(v) for v in rows[0]]
        print(name.ljust(40) + "".join(c.rjust(18) for c in cells))


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""Compares the machine code of two cubins kernel by kernel (nvdisasm -c of each): prints `same`
or `DIFFERENT` per kernel and the kernels only one has. Labels are renumbered per kernel in
order of appearance, addresses and the numbering of internal helpers dropped, so a kernel added elsewhere in the module does not
make another differ.

usage: same_sass.py OLD.cubin NEW.cubin [NVDISASM]   (exit 1 when a kernel in both differs)
"""
import re
import subprocess
import sys

from same_kernels import report  # noqa: E402 (the script's own folder is on sys.path)


def kernels(cubin, nvdisasm):
    text = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    found, name, labels = {}, None, {}
    for line in text.splitlines():
        header = re.match(r"\s*\.section\s+\.text\.(\w+),", line)
        if header:
            name, labels = header.group(1), {}
            found[name] = []
            continue
        if name is None:
            continue
        if line.lstrip().startswith("//-"):
            continue  # the section banner names the next kernel in the file
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)
        line = re.sub(r"__internal_\d+_", "__internal_", line)
        line = re.sub(r"\.L_x_\d+", lambda m: "L%d" % labels.setdefault(m.group(0), len(labels)), line)
        # nvdisasm pads the comment column to the widest line of the file: collapse the spaces.
        found[name].append(" ".join(line.split()))
    return found


if __name__ == "__main__":
    nvdisasm = sys.argv[3] if len(sys.argv) > 3 else "nvdisasm"
    sys.exit(1 if report(kernels(sys.argv[1], nvdisasm), kernels(sys.argv[2], nvdisasm)) else 0)

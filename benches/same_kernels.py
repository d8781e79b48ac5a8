#!/usr/bin/env python3
"""Compares two PTX builds kernel by kernel: prints `same` or `DIFFERENT` per entry, and the
entries only one build has. Basic-block labels (`$L__BB<function>_<block>`) are numbered by the
function's position in the module, so they are renumbered per entry (and comments dropped) before
comparing, and so are the local-memory depots (`__local_depot<function>`): a kernel added before
another does not make that one differ.

usage: same_kernels.py OLD.ptx NEW.ptx   (exit 1 when an entry present in both differs)
"""
import re
import sys


def entries(path):
    text = open(path).read()
    parts = re.split(r"(?=^\.visible \.entry )", text, flags=re.M)
    found = {}
    for part in parts[1:]:
        name = re.match(r"\.visible \.entry (\w+)\(", part).group(1)
        part = re.sub(r"//.*", "", part)  # llc's comments (loop nests) name blocks by number too
        numbers = {}
        part = re.sub(r"BB(\d+)_", lambda m: "BB%d_" % numbers.setdefault(m.group(1), len(numbers)), part)
        # The local-memory depot is numbered by the function's position in the module too.
        part = re.sub(r"__local_depot\d+", "__local_depot", part)
        found[name] = part
    return found


def report(old, new):
    """Prints `same` / `DIFFERENT` / `new only` / `old only` per entry of two {name: text} maps;
    returns how many entries in both differ (benches/same_sass.py uses it too)."""
    differ = 0
    for name in sorted(set(old) | set(new)):
        if name not in old:
            print("new only ", name)
        elif name not in new:
            print("old only ", name)
        elif old[name] == new[name]:
            print("same     ", name)
        else:
            print("DIFFERENT", name)
            differ += 1
    return differ


if __name__ == "__main__":
    sys.exit(1 if report(entries(sys.argv[1]), entries(sys.argv[2])) else 0)

#!/usr/bin/env python3
"""The SASS of CUDA objects, one section per kernel, in a form two builds can be diffed in: the
proof that a change to src/cuda (a file split, a rename, a reformat) leaves every kernel's code
as it was.

    scripts/sass_dump.py OUT OBJ...      e.g. OBJ = build/CMakeFiles/deltastate.dir/src/cuda/*.cu.o

Per kernel: its resource usage (registers, stack, shared memory) and its SASS with encodings.
File identifiers and the per-file hash in anonymous-namespace names are dropped (they change with
the source path), and kernels are sorted by name (the order in the object follows the source).
Build both trees with the same options, dump each, and `diff` the two files.

cuobjdump comes from $CUOBJDUMP, else PATH, else the CUDA toolkit's bin/.
"""
import os
import re
import shutil
import subprocess
import sys


def cuobjdump():
    candidates = (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                  "/usr/local/cuda/bin/cuobjdump")
    for c in candidates:
        if c and os.path.exists(c):
            return c
    sys.exit("sass_dump: cuobjdump not found (set CUOBJDUMP)")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    tool, out, objs = cuobjdump(), sys.argv[1], sys.argv[2:]
    anon = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}")
    skip = ("identifier =", "=====", "arch =", "code version", "host =", "compile_size",
            "code for sm_", ".target")

    def run(flag, obj):
        return subprocess.run([tool, flag, obj], check=True, capture_output=True, text=True).stdout

    funcs = {}
    for o in objs:
        cur = None
        for line in run("-sass", o).splitlines():
            st = line.strip()
            if st.startswith("Fatbin "):  # a new section (the PTX, or another ELF)
                cur = None
                continue
            if st.startswith(skip):
                continue
            line = anon.sub("ANON", line)
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                cur = m.group(1)
                funcs[cur] = []
            elif cur is not None:
                funcs[cur].append(line.rstrip())
    res = {}
    for o in objs:
        lines = [anon.sub("ANON", l.strip()) for l in run("-res-usage", o).splitlines()]
        for i, l in enumerate(lines):
            if l.startswith("Function "):
                res[l[len("Function "):].rstrip(":")] = lines[i + 1]
            elif l.startswith(("GLOBAL:", "CONSTANT")):
                res.setdefault("object " + os.path.basename(o), l)
    with open(out, "w") as f:
        for k in sorted(k for k in res if k.startswith("object ")):
            f.write(f"{k}: {res[k]}\n")
        for name in sorted(funcs):
            body = funcs[name]
            while body and not body[-1].strip():
                body.pop()
            f.write(f"== {name}\nres: {res.get(name)}\n" + "\n".join(body) + "\n")
    print(f"{len(funcs)} kernels -> {out}")


if __name__ == "__main__":
    main()

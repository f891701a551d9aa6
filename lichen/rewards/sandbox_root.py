"""What the sandbox's minimal root shows of the host: the interpreter, its standard library, its shared libraries.

`interpreter_paths` asks the (trusted) interpreter itself, once, where its standard library lies and which
shared libraries it maps after importing the usual modules; the directories of those libraries are exposed
whole, so extension modules imported later (ctypes' libffi, ssl's libssl) find theirs too. The ELF program
interpreter (`/lib64/ld-linux-x86-64.so.2`) is read from the binary's header, since the dynamic loader is
looked up by that exact path. Everything is exposed read-only by `_sandbox_init.py`; nothing else of the host is.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess

from lichen.errors import ConfigError

_PROBE = r"""
import json, sys, sysconfig
import array, bisect, collections, datetime, decimal, fractions, functools, hashlib, heapq, itertools, math
import random, re, statistics, string
paths = sysconfig.get_paths()
libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if ".so" in line.split()[-1]})
print(json.dumps({"stdlib": [paths["stdlib"], paths["platstdlib"]], "libs": libs}))
"""

PT_INTERP = 3


def elf_interpreter(path: str) -> str | None:
    """The PT_INTERP path of an ELF executable (None for a static or non-ELF file)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return None
        is64, little = head[4] == 2, head[5] == 1
        end = "<" if little else ">"
        if is64:
            (phoff,) = struct.unpack(end + "Q", head[32:40])
            phentsize, phnum = struct.unpack(end + "HH", head[54:58])
        else:
            (phoff,) = struct.unpack(end + "I", head[28:32])
            phentsize, phnum = struct.unpack(end + "HH", head[42:46])
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            entry = f.read(phentsize)
            (ptype,) = struct.unpack(end + "I", entry[:4])
            if ptype != PT_INTERP:
                continue
            offset, size = (
                struct.unpack(end + "QQ", entry[8:16] + entry[32:40])
                if is64
                else struct.unpack(end + "II", entry[4:8] + entry[16:20])
            )
            f.seek(offset)
            return f.read(size).rstrip(b"\0").decode()
    return None


def interpreter_paths(python: str) -> list[str]:
    """Host paths the sandbox exposes read-only for `python` to run: parents before children, no duplicates."""
    try:
        out = subprocess.run(
            [python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True, cwd="/"
        ).stdout
        found = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise ConfigError(f"--code-sandbox-python {python}: cannot ask it for its library paths ({e})") from None
    paths = {python, *found["stdlib"], *(os.path.dirname(lib) for lib in found["libs"])}
    loader = elf_interpreter(os.path.realpath(python))
    if loader:
        paths.add(loader)
    for path in list(paths):
        if path.startswith("/tmp/") or path == "/tmp":
            raise ConfigError(
                f"--code-sandbox-python {python}: {path} lies under /tmp, where the sandbox "
                "builds its own root; use an interpreter installed elsewhere"
            )
    # a directory that another exposed one contains is exposed with it
    ordered = sorted(paths, key=lambda p: (p.count("/"), p))
    return [p for i, p in enumerate(ordered) if not any(p.startswith(q.rstrip("/") + "/") for q in ordered[:i])]

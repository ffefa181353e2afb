"""python_executable: the interpreter that child processes (the engine process, tensor-parallel
ranks) are started with, which inside tritonserver's Python stub is not sys.executable."""

from __future__ import annotations

import os
import sys


def python_executable() -> str:
    """The interpreter for the child: the stub's sys.executable may be the stub binary itself."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python"):
        return exe
    for name in ("python3", "python"):
        path = os.path.join(sys.exec_prefix, "bin", name)
        if os.path.exists(path):
            return path
    raise RuntimeError(f"no Python interpreter for the engine process (sys.executable {exe!r}, "
                       f"sys.exec_prefix {sys.exec_prefix!r}); set engine_process to false")

"""Proves the GEMV and float8 kernels compile for sm_90 (Hopper) on a machine without a GPU.

Triton's interpreter (the rest of tests/kernels) never runs its GPU front end or ptxas, which
refuse what the interpreter takes (a helper returning a block in one branch and a scalar in the
other); tests/hopper_compile.py compiles every launch variant in a process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_variant_compiles_for_sm90():
    root = os.path.dirname(TESTS)
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([os.path.join(root, "backend"), TESTS]))
    done = subprocess.run([sys.executable, os.path.join(TESTS, "hopper_compile.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "variants compile for sm_90" in done.stdout

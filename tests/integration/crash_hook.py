"""A test-only engine hook: the engine loop raises after N steps, as a bug escaping it would.

Injected through the adapter's `on_engine_step` by a model.py that the crash test writes."""

from __future__ import annotations

import os

MESSAGE = "crash hook: the engine loop dies here"


class CrashAfterSteps:
    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, num_steps: int) -> None:
        if num_steps >= self.steps:
            raise RuntimeError(f"{MESSAGE} (after {self.steps} steps)")


def crashing_model_py(steps: int) -> str:
    """A model.py for `llm` whose engine dies after `steps` steps (this folder on its sys.path,
    so that the engine process can unpickle the hook too)."""
    return (
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "from crash_hook import CrashAfterSteps\n"
        "from hsserve.triton.adapter import TritonPythonModel as _Adapter\n\n\n"
        "class TritonPythonModel(_Adapter):\n"
        f"    on_engine_step = CrashAfterSteps({steps})\n"
    )

"""The `llm` model: thin; the engine and the adapter live in the hsserve package."""

from hsserve.triton.adapter import TritonPythonModel  # noqa: F401

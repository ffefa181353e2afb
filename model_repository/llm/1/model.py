"""The `llm` model: thin; the engine and the adapter live in the hsserve package."""

from hsserve.triton_model import TritonPythonModel  # noqa: F401

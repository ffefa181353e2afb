"""The `llm_sync` model: a unary (non-decoupled) BLS front over `llm`; holds no weights."""

from hsserve.triton_sync import TritonPythonModel  # noqa: F401

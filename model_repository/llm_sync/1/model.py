"""The `llm_sync` model: a unary (non-decoupled) BLS front over `llm`; holds no weights."""

from hsserve.triton.sync_model import TritonPythonModel  # noqa: F401

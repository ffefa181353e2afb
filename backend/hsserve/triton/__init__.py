"""The Triton side: the decoupled `llm` adapter, tensor parsing, responses, metrics, the `llm_sync`
and classifier models, and the tritonserver launcher."""

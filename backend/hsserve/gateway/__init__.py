"""`hsserve openai`: an OpenAI-compatible HTTP API (completions, chat completions, models) in
front of the `llm` model of a running tritonserver, over its gRPC streaming API.

params (an OpenAI body -> a Generation), prompts (tokenizer, chat template, token strings),
backend (Triton's gRPC stream -> Pieces), render (Pieces -> OpenAI objects), app (the FastAPI
routes, SSE), main (the command line)."""

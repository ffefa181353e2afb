"""Weight loading and our own decoder forward for the Llama, Mistral, Qwen2 and Qwen3 families."""

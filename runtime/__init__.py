"""kubellm runtime: paged-attention LLM engine and its OpenAI-compatible server."""

"""The OpenAI-compatible HTTP server every runtime pod runs: API, health, drain, metrics."""

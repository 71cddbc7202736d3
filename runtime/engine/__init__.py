"""The engine: requests in, tokens out (scheduler, KV blocks, model runner, CUDA graphs, settings)."""

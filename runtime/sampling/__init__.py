"""Sampling: per-request parameters, the sampler, structured outputs."""

"""Speculative decoding: drafts proposed cheaply, verified by the served model in one pass."""

"""Tensor parallelism: one process per rank and the collectives the sharded layers call."""

"""The error a checkpoint that does not fit raises, from the layers' weight loaders up to the readers.

It lives here, below the models, because the layers' loaders (parallel_linear.py, vocab_parallel.py) raise it
and layers never import models; runtime/models/checkpoint.py re-exports it for the readers and their callers.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint is malformed, incomplete or of an unsupported architecture; the message says which."""

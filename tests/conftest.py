"""Session fixtures: tiny Hugging Face checkpoints (random weights, trained BPE) built once per test run."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import tokenizers
import torch

import tiny_checkpoints  # tests/ is on sys.path: pyproject.toml's pytest `pythonpath`

# Safe-path mode for every Python process a test starts, as `make test` exports it: the working directory
# (the repository root, with its operator/ folder) never goes on a child's sys.path.
os.environ.setdefault("PYTHONSAFEPATH", "1")

# Triton kernels run on CPU tensors through Triton's interpreter; @triton.jit reads this when a kernel module
# is imported, so it must be set before any test imports one. With a GPU the kernels run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory) -> Callable[..., Path]:
    """``factory(arch="llama", **build_checkpoint_kwargs) -> Path``; the same arguments give the same folder."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[tuple, Path] = {}

    def factory(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in built:
            built[key] = tiny_checkpoints.build_checkpoint(root / f"{arch}-{len(built)}", arch, **kwargs)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama3(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("llama3")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("mistral")


@pytest.fixture(scope="session")
def tiny_llama_sharded(tiny_checkpoint_factory) -> Path:
    """Same weights as ``tiny_llama``, in 3 safetensors shards with model.safetensors.index.json."""
    return tiny_checkpoint_factory("llama", num_shards=3)


@pytest.fixture(scope="session")
def tiny_llama_bf16(tiny_checkpoint_factory) -> Path:
    """``tiny_llama``'s weights rounded to bfloat16 (config torch_dtype "bfloat16")."""
    return tiny_checkpoint_factory("llama", dtype=torch.bfloat16)


@pytest.fixture(params=["llama", "llama3", "qwen2", "mistral"])
def tiny_checkpoint(request, tiny_checkpoint_factory) -> Path:
    """Each single-file architecture in turn (parametrized)."""
    return tiny_checkpoint_factory(request.param)


@pytest.fixture(scope="session")
def tokenizer_corpus() -> list[str]:
    """The sentences the tiny tokenizer was trained on."""
    return tiny_checkpoints.make_corpus(seed=0)


@pytest.fixture
def tiny_tokenizer() -> tokenizers.Tokenizer:
    """A fresh copy of the tokenizer every tiny checkpoint ships (tokenizer.json), safe to mutate."""
    return tiny_checkpoints.train_tokenizer()

"""Checkpoint path → a ready model: read the format, build the architecture, load weights."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.layers.rotary import RotaryEmbedding
from kubellm.runtime.models.checkpoint import Checkpoint, CheckpointError
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.models.llama import LlamaForCausalLM
from kubellm.runtime.models.registry import model_class
from kubellm.runtime.quantization import loading as quantized_loading

log = logging.getLogger("kubellm.loader")


def read_checkpoint(path: str | Path) -> Checkpoint:
    """A Hugging Face folder or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        from kubellm.runtime.models.hf import read_hf_folder

        return read_hf_folder(path)
    if path.suffix == ".gguf" and path.is_file():
        from kubellm.runtime.models.gguf import read_gguf

        return read_gguf(path)
    raise CheckpointError(f"{path} is neither a model folder nor a .gguf file")


def keeps_gguf_packed(quantization: str) -> bool:
    """Whether a GGUF file's blocks stay packed under ``--quantization`` (int8/int4 requantize dequantized
    weights); every rank must decide alike."""
    return quantization in ("none", "gguf")


def build_model(ckpt: Checkpoint, dtype: torch.dtype, device: str, max_model_len: int,
                progress: bool = True, tp: Group | None = None,
                kernels: KernelChoice | None = None, keep_packed: bool = True) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model with its weights (this rank's shards with tensor parallelism) on ``device``; the linears of a
    pre-quantized checkpoint stay quantized, computed by the GEMMs ``kernels`` chose, and so do a GGUF file's
    blocks with ``keep_packed`` (sharded as the layers they replace; else they are dequantized)."""
    cfg = ModelConfig.from_hf(ckpt.config, ckpt.source)
    start = time.perf_counter()
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, dtype, max_positions=max_model_len, tp=tp)
        gguf = keep_packed and ckpt.packed_tensors is not None
        quantized = quantized_loading.prepare(model, ckpt.config, kernels, ckpt.source, gguf=gguf,
                                              packed_embedding=gguf and ckpt.packed_embedding)
    # Materialise directly in the target dtype/device; weights are copied in by load_weights.
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty() materialises shared parameters separately
    if quantized is not None:
        quantized.attach(model, device, dtype)
    for module in model.modules():  # every rotary table (Gemma 3 has one per layer type)
        if isinstance(module, RotaryEmbedding):
            module.build_tables(device)
    total = 9 * cfg.num_layers + 3
    with tqdm(total=total, desc=f"loading {Path(ckpt.source).name}", unit="tensor", disable=not progress,
              leave=False) as bar:
        def stream():
            for name, t in (ckpt.packed_tensors() if gguf else ckpt.tensors()):
                bar.update(1)
                if quantized is None or not quantized.take(name, t):  # quantized tensors keep their dtype
                    yield name, t.to(device=device, dtype=dtype)
                elif quantized.dequantized:  # a router the checkpoint stores quantized, now whole and float
                    for router, w in quantized.pop_dequantized():
                        yield router, w.to(device=device, dtype=dtype)

        model.load_weights(stream(), ckpt.source)
        if quantized is not None:
            quantized.finish()
    model.eval()
    log.info("loaded %s (%s, %d layers) in %.1fs", ckpt.source, cfg.architecture, cfg.num_layers,
             time.perf_counter() - start)
    return model, cfg

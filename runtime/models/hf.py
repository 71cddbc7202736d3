"""Read a Hugging Face model folder: config.json, safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import tokenizers
import torch
from safetensors import safe_open

from kubellm.runtime.models.checkpoint import Checkpoint, CheckpointError


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.exists():
        if required:
            raise CheckpointError(f"{path.name} not found in {path.parent}; is this a Hugging Face model folder?")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files, from the shard index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index.name} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {folder} (.bin/.pt checkpoints are not supported)")
    return files


def read_hf_folder(folder: str | Path) -> Checkpoint:
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    files = safetensors_files(folder)
    tok_file = folder / "tokenizer.json"
    if not tok_file.exists():
        raise CheckpointError(f"tokenizer.json not found in {folder}; kubellm needs a fast-tokenizer file")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise CheckpointError(f"cannot read {tok_file}: {e}") from e
    tokenizer_config = _read_json(folder / "tokenizer_config.json", required=False)
    if "chat_template" not in tokenizer_config and (folder / "chat_template.jinja").exists():
        tokenizer_config["chat_template"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    generation_config = _read_json(folder / "generation_config.json", required=False)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            try:  # safetensors raises its own SafetensorError (not an OSError) on bad headers
                st = safe_open(str(f), framework="pt")
                names = list(st.keys())
            except Exception as e:
                raise CheckpointError(f"cannot read weights from {f}: {e}") from e
            for name in names:
                yield name, st.get_tensor(name)

    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, tokenizer_config=tokenizer_config,
                      generation_config=generation_config, source=str(folder))

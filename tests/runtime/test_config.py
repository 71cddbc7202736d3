"""Memory sizing inputs: the container's cgroup limit bounds the KV-cache budget on CPUs."""

from __future__ import annotations

import dataclasses

import pytest

from kubellm.runtime.engine.config import (
    EngineConfig,
    available_memory_bytes,
    cgroup_memory_headroom,
    parse_size,
    with_settings,
)
from kubellm.runtime.engine.settings import ENGINE_SETTINGS, SETTINGS_BY_NAME, EngineSetting


def write(root, name, text):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_headroom_is_limit_minus_usage(tmp_path):
    write(tmp_path, "memory.max", f"{2 * 2**30}\n")
    write(tmp_path, "memory.current", f"{700 * 2**20}\n")
    assert cgroup_memory_headroom(str(tmp_path)) == 2 * 2**30 - 700 * 2**20


def test_cgroup_v2_unlimited(tmp_path):
    write(tmp_path, "memory.max", "max\n")
    write(tmp_path, "memory.current", "123\n")
    assert cgroup_memory_headroom(str(tmp_path)) is None


def test_cgroup_v1(tmp_path):
    write(tmp_path, "memory/memory.limit_in_bytes", str(4 * 2**30))
    write(tmp_path, "memory/memory.usage_in_bytes", str(2**30))
    assert cgroup_memory_headroom(str(tmp_path)) == 3 * 2**30
    write(tmp_path, "memory/memory.limit_in_bytes", "9223372036854771712")  # v1's "no limit"
    assert cgroup_memory_headroom(str(tmp_path)) is None


def test_over_the_limit_gives_zero_not_negative(tmp_path):
    write(tmp_path, "memory.max", "100")
    write(tmp_path, "memory.current", "150")
    assert cgroup_memory_headroom(str(tmp_path)) == 0


def test_no_cgroup_files(tmp_path):
    assert cgroup_memory_headroom(str(tmp_path)) is None


def test_cpu_budget_is_bounded_by_the_pod_limit(tmp_path):
    """A 2 GiB pod on a big node: the budget comes from the cgroup, not from the node's MemAvailable."""
    write(tmp_path, "memory.max", str(2 * 2**30))
    write(tmp_path, "memory.current", str(2**30))
    assert available_memory_bytes("cpu", str(tmp_path)) == 2**30
    assert available_memory_bytes("cpu", str(tmp_path / "none")) > 0  # falls back to the host


@pytest.mark.parametrize("text,expected", [("1GiB", 2**30), ("512MiB", 512 * 2**20), ("1.5G", 3 * 2**29)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_attention_backend_defaults_from_the_environment(monkeypatch, capsys):
    """An LLMDeployment sets it through spec.env (KUBELLM_ATTENTION_BACKEND); a flag still wins, and a bad
    value is a usage error naming the variable, not a traceback at model load."""
    from kubellm.runtime.cli import build_parser, main

    monkeypatch.delenv("KUBELLM_ATTENTION_BACKEND", raising=False)
    assert build_parser().parse_args(["serve"]).attention_backend == "auto"
    monkeypatch.setenv("KUBELLM_ATTENTION_BACKEND", "torch")
    assert build_parser().parse_args(["serve"]).attention_backend == "torch"
    assert build_parser().parse_args(["serve", "--attention-backend", "cpu"]).attention_backend == "cpu"
    monkeypatch.setenv("KUBELLM_ATTENTION_BACKEND", "cuda-graphs")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "/nonexistent"])
    assert exit_info.value.code == 2
    assert "KUBELLM_ATTENTION_BACKEND='cuda-graphs': use one of auto, torch, cpu, triton" in capsys.readouterr().err


def test_every_settings_row_is_an_engine_config_field_of_its_type_and_default():
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for s in ENGINE_SETTINGS:
        assert s.name in fields, f"settings row {s.name} is no EngineConfig field"
        assert fields[s.name].default == s.default, s.name
        assert fields[s.name].type == (s.type | None if s.default is None else s.type), s.name
    engine_only = [name for name in fields if name not in SETTINGS_BY_NAME]
    assert engine_only == ["model", "num_kv_blocks", "enable_chunked_prefill"]  # declared by hand, first


def test_a_new_settings_row_is_all_it_takes_to_get_a_config_field():
    row = EngineSetting("new_knob", int, 7, flag="--new-knob", help="a setting this test adds")

    @with_settings(ENGINE_SETTINGS + (row,))
    class Config:
        model: str

    assert [f.name for f in dataclasses.fields(Config)] == ["model", *(s.name for s in ENGINE_SETTINGS), "new_knob"]
    assert Config(model="m").new_knob == 7
    assert Config(model="m", new_knob=3).new_knob == 3
    # Added to EngineConfig itself, the row is a field and the checks of __post_init__ still run.
    extended = with_settings((row,))(type("Extended", (EngineConfig,), {}))
    assert extended(model="m", device="cpu", new_knob=5).new_knob == 5
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        extended(model="m", device="cpu", max_num_seqs=0)


def test_a_field_declared_by_hand_and_in_the_table_is_refused():
    with pytest.raises(TypeError, match="Twice.seed is declared both in the class and in the settings table"):

        @with_settings(ENGINE_SETTINGS)
        class Twice:
            seed: int = 1

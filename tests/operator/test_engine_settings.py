"""The engine settings' table (runtime/engine/settings.py) and the four places that derive from it agree: the
``kubellm`` CLI, EngineConfig, the LLMDeployment CRD and the operator's rendered ``kubellm serve`` arguments."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
from pydantic.alias_generators import to_camel

from kubellm.operator.crd import schema as crd
from kubellm.operator.render import cli as render_cli
from kubellm.operator.render import pods as pods_mod
from kubellm.runtime.cli import build_parser, engine_kwargs
from kubellm.runtime.engine import settings as engine_settings
from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.engine.settings import ENGINE_SETTINGS, EngineSetting

CRD_SETTINGS = [s for s in ENGINE_SETTINGS if s.crd_field]


def _serve_engine_actions() -> dict[str, Any]:
    (sub,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    (group,) = [g for g in sub.choices["serve"]._action_groups if g.title == "engine"]
    return {a.option_strings[0]: a for a in group._group_actions}


def _crd_node(setting: EngineSetting) -> dict[str, Any]:
    node = crd.crd_schema()["properties"]["spec"]
    for part in setting.crd_field.split("."):
        node = node["properties"][to_camel(part)]
    return node


def test_the_table_imports_without_torch():
    code = (
        "import sys, kubellm.runtime.engine.settings, kubellm.operator.api, kubellm.operator.render; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_names_flags_and_crd_fields_are_unique():
    for attribute in ("name", "flag", "crd_field"):
        values = [getattr(s, attribute) for s in ENGINE_SETTINGS if getattr(s, attribute)]
        assert len(values) == len(set(values)), attribute


def test_the_cli_has_one_flag_per_setting(monkeypatch):
    for s in ENGINE_SETTINGS:
        if s.env:
            monkeypatch.delenv(s.env, raising=False)
    actions = _serve_engine_actions()
    assert set(actions) == {"--model"} | {s.flag for s in ENGINE_SETTINGS if s.flag}
    for s in ENGINE_SETTINGS:
        if s.flag is None:
            continue
        action = actions[s.flag]
        assert (action.dest, action.default, action.choices) == (s.name, s.default, s.choices), s.name
    args = build_parser().parse_args(["serve"])
    assert engine_kwargs(args) == {s.name: s.default for s in ENGINE_SETTINGS if s.flag}


def test_engine_config_takes_every_setting_with_the_same_default():
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for s in ENGINE_SETTINGS:
        assert s.name in fields, s.name
        assert fields[s.name].default == s.default, s.name


@pytest.mark.parametrize("setting", CRD_SETTINGS, ids=lambda s: s.name)
def test_the_crd_field_has_the_settings_default_choices_and_bounds(setting):
    node = _crd_node(setting)
    assert node.get("default") == setting.default
    assert node.get("enum") == (list(setting.api_choices) if setting.api_choices else None)
    assert node["description"] == setting.doc
    assert node["type"] == {int: "integer", float: "number", bool: "boolean", str: "string"}[setting.type]
    if setting.ge is not None:
        assert node["minimum"] == setting.ge and "exclusiveMinimum" not in node
    if setting.gt is not None:
        assert node["minimum"] == setting.gt and node["exclusiveMinimum"] is True
    if setting.le is not None:
        assert node["maximum"] == setting.le


def _other_value(s: EngineSetting) -> Any:
    """A valid value of ``s`` that is not its default."""
    if s.api_choices:
        return next(c for c in s.api_choices if c != s.default and c != "auto")
    if s.type is bool:
        return not s.default
    if s.type is float:
        return s.default / 2
    return 2 if s.default is None else s.default * 2


def test_render_passes_every_api_setting_to_the_runtime_as_it_parses():
    spec: dict[str, Any] = {"model": {"uri": "hf://org/name"}, "resources": {"gpu": {"product": "NVIDIA-L4"}}}
    values = {s.name: _other_value(s) for s in CRD_SETTINGS}
    # eagle needs engine.speculative.model, which rules out ngram and tensor parallelism: it stays at its
    # default here (test_render's eagle test renders it).
    values["speculative_method"] = engine_settings.default("speculative_method")
    for s in CRD_SETTINGS:
        *parents, leaf = [to_camel(p) for p in s.crd_field.split(".")]
        node = spec
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = values[s.name]
    ld = render_cli.load({"apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
                      "metadata": {"name": "x", "namespace": "ml"}, "spec": spec})  # fmt: skip
    args = build_parser().parse_args(["serve", *pods_mod.runtime_args(ld.spec)])
    assert {s.name: getattr(args, s.name) for s in CRD_SETTINGS} == values


def test_defaults_render_only_the_pinned_flags():
    ld = render_cli.load({"apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
                      "metadata": {"name": "x", "namespace": "ml"}, "spec": {"model": {"uri": "smollm2"}}})  # fmt: skip
    args = pods_mod.runtime_args(ld.spec)
    for s in CRD_SETTINGS:
        assert (s.flag in args) == (s.render == "always"), s.name


def test_attention_backends_and_quantizations_come_from_the_table():
    from kubellm.operator import api
    from kubellm.runtime import cli

    assert engine_settings.setting("attention_backend").choices == cli.ATTENTION_BACKENDS
    assert engine_settings.setting("quantization").choices == api.QUANTIZATIONS
    with pytest.raises(ValueError, match="use auto, torch, cpu, triton"):
        EngineConfig(model="x", device="cpu", attention_backend="flash")

"""The ``kubellm`` command line (runtime/cli.py): the runtime reaches the operator only inside the commands that
run it."""

from __future__ import annotations

import subprocess
import sys

from kubellm.runtime.cli import activator_settings, build_parser


def test_no_runtime_module_nor_the_serve_parser_imports_the_operator():
    code = (
        "import importlib, pkgutil, sys, kubellm.runtime as r\n"
        "for m in pkgutil.walk_packages(r.__path__, 'kubellm.runtime.'): importlib.import_module(m.name)\n"
        "from kubellm.runtime.cli import build_parser\n"
        "build_parser().parse_args(['serve'])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('kubellm.operator'))\n"
        "assert not loaded, f'the runtime imported {loaded}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _activator_help() -> dict[str, str]:
    (sub,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    return {a.option_strings[0]: a.help for a in sub.choices["activator"]._actions if a.option_strings}


def test_activator_flags_left_out_take_the_activators_defaults_which_the_help_states():
    from kubellm.operator.activator import DEFAULT_UPSTREAM, Limits

    limits, upstream = activator_settings(build_parser().parse_args(["activator", "-A"]))
    assert (limits, upstream) == (Limits(), DEFAULT_UPSTREAM)
    helps = _activator_help()
    assert f"(default {DEFAULT_UPSTREAM})" in helps["--upstream"]
    assert f"(default {Limits.hold_timeout:g})" in helps["--hold-timeout"]
    assert f"(default {Limits.max_held})" in helps["--max-held"]
    assert f"(default {Limits.max_held_total})" in helps["--max-held-total"]
    assert f"(default {Limits.max_buffered // 2**20})" in helps["--max-buffered-mib"]


def test_activator_flags_given_override_the_defaults():
    args = build_parser().parse_args(["activator", "-A", "--hold-timeout", "5", "--max-held", "3",
                                      "--max-held-total", "7", "--max-buffered-mib", "2", "--upstream", "http://x"])
    limits, upstream = activator_settings(args)
    assert (limits.hold_timeout, limits.max_held, limits.max_held_total, limits.max_buffered) == (5.0, 3, 7, 2 * 2**20)
    assert upstream == "http://x"

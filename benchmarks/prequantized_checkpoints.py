"""A dense Hugging Face folder rewritten in the pre-quantized formats kubellm serves, for the benchmarks.

The writers are the tests' own (tests/runtime/test_prequantized_loading.py: AWQ and GPTQ v1 by small writers,
compressed-tensors by its own compressor, FP8 by hand), so a benchmark runs exactly the layouts CI checks.
They round to nearest (no calibration): what AutoAWQ or GPTQModel would write from the same weights is at
least this good. Groups are 64 inputs, because SmolLM2's 576-wide inputs are not a multiple of 128.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent / "tests"
GROUP = 64

# name -> what config.json says (the writer is picked in _writers); vLLM's CPU build serves the first three
# (its CPUWNA16 kernel: 4-bit, uint4 with zero points or uint4b8), not FP8 without AMX.
FORMATS = ("awq", "gptq", "w4a16", "fp8")


def _writers() -> dict:
    sys.path[:0] = [str(_TESTS), str(_TESTS / "runtime")]  # the test modules import their neighbours by name
    import test_prequantized_loading as t

    int4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
    return t, {
        "awq": (t._awq, GROUP, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                "version": "gemm"}),
        "gptq": (t._gptq(4, True, False), GROUP, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                                   "sym": True, "desc_act": False}),
        "w4a16": (t._compressed(4, "group"), GROUP, t._ct_config("pack-quantized", int4)),
        "fp8": t.FORMATS["fp8-channel"],  # compressed-tensors FP8 W8A8: per-channel weights, dynamic per token
    }


def quantized_folder(dense_dir: Path, fmt: str, out_root: Path) -> Path:
    """``<out_root>/<dense folder name>-<fmt>``, written once from ``dense_dir`` (a folder with one
    model.safetensors) and reused; written beside the target and renamed, so a half-written one never counts."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    out = out_root / f"{dense_dir.name}-{fmt}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    print(f"writing {dense_dir} as {fmt} into {out} ...", file=sys.stderr, flush=True)
    t, writers = _writers()
    key = f"benchmark-{fmt}"
    t.FORMATS[key] = writers[fmt]
    out_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out_root) as tmp:
        quant_dir, _twin = t.write_quantized(dense_dir, Path(tmp), key)
        os.chmod(quant_dir / "model.safetensors", 0o644)
        os.replace(quant_dir, out)
    return out

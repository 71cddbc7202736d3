"""Section 6 of the GPU kit (benchmarks/gpu_check_8b.py: the Llama-3-8B shape, its roofline and the
transformers peer) on CPU at a tiny shape. Pinned: the part runs and reports through the kit; the engine and the
peer get the same in-memory weights and decode the same greedy tokens (so the peer's static cache and compiled
step are a correct decoder, and the engine really took the generated weights, not the folder's stand-in file);
the roofline's byte count is Llama-3-8B's. What only a GPU shows (the rates, CUDA graphs, Inductor) is not tested.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import gpu_check_8b as g8  # noqa: E402

ONLY_8B = ["--device", "cpu", "--tiny", "--skip", "kernels,timing,engine,throughput,serve,graphs,tp,profile"]


def test_the_part_runs_through_the_kit_and_reports_both_systems(tmp_path):
    assert gpu_check.main(ONLY_8B + ["--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("gpu-check-*.md")
    section = path.read_text().split("## 6. Llama-3-8B shape")[1].split("\n## ")[0]
    assert "### kubellm decode with CUDA graphs: Llama-shaped (tiny)" in section
    assert "### Peer: transformers " in section and "StaticCache, torch.compile(" in section
    assert "| kubellm / peer |" in section
    assert "### Decode step phases: Llama-shaped (tiny)" in section  # the profile ran on this model
    assert "device-to-device copy:" in section and "crashed" not in section
    for batch in ("1", "4"):
        assert f"\n| {batch} | 4 | " in section  # kubellm: every batch timed over 4 steps


def test_skipping_both_parts_leaves_a_skip_line(tmp_path):
    assert gpu_check.main(ONLY_8B[:-1] + [ONLY_8B[-1] + ",llama8b,peer", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("gpu-check-*.md")
    assert "- skipped: --skip llama8b,peer" in path.read_text()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return g8.model_folder(tmp_path_factory.mktemp("m") / "llama", g8.TINY)


def test_engine_and_peer_decode_the_same_tokens_from_the_same_weights(folder):
    """float32 on CPU: kubellm's greedy tokens equal transformers' through the static cache and the compiled step
    (Dynamo full graph, eager backend). The vocabulary (1000) is larger than the tokenizer's (512), as on the
    device: sampled ids past the tokenizer must not break the engine."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    prompts, new = g8._prompts(2, 8, g8.TINY["vocab_size"], 3), 6
    with g8.in_memory_weights(folder, "cpu", torch.float32), LLM(
            str(folder), progress=False, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory="16MiB",
            seed=0, **g8._plain_cpu("cpu")) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0),
                            use_tqdm=False)
    ours = [o.token_ids for o in outs]
    config = g8.json.loads((folder / "config.json").read_text())
    model = g8.peer_model(config, "cpu", torch.float32)
    steps = list(g8.peer_decode(model, "cpu", prompts, new, dict(backend="eager", fullgraph=True)))
    peer = torch.cat(steps, dim=1).tolist()
    assert ours == peer
    assert any(t >= 512 for row in ours for t in row)  # ids past the tokenizer were sampled and went through


def test_the_weights_are_deterministic_and_named_as_transformers_names_them(folder):
    config = g8.json.loads((folder / "config.json").read_text())
    a, b = dict(g8.random_weights(config, "cpu", torch.float32)), dict(g8.random_weights(config, "cpu", torch.float32))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert "lm_head.weight" in a and "model.layers.1.mlp.down_proj.weight" in a
    assert 0.8 < a["model.norm.weight"].mean() < 1.2 and abs(a["lm_head.weight"].std() - 0.02) < 0.002


def test_the_roofline_bytes_are_llama_3_8b_s():
    """8,030,261,248 parameters (Meta-Llama-3-8B), of which the 128256 x 4096 embedding table is not read whole."""
    b = g8.Bytes.of(g8.LLAMA3_8B, torch.bfloat16)
    assert b.weights == 2 * (8_030_261_248 - 128256 * 4096)
    assert b.kv_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16
    assert sum(torch.Size(s).numel() for _, s in g8.param_shapes({**g8.LLAMA3_8B, "model_type": "llama"})) \
        == 8_030_261_248


def test_kv_entries_read_by_a_run_of_steps():
    assert g8._kv_tokens([10], 3) == 10 + 11 + 12
    assert g8._kv_tokens([5, 7], 2) == (5 + 6) + (7 + 8)


def test_a_step_that_raises_fails_its_check_and_the_next_steps_still_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Inductor gave up")

    monkeypatch.setattr(g8, "peer_rates", broken)
    assert gpu_check.main(ONLY_8B + ["--out", str(tmp_path)]) == 1
    (path,) = tmp_path.glob("gpu-check-*.md")
    section = path.read_text().split("## 6. Llama-3-8B shape")[1]
    assert "| peer (crashed) | - | - | - | **FAIL**: RuntimeError: Inductor gave up |" in section
    assert "### kubellm decode with CUDA graphs" in section and "### Decode step phases" in section

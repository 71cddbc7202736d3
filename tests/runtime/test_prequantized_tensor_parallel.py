"""Tensor parallelism over checkpoints quantized elsewhere: each quantized layer shards by the parallel layer
type it replaces (runtime/layers/parallel_linear.py's ``quantized_loader``), so the ranks' layers together
compute the unsharded layer, two ranks generate what transformers generates on the dequantized twin (and so
what one rank generates: test_prequantized_loading.py), and a split that would cut a group is refused by name.
Mixture-of-experts experts shard the same way over their intermediate dimension (gate/up column-parallel, down
row-parallel): tiny Qwen3-MoE and Mixtral in each format.

The checkpoints are test_prequantized_loading.py's, in each format's published layout, at a shape where every
row-parallel split keeps groups of 128 whole (8 heads of 32: o_proj has 256 inputs, 128 per rank; experts and
dense MLPs 256 wide, 128 per rank)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_engine_parity import (
    LOGIT_ATOL,
    MAX_NEW,
    LogitRecorder,
    _engine,
    _prompts,
    _run_and_compare,
    mean_logit_errors,
)
from test_prequantized_loading import write_quantized

from kubellm.kernels import cpu_moe
from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.moe import FusedMoE, route
from kubellm.runtime.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.loader import build_model, read_checkpoint
from kubellm.runtime.quantization import gguf as gguf_blocks
from kubellm.runtime.sampling.params import SamplingParams

TP_SHAPE = dict(hidden_size=128, intermediate_size=512, head_dim=32, num_attention_heads=8)
ROW_PARALLEL = ("o_proj", "down_proj")
MOE_TP_SHAPE = dict(TP_SHAPE, intermediate_size=256, moe_intermediate_size=256)  # Mixtral's experts: intermediate_size
ALL_FORMATS = ["awq-4bit-g128", "gptq-4bit-asym-g128", "gptq-4bit-sym-desc_act-g32", "gptq-8bit-sym-g128",
               "w4a16-group128", "w8a16-channel", "fp8-channel", "fp8-block128"]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def dense(request, tiny_checkpoint_factory):
    return tiny_checkpoint_factory(request.param, **TP_SHAPE)


def _quantized_layers(model) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@torch.inference_mode()
def test_the_ranks_quantized_shards_compute_the_unsharded_layer(fmt, dense, tmp_path):
    """Column-parallel layers (q/k/v, gate/up): the ranks' outputs, part by part, are the whole layer's;
    row-parallel (o, down): the ranks' partial sums over their inputs add up to it. Every format's packing,
    act-order map and scale layout goes through the same split of the read weights."""
    quant_dir, _ = write_quantized(dense, tmp_path, fmt)
    ckpt = read_checkpoint(quant_dir)
    full = _quantized_layers(build_model(ckpt, torch.float32, "cpu", 256, False)[0])
    ranks = [_quantized_layers(build_model(ckpt, torch.float32, "cpu", 256, False, tp=Group(rank=r, size=2))[0])
             for r in (0, 1)]
    assert full and all(set(r) == set(full) for r in ranks)
    x = torch.randn(5, max(m.in_features for m in full.values()), generator=torch.Generator().manual_seed(0))
    for name, layer in full.items():
        shards = [r[name] for r in ranks]
        want = layer(x[:, : layer.in_features])
        if name.endswith(ROW_PARALLEL):
            n = layer.in_features // 2
            assert all(s.in_features == n and s.out_features == layer.out_features for s in shards)
            got = sum(s(x[:, r * n : (r + 1) * n]) for r, s in enumerate(shards))
        else:
            parts = ([256, 64, 64] if name.endswith("qkv_proj") else [512, 512])  # q, k, v / gate, up outputs
            outs = [s(x[:, : layer.in_features]).split([p // 2 for p in parts], dim=-1) for s in shards]
            got = torch.cat([torch.cat([o[j] for o in outs], dim=-1) for j in range(len(parts))], dim=-1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"{fmt}: {name}")


@pytest.mark.parametrize("fmt", ["awq-4bit-g128", "gptq-4bit-sym-desc_act-g32", "w4a16-group128", "fp8-block128"])
def test_tp2_on_a_quantized_checkpoint_generates_what_transformers_generates_on_its_twin(fmt, dense, tmp_path):
    """Two ranks on gloo through chunked prefill, preemption and prefix hits: greedy tokens equal and logits
    within the fp32 parity tolerance of transformers on the dequantized twin, which one rank meets too."""
    quant_dir, twin_dir = write_quantized(dense, tmp_path, fmt)
    llm = _engine(quant_dir, tensor_parallel_size=2)
    try:
        o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj
        assert isinstance(o_proj, QuantizedLinear) and o_proj.in_features == 128  # rank 0's half of 256
        _run_and_compare(llm, twin_dir, _prompts())
    finally:
        llm.close()


def test_a_row_parallel_split_that_cuts_groups_is_refused_naming_the_layer(tiny_checkpoint_factory, tmp_path):
    """4 heads of 32: o_proj has 128 inputs, 64 per rank, which cannot hold AWQ's groups of 128."""
    dense_dir = tiny_checkpoint_factory("llama", hidden_size=128, intermediate_size=256, head_dim=32)
    quant_dir, _ = write_quantized(dense_dir, tmp_path, "awq-4bit-g128")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.o_proj .*cannot be split over "
                                              r"tensor_parallel_size 2: .*groups of 128"):
        build_model(read_checkpoint(quant_dir), torch.float32, "cpu", 256, False, tp=Group(rank=1, size=2))


# ------------------------------------------------------------------------------------------ mixtures of experts
def _moes(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
@torch.inference_mode()
def test_the_ranks_quantized_expert_shards_compute_the_unsharded_experts(fmt, arch, tiny_checkpoint_factory,
                                                                          tmp_path):
    """Each expert's gate/up: the ranks' gate rows, then up rows, are the whole expert's (column-parallel over
    the intermediate dimension); its down: the ranks' partial sums over their inputs add up to it (whole
    groups, act-order map sliced). Then a whole layer: with the same routing, the ranks' partial sums over all
    hit experts are the unsharded layer's output."""
    quant_dir, _ = write_quantized(tiny_checkpoint_factory(arch, **MOE_TP_SHAPE), tmp_path, fmt)
    ckpt = read_checkpoint(quant_dir)
    full = _moes(build_model(ckpt, torch.float32, "cpu", 256, False)[0])
    ranks = [_moes(build_model(ckpt, torch.float32, "cpu", 256, False, tp=Group(rank=r, size=2))[0]) for r in (0, 1)]
    assert full and all(len(r) == len(full) for r in ranks)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 128, generator=gen)
    h = torch.randn(9, 256, generator=gen)
    for i, moe in enumerate(full):
        shards = [r[i] for r in ranks]
        assert all(s.inter == 128 for s in shards)
        for e, expert in enumerate(moe.experts):
            parts = [s.experts[e] for s in shards]
            assert all(isinstance(p.gate_up_proj, QuantizedLinear) and isinstance(p.down_proj, QuantizedLinear)
                       and p.down_proj.in_features == 128 for p in parts)
            outs = [p.gate_up_proj(x).split(128, dim=-1) for p in parts]  # each rank: its gate rows, its up rows
            got = torch.cat([outs[0][0], outs[1][0], outs[0][1], outs[1][1]], dim=-1)
            torch.testing.assert_close(got, expert.gate_up_proj(x), atol=1e-4, rtol=1e-4, msg=f"{fmt} gate_up {e}")
            got = parts[0].down_proj(h[:, :128]) + parts[1].down_proj(h[:, 128:])
            torch.testing.assert_close(got, expert.down_proj(h), atol=1e-4, rtol=1e-4, msg=f"{fmt} down {e}")
        weights, ids = route(moe.gate(x), moe.top_k, moe.renormalize)
        got = sum(s.experts_one_by_one(x, weights, ids) for s in shards)
        torch.testing.assert_close(got, moe.experts_one_by_one(x, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, fmt", [("qwen3_moe", "awq-4bit-g128"), ("mixtral", "gptq-4bit-sym-desc_act-g32"),
                                       ("mixtral", "w4a16-group128"), ("qwen3_moe", "fp8-block128")])
def test_tp2_on_quantized_experts_generates_what_one_rank_and_transformers_generate(arch, fmt,
                                                                                    tiny_checkpoint_factory, tmp_path):
    """Two ranks on gloo, experts sharded: greedy tokens equal and logits within the fp32 parity tolerance of
    transformers on the dequantized twin, and the same tokens as one rank with logits within that tolerance."""
    quant_dir, twin_dir = write_quantized(tiny_checkpoint_factory(arch, **MOE_TP_SHAPE), tmp_path, fmt)
    prompts, params = _prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    one = _engine(quant_dir)
    recorder = one.engine.runner.sampler = LogitRecorder(one.engine.runner.sampler)
    single = [(o.token_ids, torch.stack(recorder.rows[o.request_id]))
              for o in one.generate(prompts, params, use_tqdm=False)]
    one.close()
    llm = _engine(quant_dir, tensor_parallel_size=2)
    try:
        down = _moes(llm.engine.runner.model)[0].experts[0].down_proj
        assert isinstance(down, QuantizedLinear) and down.in_features == 128  # rank 0's half of 256
        outs = _run_and_compare(llm, twin_dir, prompts)
        rows = llm.engine.runner.sampler.rows
        for out, (tokens, logits) in zip(outs, single, strict=True):
            assert out.token_ids == tokens
            torch.testing.assert_close(torch.stack(rows[out.request_id]), logits, atol=LOGIT_ATOL, rtol=0)
    finally:
        llm.close()


def test_an_expert_split_that_cuts_groups_is_refused_naming_the_expert(tiny_checkpoint_factory, tmp_path):
    """Experts 128 wide: each rank's 64 inputs of down_proj cannot hold AWQ's groups of 128."""
    dense_dir = tiny_checkpoint_factory("mixtral", **dict(TP_SHAPE, intermediate_size=128))
    quant_dir, _ = write_quantized(dense_dir, tmp_path, "awq-4bit-g128")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.block_sparse_moe\.experts\.\d+\.w2 .*cannot be "
                                              r"split over tensor_parallel_size 2: .*groups of 128"):
        build_model(read_checkpoint(quant_dir), torch.float32, "cpu", 256, False, tp=Group(rank=1, size=2))


# ----------------------------------------------------------------------------------------------------- GGUF
def _gguf_form(type_name: str, n: int, k: int, seed: int) -> tuple[QuantizedWeight, int]:
    """One ``[n, k]`` tensor of random ``type_name`` blocks (sane fp16 scale fields) as the loader reads it, and
    its bits; the gguf package cannot write K-quants, so the bytes are random: every pattern is a valid block."""
    per, nbytes = gguf_blocks.BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
    for off in {"Q6_K": (208,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}.get(type_name, (0,)):
        raw[..., off:off + 2] = (rng.standard_normal((n, k // per, 1)) * 0.01).astype(np.float16).view(np.uint8)
    form = gguf_blocks.unpack(type_name, torch.from_numpy(raw.reshape(n, -1)), k)
    return QuantizedWeight(form.values, form.scales, form.zeros, form.group_size), 4 if form.kernel == "int4" else 8


@pytest.mark.parametrize("type_name", list(gguf_blocks.BLOCKS))
@torch.inference_mode()
def test_gguf_blocks_shard_over_the_ranks_in_whole_groups(type_name):
    """A GGUF linear kept packed (Q4_0/Q4_1/Q4_K as grouped 4-bit, Q5_K/Q6_K/Q8_0 as grouped 8-bit, groups of 32
    or 16) goes through the same quantized loaders: the ranks' column-parallel outputs are the layer's, their
    row-parallel partial sums add up to it."""
    weight, bits = _gguf_form(type_name, 64, 512, seed=len(type_name))
    full = QuantizedLinear(weight, bits)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    columns = [ColumnParallelLinear(512, 64, False, Group(rank=r, size=2)).quantized_loader(weight, None)[0]
               for r in (0, 1)]
    got = torch.cat([QuantizedLinear(w, bits)(x) for w in columns], dim=-1)
    torch.testing.assert_close(got, full(x), atol=1e-4, rtol=1e-4)
    rows = [RowParallelLinear(512, 64, False, Group(rank=r, size=2)).quantized_loader(weight, None)[0] for r in (0, 1)]
    assert all(w.scales.shape[1] == 256 // weight.group_size for w in rows)  # whole groups, their scales only
    got = sum(QuantizedLinear(w, bits)(x[:, r * 256:(r + 1) * 256]) for r, w in enumerate(rows))
    torch.testing.assert_close(got, full(x), atol=1e-4, rtol=1e-4)


def test_a_gguf_split_that_cuts_groups_is_refused_naming_the_layer(tmp_path):
    """Q4_0 down_proj with 96 inputs: each rank's 48 cut its groups of 32."""
    from test_gguf import byte_level_metadata, tiny_config, tiny_model, train_byte_level_tokenizer, write_gguf

    meta = byte_level_metadata(train_byte_level_tokenizer())
    model = tiny_model(tiny_config(len(meta["tokens"]), intermediate_size=96))
    path = tmp_path / "cut.gguf"
    write_gguf(path, model, meta, quants={n: Q.Q4_0 for n in model.state_dict() if n.endswith("proj.weight")})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj .*cannot be split over "
                                              r"tensor_parallel_size 2: .*groups of 32"):
        build_model(read_checkpoint(path), torch.float32, "cpu", 256, False, tp=Group(rank=0, size=2))


def test_a_gguf_expert_split_that_cuts_groups_is_refused_naming_the_expert(tmp_path):
    """Qwen3-MoE with Q4_0 experts 32 wide, kept packed: each rank's 16 inputs of an expert's down cut its group."""
    from test_gguf import train_byte_level_tokenizer, write_packed_moe

    path = tmp_path / "cut.gguf"
    write_packed_moe(path, "qwen3moe-q4_0", train_byte_level_tokenizer())
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.\d+\.down_proj .*cannot be split "
                                              r"over tensor_parallel_size 2: .*groups of 32"):
        build_model(read_checkpoint(path), torch.float32, "cpu", 256, False, tp=Group(rank=0, size=2))


@torch.inference_mode()
def test_a_packed_gguf_embedding_keeps_each_ranks_vocabulary_rows(tmp_path):
    """Q8_0 ``token_embd``, 320 tokens: rank 0 holds rows 0..191, rank 1 rows 192..319 and 64 zero rows, still
    packed; together (padding dropped) they are the one-rank table."""
    from test_gguf import byte_level_metadata, tiny_config, tiny_model, train_byte_level_tokenizer, write_gguf

    meta = byte_level_metadata(train_byte_level_tokenizer())
    model = tiny_model(tiny_config(len(meta["tokens"]), tie_word_embeddings=True))
    path = tmp_path / "embed.gguf"
    quants = {n: Q.Q4_0 for n in model.state_dict() if n.endswith("proj.weight")}
    write_gguf(path, model, meta, quants=quants | {"model.embed_tokens.weight": Q.Q8_0})
    ckpt = read_checkpoint(path)
    full = build_model(ckpt, torch.float32, "cpu", 256, False)[0]
    ranks = [build_model(ckpt, torch.float32, "cpu", 256, False, tp=Group(rank=r, size=2))[0] for r in (0, 1)]
    tables = [r.model.embed_tokens.table for r in ranks]
    assert [r.model.embed_tokens.vocab_start for r in ranks] == [0, 192]
    assert all(t.out_features == 192 and t.bits == 8 and r.lm_head is t for r, t in zip(ranks, tables, strict=True))
    want = full.model.embed_tokens.table.dequantized()
    got = torch.cat([t.dequantized() for t in tables])
    torch.testing.assert_close(got[:320], want, atol=0, rtol=0)
    assert not got[320:].any()


def test_tp2_runs_the_fused_int4_expert_kernel_on_each_ranks_slices(tiny_checkpoint_factory, tmp_path, native_int4,
                                                                    native_moe):
    """bfloat16 on AVX512-BF16: each rank stacks its 4-bit expert shards (128 of the 256 intermediate channels)
    for kernels/cpu_moe.py's int4 kernel and the block all-reduces the ranks' sums. Judged as the one-rank test
    (test_prequantized_moe.py) judges it, on the engine's own tokens against the float32 twin: mean |logit error|
    per prompt under 0.25 (bfloat16 may swap a token's near-tied experts; a wrong shard moves every logit)."""
    quant_dir, twin_dir = write_quantized(tiny_checkpoint_factory("qwen3_moe", **MOE_TP_SHAPE), tmp_path,
                                          "awq-4bit-g128")
    llm = _engine(quant_dir, dtype="bfloat16", tensor_parallel_size=2)
    try:
        moes = _moes(llm.engine.runner.model)
        assert moes and all(isinstance(m.packed, cpu_moe.QuantizedExperts) and m.inter == 128 for m in moes)
        errors = mean_logit_errors(llm, twin_dir, _prompts())
    finally:
        llm.close()
    assert sum(errors) / len(errors) < 0.25, f"mean |logit error| per prompt {errors}"

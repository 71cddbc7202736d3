"""Greedy output of the engine equals transformers on the same weights, token for token (fp32).

Every run forces the engine's hard paths: chunked prefill (a small token budget), preemption by
recompute (a tiny KV pool) and prefix-cache hits (prompts sharing a prefix). Logits must agree
within LOGIT_ATOL, well below the gaps that decide greedy choices.
"""

from __future__ import annotations

import random

import pytest
import torch

from kubellm.kernels.cpu_decode_layer import decode_layer_
from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.sampling.params import SamplingParams
from tiny_checkpoints import hf_greedy, load_hf_model

LOGIT_ATOL = 1e-4  # fp32; logits here are O(1-10)
MAX_NEW = 24


def _prompts(seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(13)]  # a prefix several prompts share
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 6, 11)]
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 23, 40)]
    prompts.append(list(shared))  # an exact copy of the shared prefix
    return prompts


class LogitRecorder:
    """Wraps the sampler to keep every sampled row's logits, per request."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.rows: dict[str, list[torch.Tensor]] = {}

    def sample(self, logits, seqs, *args):
        for row, seq in zip(logits, seqs, strict=True):
            self.rows.setdefault(seq.request_id, []).append(row.clone())
        return self.sampler.sample(logits, seqs, *args)


def mean_logit_errors(llm: LLM, reference_dir, prompts, max_new: int = 12) -> list[float]:
    """Greedy-generate ``prompts`` and return, per prompt, the mean |logit error| of every sampled row against
    transformers (float32) on ``reference_dir`` fed the engine's own tokens: for bf16 kernels, whose tokens may
    part from float32's after a few steps when the top logits are closer than bf16 rounding."""
    recorder = llm.engine.runner.sampler = LogitRecorder(llm.engine.runner.sampler)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True),
                        use_tqdm=False)
    model = load_hf_model(reference_dir, torch.float32)
    errors = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            ref = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
            errors.append((torch.stack(recorder.rows[out.request_id]) - ref).abs().mean().item())
    return errors


def _engine(model_dir, **kw) -> LLM:
    args = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=24,
                max_model_len=256)
    args.update(kw)
    if args["dtype"] == "float32":
        # 4-bit layers on the exact path on every CPU (AVX2 builds would quantize float32 decode rows to int8;
        # those kernels are checked against their references in tests/kernels/test_cpu_int4_gemm.py)
        args.setdefault("cpu_int4_activations", "bf16")
    return LLM(str(model_dir), progress=False, **args)


def _run_and_compare(llm: LLM, model_dir, prompts, max_new: int = MAX_NEW):
    """Greedy tokens equal to transformers' on ``model_dir`` and logits within LOGIT_ATOL, per prompt."""
    recorder = LogitRecorder(llm.engine.runner.sampler)
    llm.engine.runner.sampler = recorder
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref_tokens, ref_logits = hf_greedy(model_dir, prompts, max_new)
    for out, tokens, logits in zip(outs, ref_tokens, ref_logits, strict=True):
        assert out.token_ids == tokens, f"prompt of {len(out.prompt_token_ids)} tokens diverged"
        ours = torch.stack(recorder.rows[out.request_id])
        assert ours.shape == logits.shape
        torch.testing.assert_close(ours, logits, atol=LOGIT_ATOL, rtol=0)
    return outs


def _tiny(arch: str, doc: str):
    """A module fixture: the tiny checkpoint of ``arch`` (tests/tiny_checkpoints.py), built once per session."""

    @pytest.fixture(scope="module")
    def checkpoint(tiny_checkpoint_factory):
        return tiny_checkpoint_factory(arch)

    checkpoint.__doc__ = doc
    return checkpoint


tiny_qwen3 = _tiny("qwen3", "Qwen3: per-head RMSNorm on q and k before rotary, no q/k/v bias.")
tiny_qwen3_moe = _tiny("qwen3_moe", "Qwen3-MoE: 8 experts, top-2 renormalised, layer 1 dense; saved by transformers.")
tiny_mixtral = _tiny("mixtral", "Mixtral: block_sparse_moe with w1/w2/w3 experts in every layer; saved by transformers.")
tiny_gemma2 = _tiny("gemma2", "Gemma 2: a 12-token window on layers 0 and 2, soft-capped attention and final logits.")
tiny_gemma3 = _tiny("gemma3", "Gemma 3: q/k norms, a 12-token window on layers 0 and 2, local and global rotary.")
tiny_phi3 = _tiny("phi3", "Phi-3: q/k/v and gate/up fused in the checkpoint.")


@pytest.fixture(scope="module")
def tiny_qwen3_moe_128(tiny_checkpoint_factory):
    """Qwen3-30B-A3B's routing: 128 experts, 8 per token, every layer sparse (experts of 16)."""
    return tiny_checkpoint_factory("qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=16,
                                   mlp_only_layers=[])


@pytest.fixture(scope="module")
def tiny_mistral_window(tiny_checkpoint_factory):
    """Mistral v0.1's layout: every layer windowed (12 tokens: three 4-token KV blocks)."""
    return tiny_checkpoint_factory("mistral", sliding_window=12)


@pytest.fixture(scope="module")
def tiny_phi3_window(tiny_checkpoint_factory):
    """Phi-3-mini-4k's layout: every layer windowed, by one less than a block multiple (2047 there, 11 here)."""
    return tiny_checkpoint_factory("phi3", sliding_window=11)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama3", "tiny_qwen2", "tiny_mistral",
                                     "tiny_llama_sharded", "tiny_qwen3", "tiny_phi3", "tiny_qwen3_moe",
                                     "tiny_qwen3_moe_128", "tiny_mixtral", "tiny_gemma2", "tiny_gemma3", "tiny_mistral_window",
                                     "tiny_phi3_window"])
def test_greedy_equals_transformers_with_chunking_preemption_and_prefix_hits(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    llm = _engine(model_dir)
    _run_and_compare(llm, model_dir, _prompts())
    sched, bm = llm.engine.scheduler, llm.engine.block_manager
    assert sched.num_preemptions > 0, "the tiny KV pool should have forced preemption"
    assert bm.prefix_hits > 0, "shared prefixes should have hit the prefix cache"
    assert bm.num_used_blocks == 0, "every block must be free once all requests finished"


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_phi3", "tiny_qwen3_moe",
                                     "tiny_mixtral", "tiny_gemma2", "tiny_gemma3", "tiny_mistral_window",
                                     "tiny_phi3_window"])
def test_torch_reference_attention_backend_also_equals_transformers(fixture, request):
    """`auto` uses the native CPU kernels where they build; the plain-PyTorch references everywhere (attention,
    layer ops, unpacked weights) must agree too."""
    model_dir = request.getfixturevalue(fixture)
    llm = _engine(model_dir, attention_backend="torch", layer_ops="torch", prepack_weights="off")
    assert type(llm.engine.runner.backend).__name__ == "TorchAttentionBackend"
    _run_and_compare(llm, model_dir, _prompts())


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_mistral", "tiny_qwen3", "tiny_phi3", "tiny_qwen3_moe",
                                     "tiny_mixtral", "tiny_gemma2", "tiny_gemma3"])
def test_triton_attention_backend_equals_transformers(fixture, request):
    """The CUDA path's kernels, run by Triton's interpreter on CPU here (compiled on a GPU): the same greedy
    tokens through chunked prefill over cached context, preemption and prefix hits. Mistral is MQA with
    head_dim 32, llama GQA with head_dim 16; decode tiles span several 4-token KV blocks. Gemma's windowed
    and soft-capped layers run the kernels too (the window and cap are kernel arguments)."""
    model_dir = request.getfixturevalue(fixture)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = _engine(model_dir, attention_backend="triton", device=device)
    assert type(llm.engine.runner.backend).__name__ == "TritonAttentionBackend"
    _run_and_compare(llm, model_dir, _prompts()[:6])
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits > 0
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe"])  # Qwen3-MoE: q/k norms and experts
def test_triton_layer_ops_equal_transformers(fixture, request):
    """The CUDA path's fused RMSNorm (+ residual add), rotary (Qwen3: q/k norms + rotary) and SiLU-and-mul,
    run by Triton's interpreter on CPU here (the same hook as the Triton attention backend), through chunked
    prefill, preemption and prefix hits."""
    from kubellm.kernels import triton_layer_ops

    model_dir = request.getfixturevalue(fixture)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = _engine(model_dir, layer_ops="triton", attention_backend="torch", prepack_weights="off", device=device)
    model = llm.engine.runner.model
    switches = [m for m in model.modules() if isinstance(getattr(type(m), "native", None), bool)]
    assert switches and all(m.native and m.ops is triton_layer_ops for m in switches)
    assert model.model.fused_layers is None  # the CPU fused decode layer never takes Triton ops
    _run_and_compare(llm, model_dir, _prompts()[:6])
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits > 0


def test_triton_backend_on_cpu_without_the_interpreter_is_a_clear_error(tiny_llama, monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="Triton kernels need a CUDA device.*--attention-backend torch"):
        _engine(tiny_llama, attention_backend="triton", device="cpu")


def test_auto_backend_uses_the_native_cpu_kernel_when_it_builds(tiny_llama, native_kernels):
    assert type(_engine(tiny_llama).engine.runner.backend).__name__ == "NativeCpuAttentionBackend"


def test_greedy_equals_transformers_with_roomy_cache_and_one_big_step(tiny_llama):
    """The easy path too: no chunking, no preemption, everything prefilled together."""
    llm = _engine(tiny_llama, max_num_batched_tokens=512, max_num_seqs=16, num_kv_blocks=256)
    _run_and_compare(llm, tiny_llama, _prompts(seed=1))
    assert llm.engine.scheduler.num_preemptions == 0


def test_prefix_cache_hit_across_requests_gives_same_tokens(tiny_qwen2):
    """A second request reusing cached blocks decodes exactly as the first did."""
    llm = _engine(tiny_qwen2, num_kv_blocks=128)
    prompt = _prompts()[2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 4 * ((len(prompt) - 1) // 4) - 4 > 0
    assert first.token_ids == second.token_ids


def test_qwen3_with_two_tensor_parallel_ranks_equals_transformers(tiny_qwen3):
    """The q/k norms are per head and replicated: each rank normalises its own heads."""
    llm = _engine(tiny_qwen3, tensor_parallel_size=2)
    try:
        _run_and_compare(llm, tiny_qwen3, _prompts()[:5])
    finally:
        llm.close()


@pytest.mark.parametrize("served_len", [48, 256])
def test_phi3_longrope_uses_the_short_or_long_factors_by_the_served_context(served_len, tiny_checkpoint_factory):
    """The tiny model was pre-trained on 48 positions: serving 48 uses the short factors, serving more the long
    ones for every position; transformers agrees for sequences that stay on one side of 48."""
    model_dir = tiny_checkpoint_factory("phi3_long")
    rng = random.Random(1)
    lengths = (1, 7, 20) if served_len == 48 else (49, 60, 90)  # with MAX_NEW, all short ones stay within 48
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    _run_and_compare(_engine(model_dir, max_model_len=served_len, num_kv_blocks=96), model_dir, prompts)


def test_phi3_with_two_tensor_parallel_ranks_equals_transformers(tiny_phi3):
    """The fused checkpoint tensors are cut per projection before sharding, so each rank gets whole heads."""
    llm = _engine(tiny_phi3, tensor_parallel_size=2)
    try:
        _run_and_compare(llm, tiny_phi3, _prompts()[:5])
    finally:
        llm.close()


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_mixture_of_experts_with_two_tensor_parallel_ranks_equals_transformers(fixture, request):
    """Each rank holds every expert's half of the intermediate dimension; the router is replicated."""
    model_dir = request.getfixturevalue(fixture)
    llm = _engine(model_dir, tensor_parallel_size=2)
    try:
        _run_and_compare(llm, model_dir, _prompts()[:5])
    finally:
        llm.close()


def test_native_moe_kernel_in_a_bfloat16_engine_matches_transformers(tiny_checkpoint_factory, native_moe):
    """bfloat16 with 128 experts top-8: the engine packs every MoE layer for the CPU kernel (kernel choice
    ``moe native``), decode steps run the fused decode layer, and its logits over 8 greedy steps (transformers fed
    the engine's tokens) are as close to float32 transformers as the per-expert module tree's (``--layer-ops
    torch``). Compared on average: in bfloat16 a rounding difference can swap the 8th and 9th expert of a token,
    which moves single logits by up to ~0.4 on every path (and greedy tokens part from transformers' bfloat16
    run on one of these prompts on both paths); a wrong kernel moves them all by the logits' own size (~1-4)."""
    from kubellm.runtime.layers.moe import FusedMoE

    model_dir = tiny_checkpoint_factory("qwen3_moe", dtype=torch.bfloat16, num_experts=128, num_experts_per_tok=8,
                                        moe_intermediate_size=32, mlp_only_layers=[])
    prompts = _prompts()[:6]
    mean_errors = {}
    for settings, packed in (({}, True), ({"layer_ops": "torch"}, False)):
        llm = _engine(model_dir, dtype="bfloat16", **settings)
        moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
        assert moes and all((m.packed is not None) == packed for m in moes)
        assert (llm.engine.runner.model.model.fused_layers is not None) == packed
        errors = mean_logit_errors(llm, model_dir, prompts, max_new=8)
        mean_errors[packed] = sum(errors) / len(errors)
        assert mean_errors[packed] < 0.05, f"{settings}: mean |logit error| per prompt {errors}"
    assert mean_errors[True] < 1.5 * mean_errors[False], mean_errors


@pytest.mark.parametrize(("arch", "tp"), [("llama", 1), ("qwen2", 1), ("qwen3", 1), ("qwen2", 2)])
def test_native_bf16_linears_in_a_bfloat16_engine_match_transformers(arch, tp, tiny_checkpoint_factory,
                                                                     native_bf16_gemm):
    """bfloat16: every dense linear and the LM head run kubellm's bf16 kernel (kernel choice ``prepack native``;
    Qwen2's q/k/v bias in float32, and its tied embedding reads its rows from the LM head's packed table).
    Greedy tokens equal transformers' bfloat16 run and the first step's logits are as close to them as oneDNN's
    path (F.linear's on CPUs where oneDNN cannot pack bfloat16); with two tensor-parallel ranks each packs its own slice. (Tied Qwen3 is left out: there every path, F.linear's too, meets a near-tie in bfloat16 and leaves
    transformers' tokens on one prompt.)"""
    from torch import nn

    from kubellm.runtime.layers.linear import NativeLinear, can_pack

    baseline = "onednn" if can_pack("cpu", torch.bfloat16) else "off"  # F.linear where oneDNN cannot (AVX2)
    model_dir = tiny_checkpoint_factory(arch, dtype=torch.bfloat16)
    prompts = _prompts()[:4]
    ref_tokens, ref_logits = hf_greedy(model_dir, prompts, 8, dtype=torch.bfloat16)
    errors = {}
    for prepack in ("native", baseline):
        llm = _engine(model_dir, dtype="bfloat16", prepack_weights=prepack, tensor_parallel_size=tp)
        model = llm.engine.runner.model  # rank 0's
        assert llm.engine.kernels.prepack == prepack
        assert (model.model.fused_layers is not None) == (prepack == "native" and tp == 1)  # decode steps
        assert prepack == "off" or not any(type(m) is nn.Linear for m in model.modules())
        assert any(isinstance(m, NativeLinear) for m in model.modules()) == (prepack == "native")
        if prepack == "native" and model.config.tie_word_embeddings:
            assert "weight" not in dict(model.model.embed_tokens.named_parameters())  # one copy of the table
        recorder = LogitRecorder(llm.engine.runner.sampler)
        llm.engine.runner.sampler = recorder
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        llm.close()
        assert [o.token_ids for o in outs] == ref_tokens, prepack
        errors[prepack] = sum((recorder.rows[o.request_id][0] - ref[0].float()).abs().mean()
                              for o, ref in zip(outs, ref_logits, strict=True)) / len(outs)
    assert errors["native"] < 2 * errors[baseline] + 1e-3, errors


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_window", "qwen3", "qwen3_moe", "mixtral", "phi3_long"])
def test_fused_decode_layers_give_the_module_trees_logits_bit_for_bit(arch, tiny_checkpoint_factory, monkeypatch,
                                                                     native_bf16_gemm, native_moe):
    """bfloat16 on the native kernels: pure decode steps (one or several rows) run one native call per layer
    (kernels/cpu_decode_layer.py), which calls the module tree's own kernels in its order, so every sampled row's
    logits are the same bits as with ``KUBELLM_FUSED_DECODE=0``; Qwen2's qkv bias, Mistral's window, Qwen3's q/k
    norms, the packed experts of Qwen3-MoE (with its dense layer 1) and Mixtral, and Phi-3's longrope tables
    (served past the pre-trained length: the long factors) included."""
    from kubellm.runtime.layers import fused_decode
    from kubellm.runtime.models import llama

    model_dir = (tiny_checkpoint_factory("mistral", dtype=torch.bfloat16, sliding_window=12) if arch == "mistral_window"
                 else tiny_checkpoint_factory(arch, dtype=torch.bfloat16))
    prompts = _prompts()[:4]
    rows, tokens, calls = {}, {}, []
    monkeypatch.setattr(fused_decode, "decode_layer_", lambda *a: calls.append(1) or decode_layer_(*a))
    for fused in ("1", "0"):
        monkeypatch.setenv(llama.FUSED_DECODE_ENV, fused)
        calls.clear()
        llm = _engine(model_dir, dtype="bfloat16", prepack_weights="native")
        assert (llm.engine.runner.model.model.fused_layers is not None) == (fused == "1")
        recorder = LogitRecorder(llm.engine.runner.sampler)
        llm.engine.runner.sampler = recorder
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        llm.close()
        tokens[fused] = [o.token_ids for o in outs]
        rows[fused] = [torch.stack(recorder.rows[o.request_id]) for o in outs]
        assert bool(calls) == (fused == "1")  # pure decode steps came after the prefills and ran the fused layer
    assert tokens["1"] == tokens["0"]
    for fused_rows, tree_rows in zip(rows["1"], rows["0"], strict=True):
        assert torch.equal(fused_rows, tree_rows)


_BACKENDS = {"auto": {}, "torch": {"attention_backend": "torch", "layer_ops": "torch", "prepack_weights": "off"},
             "triton": {"attention_backend": "triton", "device": "cuda" if torch.cuda.is_available() else "cpu"}}


@pytest.mark.parametrize(("fixture", "backend"), [
    ("tiny_gemma2", "auto"), ("tiny_gemma3", "auto"), ("tiny_mistral_window", "auto"), ("tiny_phi3_window", "auto"),
    ("tiny_mistral_window", "torch"), ("tiny_phi3_window", "torch"), ("tiny_phi3_window", "triton"),
])  # fmt: skip
def test_windows_hold_for_prompts_far_longer_than_the_window(fixture, backend, request):
    """Long prompts (5-8 windows) beside short ones in one batch, chunked across many steps: a position outside
    its layer's window must never be attended, whichever step or block it sits in."""
    model_dir = request.getfixturevalue(fixture)
    _run_and_compare(_engine(model_dir, num_kv_blocks=96, **_BACKENDS[backend]), model_dir, _long_prompts())


def _long_prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (90, 3, 61, 14)]


def test_triton_split_kv_decode_holds_windows_and_equals_transformers(tiny_phi3_window, monkeypatch):
    """Split KV forced as a GPU with SMs to spare would choose it (64-token partitions once a block table spans
    more): through the engine, partitions wholly before a window or past a context must contribute nothing."""
    from kubellm.kernels import triton_paged_attention as tpa

    widths = []
    monkeypatch.setattr(tpa, "partition_tokens", lambda batch, kv_heads, max_context, sms, block_n:
                        widths.append(max_context) or (64 if max_context > 64 else 0))
    _run_and_compare(_engine(tiny_phi3_window, num_kv_blocks=96, **_BACKENDS["triton"]), tiny_phi3_window,
                     _long_prompts())
    assert max(widths) > 64  # some decode steps really split


def test_gemma3_with_two_tensor_parallel_ranks_equals_transformers(tiny_gemma3):
    llm = _engine(tiny_gemma3, tensor_parallel_size=2)
    try:
        _run_and_compare(llm, tiny_gemma3, _prompts()[:5])
    finally:
        llm.close()


def test_gemma3_multimodal_checkpoint_serves_its_text_tower(tiny_gemma3, tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (as google/gemma-3-4b-it ships): the text model's tensors
    under language_model.*, a vision tower that is skipped; generates what the text model generates."""
    from tiny_checkpoints import wrap_in_gemma3_multimodal

    wrapped = wrap_in_gemma3_multimodal(tiny_gemma3, tmp_path / "gemma3-mm")
    assert _engine(wrapped, max_model_len=None).engine.max_model_len == 512  # the text config's context
    llm = _engine(wrapped)
    assert llm.engine.model_config.architecture == "Gemma3ForCausalLM"
    _run_and_compare(llm, tiny_gemma3, _prompts()[:4])  # the reference is the text model itself


def test_a_gemma_window_as_long_as_the_served_context_is_plain_attention(tiny_checkpoint_factory):
    """Serving no more than the window, no key can fall out of it: those layers run as plain attention (the
    kernels), and still equal transformers."""
    model_dir = tiny_checkpoint_factory("gemma3")
    llm = _engine(model_dir, max_model_len=12)
    assert all(layer.self_attn.attn.opts.window is None for layer in llm.engine.runner.model.model.layers)
    rng = random.Random(3)
    _run_and_compare(llm, model_dir, [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 4, 7)], max_new=4)

"""Every engine setting, declared once: the ``kubellm`` CLI flags, :class:`~kubellm.runtime.engine.config.EngineConfig`'s
defaults, the LLMDeployment API's fields and the operator's ``kubellm serve`` arguments all derive from
:data:`ENGINE_SETTINGS` (tests/operator/test_engine_settings.py proves they agree).

Adding a setting is one :class:`EngineSetting` line here plus the engine code that reads it; give it a
``crd_field`` under ``engine.`` and it is in the CRD and rendered into the pods too.

This module imports nothing beyond the standard library: the operator (no torch) reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Render = Literal["always", "changed"]


@dataclass(frozen=True)
class EngineSetting:
    """One engine setting.

    ``name`` is the :class:`EngineConfig` field and the CLI's ``dest``. ``flag`` is the ``kubellm serve``
    option (None: not on the command line); a bool setting's flag turns it off (``--no-prefix-caching``), unless
    it does not start with ``--no-``: then it is a pair (``--cuda-graphs``/``--no-cuda-graphs``).
    ``help`` is the CLI's (argparse ``%(default)s`` expands); ``doc`` is what ``kubectl explain`` prints.
    ``choices`` bind everywhere; ``crd_choices`` narrow what the LLMDeployment API offers where the runtime
    takes more (dtype aliases such as bf16, any KV block size). ``crd_field`` is the snake_case path of the
    spec field (``engine.max_num_seqs``, ``dtype``), None when the operator derives the flag itself (device,
    threads) or offers none. ``render``: ``always`` pins the value in every pod template; ``changed`` passes
    the flag only when the spec departs from the default. ``ge``/``gt``/``le`` bound numbers in the CRD.
    ``env``: an environment variable that supplies the CLI default (an LLMDeployment's spec.env reaches it).
    """

    name: str
    type: type
    default: Any
    help: str
    flag: str | None = None
    choices: tuple[Any, ...] | None = None
    crd_choices: tuple[Any, ...] | None = None
    crd_field: str | None = None
    doc: str | None = None
    render: Render = "changed"
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    env: str | None = None
    metavar: str | None = None

    @property
    def api_choices(self) -> tuple[Any, ...] | None:
        """The values the LLMDeployment API accepts (None: any value of the type within the bounds)."""
        return self.crd_choices or self.choices

    def cli_value(self, value: Any) -> list[str]:
        """The ``kubellm serve`` arguments that set ``value`` (a bool setting's flag stands alone)."""
        if self.flag is None:
            raise ValueError(f"{self.name} has no command-line flag")
        if self.type is bool:
            if value == self.default:
                return []
            return [self.flag] if self.flag.startswith("--no-") or value else ["--no-" + self.flag[2:]]
        return [self.flag, str(value)]


ENGINE_SETTINGS: tuple[EngineSetting, ...] = (
    EngineSetting(
        "dtype", str, "auto", flag="--dtype",
        help="float32 | bfloat16 | float16 | auto (bf16 where the hardware has fast bf16, else float32)",
        crd_choices=("auto", "bfloat16", "float16", "float32"), crd_field="dtype", render="always",
        doc="Activation and (unquantized) weight dtype. auto: bfloat16 on GPUs and on CPUs with fast bfloat16, "
        "else float32.",
    ),
    EngineSetting("device", str, "auto", flag="--device", help="cpu | cuda | auto"),
    EngineSetting(
        "max_model_len", int, None, flag="--max-model-len", help="context length (default: the model's)",
        crd_field="engine.max_model_len", ge=1,
        doc="Longest sequence (prompt + generated tokens) served. Default: the model's context length.",
    ),
    EngineSetting(
        "max_num_seqs", int, 256, flag="--max-num-seqs", help="most sequences in one batch (default %(default)s)",
        crd_field="engine.max_num_seqs", render="always", ge=1,
        doc="Most sequences batched together in one engine step.",
    ),
    EngineSetting(
        "max_num_batched_tokens", int, 2048, flag="--max-num-batched-tokens",
        help="token budget of one engine step; long prompts are prefilled in chunks of this size",
        crd_field="engine.max_num_batched_tokens", render="always", ge=1,
        doc="Token budget of one engine step; longer prompts are prefilled in chunks of this size.",
    ),
    # The API offers the usual paged-attention block sizes; the runtime takes any (its tests use 4).
    EngineSetting(
        "block_size", int, 16, flag="--block-size", help="tokens per KV-cache block (default %(default)s)",
        crd_choices=(8, 16, 32), crd_field="engine.kv_cache_block_size", render="always",
        doc="Tokens per paged KV-cache block.",
    ),
    EngineSetting(
        "kv_cache_memory", str, None, flag="--kv-cache-memory",
        help="KV-cache size, e.g. 2GiB (default: 90%% of free memory; 4GiB max on CPU)",
    ),
    EngineSetting(
        "kv_cache_memory_fraction", float, 0.9, flag="--kv-cache-memory-fraction",
        help="without --kv-cache-memory: this fraction of the memory free after loading (default %(default)s)",
        crd_field="engine.kv_cache_memory_fraction", gt=0, le=1,
        doc="Fraction of the accelerator memory left after loading the weights that the KV cache may take "
        "(0 < x <= 1).",
    ),
    EngineSetting(
        "enable_prefix_caching", bool, True, flag="--no-prefix-caching", help="disable automatic prefix caching",
        crd_field="engine.prefix_caching", doc="Reuse KV-cache blocks of identical prompt prefixes across requests.",
    ),
    EngineSetting("num_threads", int, None, flag="--num-threads", help="CPU threads for torch (default: all)"),
    EngineSetting(
        "attention_backend", str, "auto", flag="--attention-backend", choices=("auto", "torch", "cpu", "triton"),
        env="KUBELLM_ATTENTION_BACKEND",
        help="attention kernels (attention only): cpu = kubellm's native CPU kernels, triton = Triton kernels "
        "(CUDA), torch = the PyTorch reference; auto = triton on CUDA, cpu on CPU, each when it builds and "
        "passes its check here, else torch (default: $KUBELLM_ATTENTION_BACKEND or auto)",
    ),
    EngineSetting(
        "layer_ops", str, "auto", flag="--layer-ops", choices=("auto", "native", "triton", "torch"),
        help="RMSNorm, rotary embedding and SiLU-and-mul: native = kubellm's fused CPU kernels, triton = fused "
        "Triton kernels (CUDA), torch = the PyTorch references; auto = native on CPU where kubellm's CPU kernels "
        "load and take the model's head size, triton on CUDA once its start-up check passes here, else torch",
    ),
    EngineSetting(
        "prepack_weights", str, "auto", flag="--prepack-weights", choices=("auto", "native", "onednn", "on", "off"),
        help="pack dense linear-layer weights once for a CPU GEMM: native = kubellm's bf16 kernel (bfloat16, "
        "AVX512-BF16; a tied embedding reads the LM head's packed table), onednn (or on) = oneDNN's layout "
        "(float32/bfloat16); auto = native where --layer-ops auto picks native and the kernel loads, else onednn "
        "there, else off",
    ),
    EngineSetting(
        "cpu_int4_activations", str, "auto", flag="--cpu-int4-activations", choices=("auto", "bf16", "int8"),
        help="activations of the native CPU int4 GEMM (4-bit layers: --quantization int4, AWQ, GPTQ, W4A16, GGUF "
        "4-bit), every step: bf16 = as they are (weights widened to bf16); int8 = quantized per weight group to int8 "
        "on the fly and multiplied in integer dot products (AVX512-VNNI, llama.cpp's Q4 x Q8): 1.1-2x faster "
        "than bf16 activations, the activations rounded to 8 bits (+0.1-0.3%% perplexity on SmolLM2); "
        "auto = int8 where the kernel has AVX512-VNNI, else bf16 (default %(default)s)",
    ),
    EngineSetting(
        "quantization", str, "none", flag="--quantization",
        choices=("none", "int8", "int4", "fp8", "awq", "gptq", "gguf"), crd_field="quantization",
        help="weight quantization: int8 = weight-only int8 per output channel (about half bf16's weight memory); "
        "int4 = 4-bit weights with a scale and zero point per 32 inputs (about 30%% of bf16's; a native kernel on "
        "CUDA and on CPUs with AVX512-BF16, dequantized per call elsewhere); fp8, awq, gptq and gguf name a checkpoint's own format: "
        "the checkpoint decides (none), naming it is a check",
        doc="Weight quantization. none: as the checkpoint is (a pre-quantized AWQ, GPTQ, compressed-tensors or FP8 "
        "checkpoint is served quantized, detected from its config.json; a GGUF file's quantized blocks are kept "
        "packed); int8: weight-only int8; int4: 4-bit weights in groups of 32 (fast on GPUs and on CPUs with "
        "AVX512-BF16); fp8, awq, gptq, gguf: the checkpoint must be quantized that way (a check, refused at "
        "start-up when it is not).",
    ),
    EngineSetting(
        "tensor_parallel_size", int, 1, flag="--tensor-parallel-size", crd_field="parallelism.tensor", ge=1,
        help="processes (one per GPU on CUDA) that each hold 1/N of every layer; must divide the model's "
        "attention heads, kv heads and MLP size (default %(default)s)",
        doc="Tensor-parallel degree: each replica shards every layer across this many GPUs. With parallelism.nodes "
        "above 1 the shards span that many pods (one tensor-parallel group across nodes), tensor / nodes in each.",
    ),
    EngineSetting(
        "nnodes", int, 1, flag="--nnodes", crd_field="parallelism.nodes", ge=1, le=64,
        help="nodes (pods) the --tensor-parallel-size ranks span, an equal share on each; node 0 serves HTTP "
        "and hosts the rendezvous at --dist-init-addr (default %(default)s)",
        doc="Nodes (pods) one replica spans. Above 1 the replica is a LeaderWorkerSet group: the leader pod "
        "serves the API and holds tensor-parallel ranks 0..k-1, each worker pod the next k (k = "
        "parallelism.tensor / nodes); one tensor-parallel group spans the pods. Needs the LeaderWorkerSet controller "
        "(github.com/kubernetes-sigs/lws) in the cluster.",
    ),
    EngineSetting(
        "node_rank", int, 0, flag="--node-rank", metavar="R",
        help="this node's index with --nnodes > 1: 0 serves the API; 1..N-1 only run their ranks and exit when "
        "node 0 ends the group (default %(default)s)",
    ),
    EngineSetting(
        "dist_init_addr", str, None, flag="--dist-init-addr", metavar="HOST:PORT",
        help="with --nnodes > 1: where node 0 hosts the ranks' rendezvous (a TCP store); node 0 listens on PORT, "
        "the other nodes connect to HOST:PORT",
    ),
    EngineSetting(
        "speculative_ngram", int, 0, flag="--speculative-ngram", metavar="N",
        help="prompt-lookup speculative decoding: draft tokens by matching the last N..2 tokens against the "
        "prompt and output so far, verified in one forward pass (0 = off, the default; 3-4 suits editing, "
        "extraction, RAG and code). Output is unchanged; drafts back off when rejected",
        crd_field="engine.speculative.ngram", ge=0,
        doc="Prompt-lookup speculative decoding: the longest n-gram (down to 2) of the latest tokens matched "
        "against the prompt and output so far; what follows the match is drafted and verified in one forward "
        "pass. 0 turns it off; 3-4 suits answers that quote their input (editing, extraction, RAG, code). "
        "Output is unchanged.",
    ),
    # The API's engine.speculative.model is a model URI the operator fetches like spec.model (render.py), then
    # passes the local path here: no crd_field.
    EngineSetting(
        "speculative_model", str, None, flag="--speculative-model", metavar="PATH",
        help="draft-model speculative decoding: a smaller checkpoint (HF folder, .gguf or known name) with the "
        "served model's tokenizer drafts --num-speculative-tokens tokens per step, all verified in one forward "
        "pass; output (greedy) or its distribution (sampling) is unchanged. Not with --speculative-ngram",
    ),
    EngineSetting(
        "speculative_method", str, "draft_model", flag="--speculative-method", choices=("draft_model", "eagle"),
        help="what --speculative-model is: draft_model, a smaller checkpoint with the served model's tokenizer; "
        "eagle, an EAGLE-1 head (one decoder layer over the served model's last hidden state and the next "
        "token's embedding) trained for the served model (default %(default)s)",
        crd_field="engine.speculative.method",
        doc="What engine.speculative.model is: draft_model, a smaller model with the served model's tokenizer; "
        "eagle, an EAGLE-1 head trained for the served model (one decoder layer that drafts from the served "
        "model's last hidden state and the next token's embedding, reusing its embedding and LM head; "
        "Llama-family models). EAGLE-3 heads are not supported.",
    ),
    EngineSetting(
        "num_speculative_tokens", int, 4, flag="--num-speculative-tokens", metavar="K",
        help="draft tokens verified per step with --speculative-ngram or --speculative-model (an EAGLE head drafts "
        "them as a chain) (default %(default)s)",
        crd_field="engine.speculative.num_tokens", ge=1,
        doc="Draft tokens verified per step when speculative decoding is on.",
    ),
    EngineSetting(
        "cuda_graphs", bool, True, flag="--cuda-graphs",
        help="replay decode steps from CUDA graphs captured at start-up, one per batch-size bucket (CUDA only, no "
        "effect on CPU; a start-up check falls back to eager decoding when capture fails or a replay differs); "
        "--no-cuda-graphs decodes eagerly (default: on)",
        crd_field="engine.cuda_graphs.enabled",
        doc="Capture decode steps as CUDA graphs at start-up (one per batch-size bucket) and replay them: one launch "
        "per step instead of hundreds. GPU only (no effect on CPU). A start-up check compares a replay with the "
        "eager pass; when capture fails or they differ the engine logs why and decodes eagerly.",
    ),
    EngineSetting(
        "cuda_graph_max_batch_size", int, 256, flag="--cuda-graph-max-batch-size", metavar="N",
        help="largest decode batch (rows) captured as a CUDA graph; buckets are 1, 2, 4, 8, then every 8 up to it "
        "(capped by --max-num-seqs); larger steps run eagerly (default %(default)s)",
        crd_field="engine.cuda_graphs.max_batch_size", ge=1,
        doc="Largest decode batch (sequences; rows with speculative decoding) captured as a CUDA graph: buckets "
        "1, 2, 4, 8, then every 8 up to it, capped by engine.maxNumSeqs. Larger decode steps run eagerly.",
    ),
    EngineSetting("seed", int, 0, flag="--seed", help="seed of the engine's random generator (default %(default)s)"),
)  # fmt: skip

SETTINGS_BY_NAME: dict[str, EngineSetting] = {s.name: s for s in ENGINE_SETTINGS}
SETTINGS_BY_CRD_FIELD: dict[str, EngineSetting] = {s.crd_field: s for s in ENGINE_SETTINGS if s.crd_field}


def setting(name: str) -> EngineSetting:
    return SETTINGS_BY_NAME[name]


def default(name: str) -> Any:
    """The default of a setting (what EngineConfig, the CLI and the API start from)."""
    return SETTINGS_BY_NAME[name].default


ATTENTION_BACKENDS: tuple[str, ...] = setting("attention_backend").choices or ()
LAYER_OPS: tuple[str, ...] = setting("layer_ops").choices or ()
PREPACK_WEIGHTS: tuple[str, ...] = setting("prepack_weights").choices or ()
SPECULATIVE_METHODS: tuple[str, ...] = setting("speculative_method").choices or ()
QUANTIZATIONS: tuple[str, ...] = setting("quantization").choices or ()
CPU_INT4_ACTIVATIONS: tuple[str, ...] = setting("cpu_int4_activations").choices or ()

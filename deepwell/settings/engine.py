"""EngineArgs: every setting of the engine, declared once with its help, flag, environment
variable and checks (`declare.setting`). `deepwell generate`, `bench`, `serve` and `worker`
take their engine flags from here (`flags.py`) and serve's workers receive it as data.

Adding a setting: one `setting(...)` field below, then its use in the engine.
Torch-free: the HTTP process builds and checks it without loading the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepwell.cpu_dtype import AUTO, DtypeChoice, select_dtype
from deepwell.settings import environment as env
from deepwell.settings.declare import check_settings, setting
from deepwell.settings.durations import in_days, parse_duration
from deepwell.settings.model_source import model_argument
from deepwell.settings.parallel import ParallelConfig

if TYPE_CHECKING:
    import torch

DTYPES = (AUTO, "bfloat16", "float32")
QUANTIZATIONS = ("none", "int4")
ATTENTION_BACKENDS = ("auto", "torch", "cpp")
NATIVE_DECODES = ("auto", "off")
KERNEL_SETS = ("auto", "triton")
SPECULATIVE_METHODS = ("ngram", "dspark")
YOCO_TRUNCATION_MODES = ("off", "mask", "compact")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
# DeepInfer's block size (spec/deepinfer.md §1.3); the planner sizes blocks with it too.
BLOCK_SIZE = 128
# Share of the memory budget kept for activations and the allocator, besides weights and KV
# (kv/cache.py plans the KV blocks with it, engine/plan/ the fit).
ACTIVATION_RESERVE = 0.15
_DAY_S = 86400.0


@dataclass
class EngineArgs:
    # They follow DeepInfer where it has one (128-token blocks, spec/deepinfer.md §1.3).
    model: str | None = setting(
        None,
        "a .gguf file, a directory with config.json + safetensors, or a Hugging Face repo id "
        "ORG/NAME, fetched into the hub cache (HF_HUB_CACHE; none with HF_HUB_OFFLINE=1); a "
        "local path of that name wins",
        group="model",
        flags="--model",
        metavar="PATH|ORG/NAME",
        parse=model_argument(),
        default_text="the embedded SmolLM2-135M-Instruct",
    )
    # fp16 matmuls are unusably slow on CPUs: not offered.
    dtype: str = setting(
        AUTO,
        "compute dtype; auto = bfloat16 where the CPU computes it natively (AVX512_BF16, "
        "AMX-BF16, Arm BF16) and torch may use it (not under ATEN_CPU_CAPABILITY=avx2), "
        "float32 elsewhere (cpu_dtype.py); float32 for exact comparisons",
        group="model",
        flags="--dtype",
        choices=DTYPES,
    )
    device: str = setting(
        "auto",
        "where the weights, KV cache and every step's tensors live: cuda, cpu, or auto (cuda "
        "when torch sees a GPU, else cpu); cuda without one is an error. On cuda the C++ "
        "kernels do not apply: attention runs on the torch path or --kernels triton",
        group="model",
        flags="--device",
        choices=DEVICES,
        env="DEEPWELL_DEVICE",
        env_parse=env.parse_text,
    )
    max_model_len: int | None = setting(
        None,
        "context limit in tokens",
        group="model",
        flags="--max-model-len",
        bound="positive",
        default_text="the model's",
    )
    quantization: str = setting(
        "none",
        "int4: linear calls of a few rows (decode steps of up to 8 rows) multiply GGUF blocks "
        "with int8 activations, Q4_1 for the layers and Q8_0 for the output head (a GGUF "
        "checkpoint's own blocks, else quantised at load; layers/quant_linear.py; faster "
        "batch-1 decode); none keeps every linear in the compute dtype",
        flags="--quantization",
        choices=QUANTIZATIONS,
    )
    expand_weights: bool = setting(
        False,
        "DeepSeek-V4.1: dequantise the released FP8/MXFP4 weights to the compute dtype at load "
        "(the reference path; slower, ~2.9x the memory). Off: weights stay in their released "
        "encodings",
        group="model",
        flags="--expand-weights",
        bool_flag="on",
        env="DEEPWELL_EXPAND_WEIGHTS",
        env_parse=env.parse_flag,
    )
    # Batch-invariant mode runs its own kernels whatever this says.
    attention_backend: str = setting(
        "auto",
        "decode attention: cpp (a fused C++ kernel, compiled once per machine on first use; "
        "an error without a compiler), torch (pure torch) or auto (cpp where it builds)",
        flags="--attention-backend",
        choices=ATTENTION_BACKENDS,
        env="DEEPWELL_ATTENTION_BACKEND",
        env_parse=env.parse_text,
    )
    native_decode: str = setting(
        "auto",
        "auto: Llama-family all-decode steps run every layer in one C++ call "
        "(models/llama_native.py) where the model has the cpp attention and either "
        "--quantization int4 linears (steps of a few rows) or dense ones (any row count); "
        "off: always the torch path",
        flags="--native-decode",
        choices=NATIVE_DECODES,
        env="DEEPWELL_NATIVE_DECODE",
        env_parse=env.parse_text,
    )
    kernels: str = setting(
        "auto",
        "kernel set: auto (the native C++ kernels where they build, else torch) or triton "
        "(the Triton kernels on any device; an error when Triton is not installed; "
        "TRITON_INTERPRET=1 runs them on the CPU)",
        flags="--kernels",
        choices=KERNEL_SETS,
        env="DEEPWELL_KERNELS",
        env_parse=env.parse_text,
    )
    memory_gib: float = setting(
        4.0,
        "memory budget for weights plus KV cache, in GiB",
        flags="--memory-gib",
        bound="positive",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "on cuda: the share of the GPU's memory planned for weights plus KV cache, in place "
        "of --memory-gib (engine/device.py); unused on cpu",
        flags="--gpu-memory-utilization",
        metavar="FRACTION",
    )
    enforce_eager: bool = setting(
        False,
        "on cuda: run every decode step eagerly instead of replaying CUDA graphs captured at "
        "batch sizes 1, 2, 4, 8, 16, ... up to --max-num-seqs (engine/decode_graphs.py); on "
        "cpu graphs are off whatever this says",
        flags="--enforce-eager",
        bool_flag="on",
        env="DEEPWELL_ENFORCE_EAGER",
        env_parse=env.parse_flag,
    )
    max_num_seqs: int = setting(
        64,
        "requests in one engine step (batch size limit)",
        flags="--max-num-seqs",
        bound="positive",
    )
    max_num_batched_tokens: int = setting(
        1024,
        "token budget of one engine step: prefill chunks and decodes together",
        flags="--max-num-batched-tokens",
        bound="positive",
    )
    # The seed of the seeds drawn for requests that bring none; each command's own --seed
    # seeds something else (a request, a workload), so this one has no flag.
    seed: int = setting(0, "seed of the sampling seeds of requests that bring none")
    num_threads: int | None = setting(
        None,
        "torch threads",
        flags="--threads",
        bound="positive",
        default_text="every core torch sees",
    )
    # A request's grammar that takes longer to compile fails (HTTP 400), not the engine.
    grammar_compile_timeout_s: float = setting(
        10.0, "seconds a request's grammar may take to compile", bound="positive"
    )
    # Bitwise-identical logits whatever the batch (layers/batch_invariant.py).
    batch_invariant: bool = setting(
        False,
        "bitwise-identical logits for a request whatever its batch, neighbours and prefill "
        "chunking, at a throughput cost",
        flags="--batch-invariant",
        bool_flag="on",
        env="DEEPWELL_BATCH_INVARIANT",
        env_parse=env.parse_flag,
    )
    # DeepInfer's DEEPINFER_USE_NEXTN_DECODE (spec/deepinfer.md §1.4), mirrored.
    num_speculative_tokens: int = setting(
        5,
        "draft tokens verified losslessly per request and step; 0 turns speculative decoding off",
        flags="--num-speculative-tokens",
        bound="non-negative",
        env="DEEPWELL_USE_NEXTN_DECODE",
        env_parse=env.parse_int,
    )
    speculative_method: str | None = setting(
        None,
        "drafter: n-gram prompt lookup, or DeepSeek-V4.1's DSpark stages",
        flags="--speculative-method",
        choices=SPECULATIVE_METHODS,
        default_text="dspark when the checkpoint has them (`mtp.*`), else ngram",
    )
    # DeepInfer's DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE (spec/deepinfer.md §1.4).
    dspark_confidence_temperature: tuple[float, ...] = setting(
        (1.0,),
        "temperature of DSpark's confidence head, one for all positions or one per position",
        env="DEEPWELL_DFLASH_CONFIDENCE_HEAD_TEMPERATURE",
        env_parse=env.parse_floats,
    )
    # core.py; outputs are the same either way. Auto follows the quiet-machine measurement
    # (docs/benchmarks.md, "asynchronous scheduling with DSpark"): one torch thread only.
    async_scheduling: bool | None = setting(
        None,
        "schedule step N+1 and hand back step N's tokens while step N+1 computes (outputs are "
        "the same); --no-async-scheduling runs the step loop synchronously; a step that "
        "verifies drafts always finishes before the next is planned",
        flags="--async-scheduling",
        bool_flag="both",
        env="DEEPWELL_ZERO_OVERHEAD_SCHEDULING",
        env_parse=env.parse_flag,
        default_text="auto: on with one torch thread, off with more",
    )
    # DeepSeek-V4.1 SWA bounded replay (kv/replay.py; DeepInfer's
    # DEEPINFER_YOCO_PREFILL_* switches, spec/deepinfer.md §1.4, §1.6).
    yoco_prefill_truncation_mode: str = setting(
        "off",
        "DeepSeek-V4.1 SWA bounded replay: off (every layer over every position, exact), mask "
        "or compact (the YOCO consumer layers' window sees only the last "
        "--yoco-prefill-keep-tokens prompt positions; compact also skips their rows before)",
        flags="--yoco-prefill-truncation-mode",
        choices=YOCO_TRUNCATION_MODES,
        env="DEEPWELL_YOCO_PREFILL_TRUNCATION_MODE",
        env_parse=env.parse_text,
    )
    # 140 is DeepInfer's README keep (window 128 + backtracking 6, and margin).
    yoco_prefill_keep_tokens: int = setting(
        140,
        "prompt positions the consumer layers keep in mask/compact mode; at least the window "
        "plus the backtracking rows",
        flags="--yoco-prefill-keep-tokens",
        bound="positive",
        env="DEEPWELL_YOCO_PREFILL_KEEP_TOKENS",
        env_parse=env.parse_int,
    )
    # Mirror context parallelism (parallel/context.py; docs/parallel.md).
    context_parallel_size: int = setting(
        1,
        "DeepSeek-V4.1: processes on this machine that share each long prefill (mirror "
        "context parallelism over torch.distributed/gloo); rank 0 decodes; 1 is off",
        flags="--context-parallel-size",
    )
    context_parallel_min_tokens: int | None = setting(
        None,
        "prefills from the prompt start of at least this many tokens run across the "
        "context-parallel ranks, shorter ones on rank 0",
        flags="--context-parallel-min-tokens",
        default_text="twice the model's sliding window",
    )
    block_size: int = setting(
        BLOCK_SIZE,
        "KV block size in tokens",
        group="KV cache",
        flags="--block-size",
        bound="positive",
    )
    # Fixes the number of KV blocks instead of deriving it from memory_gib (tests, tuning).
    num_kv_blocks: int | None = setting(
        None,
        "KV blocks to allocate, instead of as many as the memory budget leaves (tests, "
        "tuning, memory-pressure benchmarks)",
        group="KV cache",
        flags="--num-kv-blocks",
        bound="positive",
        default_text="from --memory-gib",
    )
    enable_prefix_caching: bool = setting(
        True,
        "reuse cached KV blocks of a common prompt prefix; --no-enable-prefix-caching (or "
        "--no-prefix-caching) computes every prompt in full",
        group="KV cache",
        flags=("--enable-prefix-caching", "--prefix-caching"),
        bool_flag="both",
    )
    # DeepSeek-V4.1's trained cache formats (spec/deepseek_v41.md §3.7).
    quantize_kv_cache: bool = setting(
        True,
        "DeepSeek-V4.1 keeps its caches in the formats it was trained with (fp8 window KV, "
        "fp4 compressed KV and index keys); --no-kv-cache-quantization keeps them in the "
        "engine dtype, for exact comparisons with a reference",
        group="KV cache",
        flags="--no-kv-cache-quantization",
        bool_flag="off",
    )
    kv_store_path: str | None = setting(
        None,
        "directory of KV block files shared by workers, e.g. on 3FS or NFS",
        group="KV cache",
        flags="--kv-store",
        metavar="PATH",
        default_text="none, prefix blocks live in memory only",
    )
    kv_store_capacity_gib: float = setting(
        100.0,
        "size beyond which the KV store evicts the soonest-expiring blocks, in GiB",
        group="KV cache",
        flags="--kv-store-capacity-gib",
        bound="positive",
    )
    # How long a stored block outlives its last write or hit, per traffic class.
    kv_store_ttl_chat_s: float = setting(
        7 * _DAY_S,
        "how long a chat request's blocks outlive their last use: seconds, or a number with "
        "s/m/h/d",
        group="KV cache",
        flags="--kv-store-ttl-chat",
        bound="positive",
        parse=parse_duration,
        metavar="DURATION",
        default_text=in_days(7 * _DAY_S),
    )
    kv_store_ttl_agent_s: float = setting(
        3 * _DAY_S,
        "the same for agent requests (header x-deepwell-cache-class: agent)",
        group="KV cache",
        flags="--kv-store-ttl-agent",
        bound="positive",
        parse=parse_duration,
        metavar="DURATION",
        default_text=in_days(3 * _DAY_S),
    )
    # --- DeepInfer's switches, mirrored (spec/deepinfer.md §1.4; docs/switches.md) ---
    # DeepInfer's default: off (its deterministic sampling needs verify lengths that do not
    # depend on the batch, §1.6).
    enable_mtp_varlen: bool = setting(
        False,
        "speculative decoding: plan the verify lengths of a step's requests together, from "
        "their draft confidences and the measured step time (variable-length verification); "
        "off: each request verifies the length its own confidences give, whatever else runs "
        "(batch-invariant mode always does)",
        flags="--enable-mtp-varlen",
        bool_flag="both",
        env="DEEPWELL_ENABLE_MTP_VARLEN",
        env_parse=env.parse_flag,
    )
    max_backtracking_tokens: int = setting(
        0,
        "rows a sequence may roll back after a rejected draft, kept in each ring beyond its "
        "window; at least the model's own (DeepSeek-V4.1: 6, five drafts and one); drafts "
        "per step stay below it",
        bound="non-negative",
        env="DEEPWELL_MAX_BACKTRACKING_TOKENS",
        env_parse=env.parse_int,
    )
    num_state_slots_ratio: float = setting(
        1.2,
        "per-sequence state slots (rings, compressor state) = int(max_num_seqs x ratio) + 1",
        group="KV cache",
        bound="positive",
        env="DEEPWELL_NUM_STATE_SLOTS_RATIO",
        env_parse=env.parse_float,
    )
    sampler_force_topk: int = setting(
        0,
        "every token is drawn from its row's k most likely ones, whatever the request asks; "
        "0 is off",
        bound="non-negative",
        env="DEEPWELL_SAMPLER_FORCE_TOPK",
        env_parse=env.parse_int,
    )
    decode_token_blacklist: tuple[int, ...] = setting(
        (),
        "token ids never generated (comma-separated)",
        env="DEEPWELL_DECODE_TOKEN_BLACKLIST",
        env_parse=env.parse_token_ids,
    )
    prefill_max_sum_seqlen_k: int | None = setting(
        None,
        "the most key positions a step's prefill chunks may attend over together (each "
        "chunk's prompt start plus its tokens); a chunk that would pass it waits",
        bound="positive",
        env="DEEPWELL_PREFILL_MAX_SUM_SEQLEN_K",
        env_parse=env.parse_int,
        default_text="no cap",
    )
    logging_interval_step: int = setting(
        100,
        "log a line of engine statistics every N steps; 0 or less: never",
        env="DEEPWELL_LOGGING_INTERVAL_STEP",
        env_parse=env.parse_int,
    )
    compute_sum_smaller_probs: bool = setting(
        False,
        "every new token also carries the sum of the probabilities at most its own, under the "
        "distribution it was chosen from (RequestOutput.new_sum_smaller_probs)",
        env="DEEPWELL_COMPUTE_SUM_SMALLER_PROBS",
        env_parse=env.parse_flag,
    )
    # Test overrides of DeepSeek-V4.1's MoE routing, for EPLB (layers/forced_routing.py).
    force_load_balance: bool = setting(
        False,
        "testing: every MoE layer routes a step's rows to the experts in turn, each expert "
        "an equal share, whatever the router scores",
        env="DEEPWELL_FORCE_LOAD_BALANCE",
        env_parse=env.parse_flag,
    )
    force_imbalance_ratio: float = setting(
        0.0,
        "testing: every MoE layer gives its last expert this many times the mean expert's "
        "share of a step's rows, the others the rest evenly; 0 is off, else at least 1.0",
        bound="non-negative",
        env="DEEPWELL_FORCE_IMBALANCE_RATIO",
        env_parse=env.parse_float,
    )
    # DeepInfer's offline EngineArgs (spec/deepinfer.md §1.3) that mean something here; the
    # rest of its keywords are mapped by engine/deepinfer_args.py.
    load_format: str = setting(
        "auto",
        "auto: the checkpoint's weights; dummy: DeepSeek-V4.1 weights drawn at random in the "
        "checkpoint's shapes and encodings from config.json alone (benchmarks; outputs are noise)",
        group="model",
        flags="--load-format",
        choices=LOAD_FORMATS,
    )
    chunked_prefill: bool = setting(
        True,
        "split a long prompt over several steps' token budgets; --no-chunked-prefill admits "
        "a prompt only whole (max_num_batched_tokens must then hold max_model_len)",
        flags="--no-chunked-prefill",
        bool_flag="off",
    )
    # Reliability (issue 32): the step loop's watchdog (engine/watchdog.py).
    stuck_request_timeout_s: float = setting(
        300.0,
        "seconds a running request may go without being scheduled before the watchdog ends "
        "it with an error (logged; its KV blocks freed); 0: never",
        flags="--stuck-request-timeout",
        bound="non-negative",
        metavar="SECONDS",
        env="DEEPWELL_STUCK_REQUEST_TIMEOUT",
        env_parse=env.parse_float,
    )
    # Attention data parallelism, MoE expert parallelism and EPLB over torch.distributed
    # (parallel/); one rank per EngineCore. Its flags come from its own declaration.
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        # Sent between processes as a list (messages.py).
        self.dspark_confidence_temperature = tuple(self.dspark_confidence_temperature)
        self.decode_token_blacklist = tuple(self.decode_token_blacklist)
        check_settings(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.quantization == "int4" and self.batch_invariant:
            # A row's bits would change with the call's row count (4-bit blocks below a
            # few rows, the dense weights above).
            raise ValueError("int4 quantization cannot run batch-invariant")
        if (
            not self.chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must hold a whole prompt of max_model_len ({self.max_model_len}) tokens"
            )
        if self.kv_store_path is not None and not self.enable_prefix_caching:
            raise ValueError("kv_store_path needs enable_prefix_caching")
        if self.batch_invariant and self.yoco_prefill_truncation_mode == "compact":
            # Its consumer layers run only some of a step's rows, which the row tiles of
            # batch-invariant mode do not cover; mask mode computes the same function.
            raise ValueError(
                "batch_invariant does not combine with yoco_prefill_truncation_mode "
                "'compact'; use 'mask', which gives the same tokens"
            )
        if not self.dspark_confidence_temperature or any(
            t <= 0 for t in self.dspark_confidence_temperature
        ):
            raise ValueError(
                "dspark_confidence_temperature must be positive, got "
                f"{self.dspark_confidence_temperature}"
            )
        if self.parallel.expert_parallel:
            # The ranks' steps meet in every MoE layer's all-to-all, so every rank runs every
            # MoE layer once per step: no separate drafter forward, no early exit.
            if self.speculative_method == "dspark":
                raise ValueError(
                    "DSpark drafting runs its own MoE stages outside the ranks' lock step; "
                    "with expert parallelism use --speculative-method ngram"
                )
            if self.yoco_prefill_truncation_mode == "compact":
                raise ValueError(
                    "compact bounded replay can skip a step's last layers, which expert-parallel "
                    "ranks must all run; use yoco_prefill_truncation_mode 'mask'"
                )
        self._check_forced_routing()
        self._check_context_parallel()

    def _check_forced_routing(self) -> None:
        if 0 < self.force_imbalance_ratio < 1:
            raise ValueError(
                "force_imbalance_ratio (DEEPWELL_FORCE_IMBALANCE_RATIO) is 0 (off) or at least "
                f"1.0, got {self.force_imbalance_ratio}"
            )
        if self.force_imbalance_ratio and self.force_load_balance:
            raise ValueError(
                "DEEPWELL_FORCE_LOAD_BALANCE and DEEPWELL_FORCE_IMBALANCE_RATIO force opposite "
                "routings; set one"
            )

    def _check_context_parallel(self) -> None:
        if self.context_parallel_size < 1:
            raise ValueError(
                f"context_parallel_size must be >= 1, got {self.context_parallel_size}"
            )
        if self.context_parallel_min_tokens is not None and self.context_parallel_min_tokens < 1:
            raise ValueError(
                "context_parallel_min_tokens must be positive, got "
                f"{self.context_parallel_min_tokens}"
            )
        if self.context_parallel_size == 1:
            return
        # CP spawns its own group from rank 0; it does not yet nest inside a DP/EP group.
        if self.parallel.data_parallel_size > 1 or self.parallel.expert_parallel:
            raise ValueError(
                "context parallelism does not combine with data or expert parallelism yet; "
                "use --context-parallel-size alone, or --data-parallel-size/--expert-parallel "
                "alone (docs/parallel.md)"
            )
        # The parallel prefill runs every layer over every position (docs/parallel.md).
        if self.yoco_prefill_truncation_mode != "off":
            raise ValueError(
                "context parallelism needs yoco_prefill_truncation_mode 'off', got "
                f"{self.yoco_prefill_truncation_mode!r}"
            )

    @property
    def dtype_choice(self) -> DtypeChoice:
        """What `dtype` resolves to on this machine, and why (a property, not a field, so
        `vars(args)` stays the constructor's keywords)."""
        return select_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here: building and checking the settings needs no torch

        return getattr(torch, self.dtype_choice.dtype)

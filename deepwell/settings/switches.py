"""DeepInfer's DEEPINFER_* switches (spec/deepinfer.md §1.4) against deepwell's DEEPWELL_*
registry: each is mirrored under the same suffix, or listed with the reason it is not.
`deepwell switches` renders docs/switches.md from here and the registry.
"""

from __future__ import annotations

from deepwell.settings import environment

PREFIX = "DEEPINFER_"
# spec/deepinfer.md §1.4, in its order. None: mirrored as DEEPWELL_<same suffix>, with the
# same type, default and reading; else why deepwell has none.
DEEPINFER_SWITCHES: dict[str, str | None] = {
    "DEEPINFER_ACCELERATOR": "one code path for every device; `--device` picks cpu or cuda",
    "DEEPINFER_COMPUTE_SUM_SMALLER_PROBS": None,
    "DEEPINFER_JIT_CACHE_DIR": (
        "no TileLang / DeepGEMM / DeepEP JIT; the C++ kernels cache under torch's "
        "TORCH_EXTENSIONS_DIR"
    ),
    "DEEPINFER_NCCL_NUM_SMS": "GPU streaming multiprocessors: none on a CPU, no NCCL",
    "DEEPINFER_USERBUFFER_COMM_SMS": "GPU streaming multiprocessors for DeepEP: none here",
    "DEEPINFER_GLOO_TIMEOUT": None,
    "DEEPINFER_REARRANGE_P2P_GROUPS": (
        "EPLB sends each moved expert's weights point to point over gloo, without buckets"
    ),
    "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": None,
    "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": None,
    "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": None,
    "DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE": (
        "one engine kind: EPLB re-places at any step boundary of the lock step"
    ),
    "DEEPINFER_MOE_LB_STAT_INTERVAL": (
        "no moe_lb column in the stats line: expert loads are counted only under EPLB, which "
        "logs each re-placement's max/mean rank load before and after (parallel/eplb.py)"
    ),
    "DEEPINFER_FORCE_IMBALANCE_RATIO": None,
    "DEEPINFER_FORCE_LOAD_BALANCE": None,
    "DEEPINFER_SHOW_EPLB_DETAIL": "EPLB logs every re-placement at INFO already",
    "DEEPINFER_PREFILL_MAX_SUM_SEQLEN_K": None,
    "DEEPINFER_INDEX_ATTN_MEMORY_LIMIT": (
        "GPU workspace limit; the CPU indexer works in the step's own tensors"
    ),
    "DEEPINFER_USE_NEXTN_DECODE": None,
    "DEEPINFER_ENABLE_MTP_VARLEN": None,
    "DEEPINFER_MAX_BACKTRACKING_TOKENS": None,
    "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE": None,
    "DEEPINFER_ENGRAM_PAD_TOKEN": "the pad id comes from the checkpoint's Engram config",
    "DEEPINFER_ENGRAM_FORCE_GPU_STORAGE": "Engram tables live in host memory, the only memory",
    "DEEPINFER_SAMPLER_FORCE_TOPK": None,
    "DEEPINFER_DECODE_TOKEN_BLACKLIST": None,
    "DEEPINFER_ENFORCE_EAGER": None,
    "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL": (
        "decode graphs are captured at 1, 2, 4 and every 8 up to --max-num-seqs "
        "(engine/decode_graphs.py), DeepInfer's grid step fixed"
    ),
    "DEEPINFER_DFLASH_ENFORCE_EAGER": (
        "drafts run eagerly: only single-token decode steps are replayed from graphs"
    ),
    "DEEPINFER_DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL": "no draft graphs (above)",
    "DEEPINFER_DECODE_PERF_CACHE_DIR": (
        "the step-time curve is measured online (speculative/step_time.py), never cached"
    ),
    "DEEPINFER_DECODE_PERF_CACHE_TTL_SEC": "no cached step-time curve (above)",
    "DEEPINFER_NUM_STATE_SLOTS_RATIO": None,
    "DEEPINFER_PREFILL_STORE_EXTRA_STATE": (
        "ring snapshots at block boundaries (kv/snapshots.py) give multi-turn hits instead"
    ),
    "DEEPINFER_PREFILL_STORE_EXTRA_SIZE": "ring snapshots instead (above)",
    "DEEPINFER_XGRAMMAR_DEBUG": "grammars compile with llguidance, not xgrammar",
    "DEEPINFER_XGRAMMAR_TIMEOUT": (
        "llguidance, not xgrammar; EngineArgs.grammar_compile_timeout_s bounds a compile"
    ),
    "DEEPINFER_XGRAMMAR_DISABLE_CACHE": "llguidance, not xgrammar; the compiler keeps an LRU",
    "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES": "llguidance, not xgrammar; an LRU of 256 grammars",
    "DEEPINFER_SO_BUILDER_CPUS": "grammars compile on one thread beside the step loop",
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": (
        "no NORMAL/PROMPT engine split: every step mixes prefill and decode"
    ),
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "no prefill votes across DP ranks (above)",
    "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": None,
    "DEEPINFER_LOGGING_INTERVAL_STEP": None,
    "DEEPINFER_NCCL_MEMORY_SAMPLE_INTERVAL_STEPS": "no NCCL: ranks talk over gloo",
    "DEEPINFER_RINGBUFFER_WARNING_INTERVAL": "no DeepEP ring buffer",
    "DEEPINFER_GC_INTERVAL_STEP": "Python's own garbage collection runs unchanged",
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": None,
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": None,
    "DEEPINFER_BATCH_INVARIANT": None,
    "DEEPINFER_DISABLE_SYNC_GUARD": "no CPU-GPU sync guard on a CPU",
    "DEEPINFER_PROFILE_TORCH_CUDA_MEMORY": "CUDA memory profiling",
    "DEEPINFER_ENABLE_MEMORY_TRACING": "CUDA memory tracing",
    "DEEPINFER_PROFILE_HTTP_ENABLE": "no per-engine profiling server; serve has /metrics",
    "DEEPINFER_PROFILE_HTTP_PORT_BASE": "no profiling server (above)",
    "DEEPINFER_TORCH_PROFILER_DIR": "no built-in torch profiler hook",
    "DEEPINFER_USE_MULTIMODAL_POOL": None,
    "DEEPINFER_MULTIMODAL_POOL_SIZE_GB": (
        "the pool is sized in processes, DEEPWELL_MULTIMODAL_POOL_SIZE (default 2), not GB"
    ),
    "DEEPINFER_MULTI_MODAL_BUFFER_SIZE": (
        "images travel to the pool as bytes and back as arrays, no shared buffer to size"
    ),
    "DEEPINFER_MULTI_MODAL_WORKER_TIMEOUT": (
        "an image's fetch has --media-fetch-timeout; its decoding is bounded by the pixel limit"
    ),
    "DEEPINFER_CPP_LOG_LEVEL": "no C++ logging: the kernels do not log",
    "DEEPINFER_FUSED_SAMPLE_STRESS_TEST": "DeepInfer's own kernel tests",
    "DEEPINFER_FUSED_SAMPLE_DETAIL_LOG": "DeepInfer's own kernel tests",
    "DEEPINFER_HF_MODEL_DIR": "examples only; `--model` takes a local directory",
}

_KINDS = {
    environment.parse_flag: "bool",
    environment.parse_int: "int",
    environment.parse_float: "float",
    environment.parse_floats: "float or comma list",
    environment.parse_token_ids: "comma-separated ids",
    environment.parse_text: "str",
}


def twin(deepinfer_name: str) -> str:
    return "DEEPWELL_" + deepinfer_name.removeprefix(PREFIX)


def _default(variable: environment.EnvVar) -> str:
    value = variable.default
    if variable.default_text is not None:
        return variable.default_text
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or '""'
    return f"{value:g}" if isinstance(value, float) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """docs/switches.md: DeepInfer's switches, then deepwell's own, then other tools'; of
    the variables registered so far (`deepwell switches` first imports every module that
    declares some: settings/engine.py, serve/settings.py)."""
    registry = environment.registered()
    lines = [
        "# Environment switches",
        "",
        "Generated by `deepwell switches > docs/switches.md` from the",
        "registry (`deepwell/settings/environment.py`) and `deepwell/settings/switches.py`;",
        "tests/settings/test_switches.py fails when this file is stale. Switches read as",
        'DeepInfer reads them: a bool is on unless "0", "", "false" or "False"; an unset or',
        "(for a number or text) empty variable leaves the default. A flag, where the",
        "setting has one, wins over its variable.",
        "",
        "## DeepInfer's switches (spec/deepinfer.md §1.4)",
        "",
        "| DeepInfer | deepwell | type | default | what it sets here, or why there is none |",
        "|---|---|---|---|---|",
    ]
    for name, reason in DEEPINFER_SWITCHES.items():
        variable = registry.get(twin(name))
        if variable is None:
            lines.append(f"| `{name}` | none | | | {_cell(reason or '')} |")
            continue
        kind = _KINDS.get(variable.parse, "str")
        lines.append(
            f"| `{name}` | `{variable.name}` | {kind} | {_default(variable)} | "
            f"{_cell(variable.sets)} |"
        )
    mirrored = {twin(name) for name in DEEPINFER_SWITCHES}
    lines += [
        "",
        "## deepwell's own",
        "",
        "| variable | type | default | what it sets |",
        "|---|---|---|---|",
    ]
    for name in sorted(set(registry) - mirrored):
        variable = registry[name]
        kind = _KINDS.get(variable.parse, "str")
        lines.append(f"| `{name}` | {kind} | {_default(variable)} | {_cell(variable.sets)} |")
    lines += [
        "",
        "## Other tools' variables deepwell reads",
        "",
        "| variable | whose, and what for |",
        "|---|---|",
    ]
    for name, owner in sorted(environment.foreign().items()):
        lines.append(f"| `{name}` | {_cell(owner)} |")
    return "\n".join(lines) + "\n"

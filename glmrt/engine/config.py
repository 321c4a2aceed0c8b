"""Engine options (the `[engine]` table of a topology, and the engine flags of `glmrt up`). No torch.

Every field has a docstring and, where it has one, its bound declared beside it
(glmrt.config_bounds); `glmrt up` names each field `--field-name` on its command line.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from glmrt.config_bounds import ConfigValueError, bounded, check_fields


ENGINE_ROLES = ("unified", "prefill", "decode")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")

_BACKEND_OPTIONS = ("backend", "kv_cache_dtype", "quantization", "attention_backend", "dsa_prefill_backend",
                    "dsa_decode_backend", "moe_runner_backend", "linear_attn_backend", "speculative_algorithm")

# SGLang's spellings of chain drafting from the checkpoint's own MTP (NextN) layer
EAGLE_SPELLINGS = ("EAGLE", "NEXTN", "MTP")
SPEC_ALGORITHMS = ("none", *EAGLE_SPELLINGS)
SPEC_MAX_STEPS = 16


@dataclass(frozen=True)
class EngineConfig:
    """One engine's options, valid once constructed (`check_fields` runs in `__post_init__`, and
    `glmrt up` runs it over the whole topology before any actor starts). Values an engine finds at
    runtime (the resolved device, the memory plan, the context length) live on the engine, never
    back in here."""

    model: str | None = None
    """Checkpoint directory (HF format). None with load_format='dummy' builds `preset`."""
    preset: str | None = None
    """A preset model (glmrt.checkpoint.presets; None: tiny) built with random weights when `model` is None."""
    load_format: str = bounded("auto", choices=LOAD_FORMATS)
    """auto (safetensors) | dummy (random weights in device memory, no files)."""
    quantization: str | None = None
    """None: the checkpoint's format. fp8 with load_format='dummy' quantises the linear layers
    (block-scaled e4m3). mxfp4 / nvfp4 checkpoints load dequantised to the model dtype."""
    dtype: str = bounded("auto", choices=MODEL_DTYPES)
    """auto: bfloat16 on a GPU, float32 on the CPU."""
    device: str = "auto"
    """auto (cuda when torch sees a GPU, else cpu) | cpu | cuda | cuda:N."""
    backend: str = "auto"
    """auto | reference | cuda-h200 | cuda-blackwell | rocm-mi355x (backends/adapters.py: the table)."""
    kv_cache_dtype: str = "auto"
    """auto (bfloat16 on cuda-h200, fp8_e4m3 on cuda-blackwell / rocm-mi355x, the model dtype on the
    reference) | bfloat16 | fp8_e4m3 | the model dtype."""
    attention_backend: str = "auto"
    """auto | dsa (SGLang's spelling): GLM-5.3-Flash attention is DSA (MLA layers) + KDA."""
    dsa_prefill_backend: str = "auto"
    """auto | triton (the CUDA/ROCm kernel sets) | torch. TileLang / TRT-LLM / FlashMLA are refused:
    glmrt does not ship them."""
    dsa_decode_backend: str = "auto"
    """auto | triton (the CUDA/ROCm kernel sets) | torch (the reference)."""
    moe_runner_backend: str = "auto"
    """auto | triton (the CUDA/ROCm kernel sets) | torch (the reference). flashinfer_trtllm, deep_gemm,
    ... are refused: glmrt does not ship them."""
    linear_attn_backend: str = "auto"
    """KDA: auto | triton (the CUDA/ROCm kernel sets) | torch (the reference)."""
    mamba_ssm_dtype: str = bounded("float32", choices=("float32", "bfloat16"))
    """KDA recurrent state dtype: float32 or bfloat16."""
    fp8_activations: str = bounded("auto", choices=("auto", "dynamic", "none"))
    """FP8 (block-scaled) weights: auto (dynamic on the Triton kernel sets, none on the reference) |
    dynamic (w8a8: activations quantised to e4m3 per token and 128-wide K block, fp8 tensor-core
    products; DeepSeek-V3's and SGLang's recipe) | none (w8a16: activations stay in the model dtype,
    the reference's and transformers' numerics)."""
    mem_fraction_static: float = bounded(0.85, gt=0, lt=1)
    """GPU: fraction of the free memory after weights given to the two cache pools."""
    cache_memory_gb: float = bounded(0.25, gt=0)
    """CPU: absolute cache budget (small, so several engines fit on one test machine)."""
    mamba_full_memory_ratio: float = bounded(0.9, gt=0)
    """state : KV bytes. The state pool gets r / (1 + r) of the budget."""
    max_mamba_cache_size: int | None = bounded(None, ge=1)
    """Pin the number of state slots instead of using the ratio."""
    max_running_requests: int | None = bounded(None, ge=1)
    """Most requests decoding at once (None: 256, clamped to what the state slots allow)."""
    chunked_prefill_size: int = bounded(8192, ge=1)
    """Most prompt tokens of one request computed in one step (longer prompts are chunked)."""
    max_prefill_tokens: int = bounded(16384, ge=1)
    """Most prompt tokens of all requests together in one step."""
    max_num_batched_tokens: int | None = bounded(None, ge=1)
    """Most tokens one forward computes (vLLM's knob; None: no cap beyond max_prefill_tokens).
    Running decodes are counted first (1 + their draft tokens when speculating) and never dropped
    for it; prefill chunks and admissions get what is left, at most max_prefill_tokens. A step
    whose decodes leave nothing runs no prefill; the step after one that ran none while a prefill
    waited gives prefills at least min(N, chunked_prefill_size) tokens (never past max_prefill_tokens),
    so a prefill waits one step at most. At least max_running_requests when that is set, and
    speculative_num_steps + 1 when speculating. Smaller: a steadier decode step time beside long
    prompts, a slower time to first token."""
    schedule_policy: str = bounded("fcfs", choices=("fcfs", "lpm"))
    """fcfs | lpm (longest cached prefix first)."""
    state_checkpoint_interval: int = bounded(8192, ge=0)
    """Save KDA state into the prefix cache every N prompt tokens, besides the prompt end, the
    request end and divergence points (0: only those). A prompt diverging inside a cached prefix
    resumes at the nearest checkpoint before it, so N bounds the prefill recomputed there; each
    checkpoint is a state slot (141 MiB at full size, the KV of ~13K tokens), evicted first when
    memory is short. The default is the chunk size: a checkpoint per full chunk, no chunk split
    (docs/MODEL.md §8.4)."""
    disable_radix_cache: bool = False
    """Reuse no prompt prefix between requests."""
    enable_hierarchical_cache: bool = False
    """A host-memory tier behind the prefix cache: nodes evicted from the device pools move to
    the host while it has room, and a hit on one loads it back (glmrt/cache/host_tier.py)."""
    hicache_ratio: float = bounded(2.0, gt=0)
    """Host tier size as a multiple of the device cache pools (KV + state) in bytes, per rank."""
    hicache_size: float = bounded(0.0, ge=0)
    """Host tier size in GB per rank: each rank of an engine holds its own shard of the cached
    nodes (0: use hicache_ratio; when both are given, the size wins)."""
    hicache_write_policy: str = bounded("write_through", choices=("write_through", "write_back"))
    """write_through: copy what the prefix cache holds to the host at once (a later eviction
    costs no copy) | write_back: copy only on eviction."""
    hicache_storage_dir: str | None = None
    """A third tier on local disk under this directory: what the host tier drops is written
    there, and a later prompt with that prefix reads it back (glmrt/cache/disk_tier.py). An
    engine of several ranks keeps one directory per rank under it (rank0, rank1, ...)."""
    hicache_storage_size: float = bounded(16.0, gt=0)
    """The disk tier's size in GB (least recently used files are removed past it); per rank."""
    page_size: int = bounded(64, ge=1)
    """Tokens per KV page (a prefix is shared in whole pages)."""
    seed: int = 0
    """Seed of the random weights (load_format='dummy')."""
    context_length: int | None = bounded(None, ge=1)
    """Longest prompt + output in tokens (None: the model's max_position_embeddings); the KV pool
    may allow fewer."""
    load_vision: bool = True
    """Load the vision tower in the engine (False when a separate vision actor runs it)."""
    disable_cuda_graph: bool = False
    """Run decode eagerly (graphs are used only where the kernel set is graph-safe, on CUDA)."""
    cuda_graph_max_bs: int | None = bounded(None, ge=1)
    """Largest decode batch replayed from a graph (default: max_running_requests, at most 256)."""
    cuda_graph_warmup_tokens: int = bounded(4096, ge=0)
    """Capture the decode graphs of every batch bucket for contexts up to this many tokens at
    start (0: capture each on first use, which stalls the batch that needs it)."""
    skip_server_warmup: bool = False
    """Skip running the prefill shapes once at start on the GPU (each Triton kernel variant
    then compiles on first use, stalling the requests running at that moment)."""
    disable_overlap_schedule: bool = False
    """Schedule step N+1 only after step N's tokens are on the host (no CPU/GPU overlap)."""
    speculative_algorithm: str = "none"
    """none | EAGLE (NEXTN and MTP are the same): each decode step, the checkpoint's MTP layer drafts
    `speculative_num_steps` tokens per request one after another and the model verifies them all in
    one forward, keeping the longest prefix it agrees with plus its own next token (sampled requests:
    rejection sampling, so the model's distribution). Requests with a grammar decode one token per
    step. A prefill and a decode engine must agree on it. DFlash2 and tree drafting are not built."""
    speculative_num_steps: int | None = bounded(None, ge=1, lt=SPEC_MAX_STEPS + 1)
    """Tokens the MTP layer drafts per request and step (default 3 with --speculative-algorithm)."""
    speculative_eagle_topk: int = bounded(1, ge=1)
    """Draft branches per step: 1 (a chain); tree drafting (> 1) is not built."""
    speculative_num_draft_tokens: int | None = bounded(None, ge=1)
    """Tokens verified per request and step: with a chain, speculative_num_steps + 1 (the default)."""
    role: str = bounded("unified", choices=ENGINE_ROLES)
    """unified | prefill (computes prompts, hands the state over after the first token) |
    decode (receives handed-over requests and continues them)."""

    def __post_init__(self):
        check_fields(self)
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigValueError("device", self.device, "must be auto, cpu, cuda or cuda:N")
        self._check_speculative()
        self._check_batched_tokens()
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigValueError("enable_hierarchical_cache", True, "needs the prefix cache, which "
                                   "disable_radix_cache turns off")
        if not self.enable_hierarchical_cache:
            for name, default in (("hicache_ratio", 2.0), ("hicache_size", 0.0),
                                  ("hicache_write_policy", "write_through"), ("hicache_storage_dir", None)):
                if getattr(self, name) != default:
                    raise ConfigValueError(name, getattr(self, name), "is set only with the host tier on (enable_hierarchical_cache, --enable-hierarchical-cache)")
        if self.hicache_storage_dir is None and self.hicache_storage_size != 16.0:
            raise ConfigValueError("hicache_storage_size", self.hicache_storage_size,
                                   "is set only with a disk tier (hicache_storage_dir, --hicache-storage-dir)")

    def _check_batched_tokens(self) -> None:
        """A token budget a full decode batch (vLLM's rule), or one drafting decode, uses up by itself
        would run prompts only every other step, through the starvation rule: refused."""
        n = self.max_num_batched_tokens
        if n is None:
            return
        if self.max_running_requests is not None and n < self.max_running_requests:
            raise ConfigValueError("max_num_batched_tokens", n, f"must be >= max_running_requests "
                                   f"({self.max_running_requests}): a full decode batch alone would use it up")
        if self.speculative_steps and n < self.speculative_steps + 1:
            raise ConfigValueError("max_num_batched_tokens", n, f"must be >= speculative_num_steps + 1 "
                                   f"({self.speculative_steps + 1}): one drafting decode alone would use it up")

    def _check_speculative(self) -> None:
        algo = str(self.speculative_algorithm)
        canon = "none" if algo.lower() in ("none", "off") else algo.upper()
        if canon in ("DFLASH", "DFLASH2"):
            raise ConfigValueError("speculative_algorithm", self.speculative_algorithm,
                                   "is refused: DFlash2 drafting is not built (EAGLE drafts with the checkpoint's "
                                   "MTP layer)")
        if canon not in SPEC_ALGORITHMS:
            raise ConfigValueError("speculative_algorithm", self.speculative_algorithm,
                                   "must be one of none, EAGLE, NEXTN, MTP")
        object.__setattr__(self, "speculative_algorithm", "EAGLE" if canon in EAGLE_SPELLINGS else "none")
        if canon == "none":
            for name, default in (("speculative_num_steps", None), ("speculative_eagle_topk", 1),
                                  ("speculative_num_draft_tokens", None)):
                if getattr(self, name) != default:
                    raise ConfigValueError(name, getattr(self, name), "is set only with speculative_algorithm "
                                           "EAGLE (--speculative-algorithm)")
            return
        if self.speculative_eagle_topk > 1:
            raise ConfigValueError("speculative_eagle_topk", self.speculative_eagle_topk,
                                   "is refused: tree drafting is not supported (use 1: a chain)")
        if self.speculative_num_steps is None:
            object.__setattr__(self, "speculative_num_steps", 3)
        want = self.speculative_num_steps + 1
        if self.speculative_num_draft_tokens is None:
            object.__setattr__(self, "speculative_num_draft_tokens", want)
        elif self.speculative_num_draft_tokens != want:
            raise ConfigValueError("speculative_num_draft_tokens", self.speculative_num_draft_tokens,
                                   f"must be speculative_num_steps + 1 = {want} with a chain (topk 1)")

    @property
    def speculative_steps(self) -> int:
        """Draft tokens per request and step (0: no speculation)."""
        return self.speculative_num_steps if self.speculative_algorithm == "EAGLE" else 0

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, device: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.startswith("cuda") else "float32"

    def backend_request(self) -> dict[str, str | None]:
        """The options `backends.adapters.resolve_options` checks and fills."""
        return {k: getattr(self, k) for k in _BACKEND_OPTIONS}

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

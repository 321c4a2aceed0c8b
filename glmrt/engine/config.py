"""Engine options (the `[engine]` table of a topology, and the engine flags of `glmrt up`). No torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


_BACKEND_OPTIONS = ("backend", "kv_cache_dtype", "quantization", "attention_backend", "dsa_prefill_backend",
                    "dsa_decode_backend", "moe_runner_backend", "linear_attn_backend")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """Checkpoint directory (HF format). None with load_format='dummy' builds `preset`."""
    preset: str | None = None
    load_format: str = "auto"
    """auto (safetensors) | dummy (random weights in device memory, no files)."""
    quantization: str | None = None
    """None: the checkpoint's format. fp8 with load_format='dummy' quantises the linear layers
    (block-scaled e4m3). mxfp4 / nvfp4 are refused until the loader reads them."""
    dtype: str = "auto"
    """auto: bfloat16 on a GPU, float32 on the CPU."""
    device: str = "auto"
    backend: str = "auto"
    """auto | reference | cuda-h200 | cuda-blackwell | rocm-mi355x (backends/adapters.py: the table)."""
    kv_cache_dtype: str = "auto"
    """auto (bfloat16 on cuda-h200, fp8_e4m3 on cuda-blackwell / rocm-mi355x, the model dtype on the
    reference) | bfloat16 | fp8_e4m3 | the model dtype."""
    attention_backend: str = "auto"
    """auto | dsa (SGLang's spelling): GLM-5.3-Flash attention is DSA (MLA layers) + KDA."""
    dsa_prefill_backend: str = "auto"
    """auto | torch. TileLang / TRT-LLM / FlashMLA are refused: glmrt does not ship them."""
    dsa_decode_backend: str = "auto"
    """auto | triton (the CUDA/ROCm kernel sets) | torch (the reference)."""
    moe_runner_backend: str = "auto"
    """auto | triton (the CUDA/ROCm kernel sets) | torch (the reference). flashinfer_trtllm, deep_gemm,
    ... are refused: glmrt does not ship them."""
    linear_attn_backend: str = "auto"
    """KDA: auto | triton (the CUDA/ROCm kernel sets) | torch (the reference)."""
    mamba_ssm_dtype: str = "float32"
    """KDA recurrent state dtype: float32 or bfloat16."""
    fp8_activations: str = "auto"
    """FP8 (block-scaled) weights: auto (dynamic on the Triton kernel sets, none on the reference) |
    dynamic (w8a8: activations quantised to e4m3 per token and 128-wide K block, fp8 tensor-core
    products; DeepSeek-V3's and SGLang's recipe) | none (w8a16: activations stay in the model dtype,
    the reference's and transformers' numerics)."""
    mem_fraction_static: float = 0.85
    """GPU: fraction of the free memory after weights given to the two cache pools."""
    cache_memory_gb: float = 0.25
    """CPU: absolute cache budget (small, so several engines fit on one test machine)."""
    mamba_full_memory_ratio: float = 0.9
    """state : KV bytes. The state pool gets r / (1 + r) of the budget."""
    max_mamba_cache_size: int | None = None
    """Pin the number of state slots instead of using the ratio."""
    max_running_requests: int | None = None
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    """fcfs | lpm (longest cached prefix first)."""
    state_checkpoint_interval: int = 0
    """Save KDA state into the prefix cache every N prompt tokens (0 = only at prompt end,
    request end and divergence points)."""
    disable_radix_cache: bool = False
    page_size: int = 64
    seed: int = 0
    context_length: int | None = None
    load_vision: bool = True
    """Load the vision tower in the engine (False when a separate vision actor runs it)."""
    disable_cuda_graph: bool = False
    """Run decode eagerly (graphs are used only where the kernel set is graph-safe, on CUDA)."""
    cuda_graph_max_bs: int | None = None
    """Largest decode batch replayed from a graph (default: max_running_requests, at most 256)."""
    cuda_graph_warmup_tokens: int = 4096
    """Capture the decode graphs of every batch bucket for contexts up to this many tokens at
    start (0: capture each on first use, which stalls the batch that needs it)."""
    skip_server_warmup: bool = False
    """Skip running the prefill shapes once at start on the GPU (each Triton kernel variant
    then compiles on first use, stalling the requests running at that moment)."""
    disable_overlap_schedule: bool = False
    """Schedule step N+1 only after step N's tokens are on the host (no CPU/GPU overlap)."""
    role: str = "unified"
    """unified | prefill (computes prompts, hands the state over after the first token) |
    decode (receives handed-over requests and continues them)."""

    def __post_init__(self):
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.mamba_ssm_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"mamba_ssm_dtype must be float32 or bfloat16, got {self.mamba_ssm_dtype!r}")
        if self.fp8_activations not in ("auto", "dynamic", "none"):
            raise ValueError(f"fp8_activations must be auto, dynamic or none, got {self.fp8_activations!r}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.cache_memory_gb <= 0:
            raise ValueError("cache_memory_gb must be > 0")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.role not in ("unified", "prefill", "decode"):
            raise ValueError(f"role must be unified, prefill or decode, got {self.role!r}")

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

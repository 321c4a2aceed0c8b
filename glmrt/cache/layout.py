"""What a GLM-5.3-Flash engine caches, per token and per request (docs/MODEL.md §8), as numbers.

No torch: the scheduler, `make-checkpoint --meta` and `compute-mamba-ratio` size things
from this without touching a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmrt.config import TextConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}


@dataclass(frozen=True)
class CacheLayout:
    """Shapes of the two pools. DSA ordinals include the MTP draft layer (last) when present."""

    num_dsa: int                 # DSA layers with a latent cache (incl. MTP)
    num_indexer: int             # DSA layers with their own indexer (pooled keys + tail)
    num_kda: int
    kv_lora_rank: int
    index_head_dim: int
    kpool: int
    page_size: int
    conv_dim: int                # 3 * linear_qkv_dim (of this rank's heads)
    conv_width: int              # K - 1 kept inputs
    kda_heads: int               # this rank's KDA heads
    kda_dk: int
    kda_dv: int
    kv_dtype: str = "bfloat16"
    state_dtype: str = "float32"  # --mamba-ssm-dtype
    conv_dtype: str = "bfloat16"  # the model dtype
    hidden_size: int = 0         # the kept last-position hidden state of a prompt-end checkpoint

    @classmethod
    def from_config(cls, text: TextConfig, *, page_size: int = 64, kv_dtype: str = "bfloat16",
                    state_dtype: str = "float32", model_dtype: str = "bfloat16",
                    with_mtp: bool = False, tp_size: int = 1) -> "CacheLayout":
        """The pools of one rank of a `tp_size` group: KDA is split by head (its conv channels
        and recurrent state per rank are 1 / tp_size of the model's), while the MLA latent and
        the indexer's keys are replicated, so every rank pays for them in full."""
        if page_size % text.index_kpool:
            raise ValueError(f"page_size ({page_size}) must be a multiple of index_kpool ({text.index_kpool})")
        if tp_size < 1 or text.linear_num_heads % tp_size:
            raise ValueError(f"linear_num_heads ({text.linear_num_heads}) is not divisible by {tp_size} ranks")
        extra = 1 if with_mtp else 0
        heads = text.linear_num_heads // tp_size
        return cls(len(text.dsa_layers) + extra, len(text.indexer_layers) + extra, len(text.kda_layers),
                   text.kv_lora_rank, text.index_head_dim, text.index_kpool, page_size,
                   3 * heads * text.linear_head_dim, text.linear_conv_kernel_dim - 1, heads,
                   text.linear_head_dim, text.linear_head_dim, kv_dtype, state_dtype, model_dtype, text.hidden_size)

    @property
    def pools_per_page(self) -> int:
        return self.page_size // self.kpool

    # ---- bytes ----------------------------------------------------------------------------
    @property
    def index_dtype(self) -> str:
        """Pooled indexer keys and the indexer tail: the KV dtype, except that an fp8 KV
        cache keeps them in the model dtype (only the MLA latent is fp8: backends/kv_fp8.py)."""
        return self.conv_dtype if self.kv_dtype == "fp8_e4m3" else self.kv_dtype

    @property
    def latent_row_bytes(self) -> int:
        """Bytes of one token's MLA latent; fp8 rows carry one fp32 scale per 128 values."""
        r = self.kv_lora_rank
        if self.kv_dtype == "fp8_e4m3":
            return r + 4 * -(-r // 128)
        return r * DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> float:
        return (self.num_dsa * self.latent_row_bytes
                + self.num_indexer * self.index_head_dim * DTYPE_BYTES[self.index_dtype] / self.kpool)

    @property
    def kv_bytes_per_page(self) -> int:
        return int(self.kv_bytes_per_token * self.page_size)

    @property
    def conv_bytes_per_slot(self) -> int:
        return self.num_kda * self.conv_width * self.conv_dim * DTYPE_BYTES[self.conv_dtype]

    @property
    def recurrent_bytes_per_slot(self) -> int:
        return self.num_kda * self.kda_heads * self.kda_dk * self.kda_dv * DTYPE_BYTES[self.state_dtype]

    @property
    def tail_bytes_per_slot(self) -> int:
        return self.num_indexer * 2 * self.kpool * self.index_head_dim * DTYPE_BYTES[self.index_dtype]

    @property
    def hidden_bytes_per_slot(self) -> int:
        """The final hidden state of the last position a checkpoint covers (its next token's logits)."""
        return self.hidden_size * DTYPE_BYTES[self.conv_dtype]

    @property
    def state_bytes_per_slot(self) -> int:
        return (self.conv_bytes_per_slot + self.recurrent_bytes_per_slot + self.tail_bytes_per_slot
                + self.hidden_bytes_per_slot)

    def request_bytes(self, context_tokens: int) -> float:
        """Cache bytes one request of this length holds (KV for its tokens + one state slot)."""
        return context_tokens * self.kv_bytes_per_token + self.state_bytes_per_slot

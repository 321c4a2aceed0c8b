"""KDA (Kimi delta attention) layers: short causal conv, fine-grained forget gate, delta rule.

Per request the layer reads and writes two request-local states in the state pool: the last
K-1 pre-conv q/k/v inputs and the [H, dk, dv] recurrent state (docs/MODEL.md §4, §8.2).

Over several ranks the layer is split by head: each rank holds H / tp heads of q, k, v, the
forget gate (f_b_proj, dt_bias, A_log), beta (b_proj) and the output gate (g_b_proj), their
conv channels and state; the low-rank f_a / g_a projections and o_norm (per head_dim) are
whole on every rank, and o_proj is ROW-parallel (one all-reduce per layer).
"""

from __future__ import annotations

import torch
from torch import nn

from glmrt.config import TextConfig
from glmrt.model.layers import COLUMN, ROW, Linear, LinearGroup, StackedWeights, WeightOnly, _param, join_columns
from glmrt.parallel import Parallel


class KDAAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, ops, dtype: torch.dtype, parallel: Parallel | None = None):
        super().__init__()
        p = parallel or Parallel.single()
        self.ops, self.layer = ops, layer
        d, k = cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.head_dim = cfg.linear_head_dim
        heads = p.split(cfg.linear_num_heads, "linear_num_heads", 0)  # this rank's heads
        self.num_heads = heads.size
        hd = cfg.linear_qkv_dim  # full; the layers below hold this rank's heads of it
        channels = p.split(hd, "linear_num_heads", 0)
        self.lower_bound = cfg.linear_lower_bound
        self.eps = cfg.rms_norm_eps
        col = dict(dtype=dtype, parallel=p, style=COLUMN, name="linear_num_heads")
        self.q_proj = Linear(ops, d, hd, **col)
        self.k_proj = Linear(ops, d, hd, **col)
        self.v_proj = Linear(ops, d, hd, **col)
        # NOTE: conv kernels, A_log and dt_bias stay fp32 whatever the model dtype (as HF keeps them).
        self.q_conv1d = WeightOnly(hd, 1, k, dtype=torch.float32, split=channels)
        self.k_conv1d = WeightOnly(hd, 1, k, dtype=torch.float32, split=channels)
        self.v_conv1d = WeightOnly(hd, 1, k, dtype=torch.float32, split=channels)
        self.f_a_proj = Linear(ops, d, self.head_dim, dtype=dtype)
        self.f_b_proj = Linear(ops, self.head_dim, hd, **col)
        self.dt_bias = _param(channels.size, dtype=torch.float32)
        self.A_log = _param(heads.size, dtype=torch.float32)
        self.splits = {"dt_bias": channels, "A_log": heads}
        self.b_proj = Linear(ops, d, cfg.linear_num_heads, **col)
        self.g_a_proj = Linear(ops, d, self.head_dim, dtype=dtype)
        self.g_b_proj = Linear(ops, self.head_dim, hd, **col)
        self.o_norm = WeightOnly(self.head_dim, dtype=dtype)
        self.o_proj = Linear(ops, hd, d, dtype=dtype, parallel=p, style=ROW, name="linear_num_heads")
        # every projection of the layer input, one GEMV once fused (q, k, v first: `mixed`)
        self.in_proj = LinearGroup(self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj)
        self.conv_weights = StackedWeights(self.q_conv1d, self.k_conv1d, self.v_conv1d)
        self.weight_groups = (self.in_proj, self.conv_weights)

    def conv_weight(self) -> torch.Tensor:
        """[3*qkv, K]: the three depthwise kernels in q, k, v channel order."""
        return self.conv_weights.joined().squeeze(1)

    def forward(self, x: torch.Tensor, meta, cache) -> torch.Tensor:
        n = x.shape[0]
        shape = (n, self.num_heads, self.head_dim)
        q, k, v, f_a, g_a, b = self.in_proj(x)  # views of one product, alive to the end
        mixed = join_columns([q, k, v])
        capture = getattr(cache, "capture", None)  # a verify forward of speculative decoding (glmrt/engine/rollback.py)
        pre = capture.select(mixed) if capture is not None else None
        side = self.ops.fork(x)  # small independent launches beside each other (backends/side_work.py)
        state = cache.recurrent(self.layer)
        with side:  # the recurrence's gate inputs and its new requests' zeroed slots, beside the conv
            beta = torch.sigmoid(b)  # model dtype, as the reference computes it
            f = self.f_b_proj(f_a)
            zeroed = self.ops.zero_fresh_slots(state, meta)
        # q, k, v as three contiguous planes: the recurrence reads dense [N, H, d] tensors
        q, k, v = (t.view(shape) for t in self.ops.causal_conv(mixed, cache.conv(self.layer),
                                                                 self.conv_weight(), meta, planes=3))
        side.join()
        with side:  # the output gate, beside the recurrence
            gate = self.g_b_proj(g_a).view(shape)
        if capture is None:  # the gate and the recurrence in one op: a kernel set may fuse them
            o = self.ops.kda_gated(q, k, v, f, self.dt_bias, self.A_log, self.lower_bound, beta, state, meta,
                                   slots_zeroed=zeroed)
        else:  # the per head and channel log-decay g (< 0, fp32, [N, H, d]) kept for the rollback
            g = self.ops.kda_gate(f, self.dt_bias, self.A_log, self.lower_bound, self.num_heads)
            capture.take(self.layer, pre, *(capture.select(t) for t in (q, k, v, g, beta)))
            o = self.ops.kda(q, k, v, g, beta, state, meta, gate_floor=self.lower_bound, slots_zeroed=zeroed)
        side.join()
        o = self.ops.gated_rms_norm(o, gate, self.o_norm.weight, self.eps).reshape(n, self.num_heads * self.head_dim)
        return self.o_proj(o)

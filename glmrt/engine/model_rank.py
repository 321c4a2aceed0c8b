"""What every rank of an engine builds alike: the kernel set, the model (its shard of it), its
pools and the runner. `glmrt.engine.engine.Engine` adds the scheduler, the prefix cache and the
request lifecycle on rank 0; the other ranks of an engine of several run `ModelRank.follow`.
"""

from __future__ import annotations

import json
import os

import torch

from glmrt.cache.layout import CacheLayout
from glmrt.cache.pools import ModelCache
from glmrt.engine.config import EngineConfig
from glmrt.engine.memory import MemoryPlan, draft_kv_bytes, plan_memory
from glmrt.engine.ranks import PlanLink
from glmrt.engine.runner import ModelRunner
from glmrt.parallel import Parallel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRank:
    """What every rank of an engine builds alike: the kernel set, the model (its shard of it),
    the pools and the runner (with its decode graphs). Rank 0 builds an `Engine` on top; the
    other ranks of an engine of several run `follow()` (glmrt.engine.ranks)."""

    def __init__(self, config: EngineConfig, *, log=print, model=None, parallel: Parallel | None = None,
                 link: PlanLink | None = None):
        self.config = config
        self.log = log
        self.parallel = parallel or Parallel.single()
        self.link = link
        from backends.adapters import resolve_options
        from backends.registry import detect_hardware, get_backend

        device, model_dtype = config.resolved_device(), None
        if model is not None:  # a model built beforehand: where it lives and its dtype rule for "auto"
            if model.device.type == "meta":
                raise ValueError("the model handed to the engine has no weights (it is on the meta device)")
            if config.device == "auto":
                device = str(model.device)
            if config.dtype == "auto":
                model_dtype = next(n for n, d in _DTYPES.items() if d == model.lm_head.weight.dtype)
        model_dtype = model_dtype or config.resolved_dtype(device)
        self.backend = get_backend(config.backend, device)
        self.dtype = _DTYPES[model_dtype]
        # the kernel set's defaults and legal combinations on this hardware, checked before weights load
        self.options = resolve_options(detect_hardware(), {**config.backend_request(), "backend": self.backend.name},
                                       model_dtype=model_dtype)
        if model is None and device.startswith("cuda"):  # before minutes of loading, not after
            from glmrt.engine.fit import check_engine_fits
            check_engine_fits(config, device=device, kv_dtype=self.options.kv_cache_dtype, parallel=self.parallel)
        self.model = model if model is not None else self._load_model(device)
        self.model_config = self.model.config
        text = self.model_config.text
        self.generation_config = self._read_generation_config()
        self.eos_ids = list(self.generation_config.get("eos_token_id") or text.eos_token_id or [])
        if isinstance(self.eos_ids, int):
            self.eos_ids = [self.eos_ids]
        dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.dtype]
        if hasattr(self.backend.ops, "prefill_kernels"):
            self.backend.ops.prefill_kernels = self.options.dsa_prefill_backend == "triton"
        if config.fp8_activations != "auto":  # auto: the kernel set's own (ReferenceOps.fp8_activations)
            self.backend.ops.fp8_activations = config.fp8_activations
        kv_dtype = self.options.kv_cache_dtype
        tp_size = self.model.parallel.tp_size  # the pools of this rank's shard (KDA state per rank)
        # speculative decoding: the MTP draft layer's latent, pooled keys and indexer tail join the pools
        self.spec_steps = config.speculative_steps
        if self.spec_steps and self.model.mtp is None:
            raise ValueError("speculative decoding drafts with the checkpoint's MTP layer, and this model has none "
                             "(num_nextn_predict_layers 0)")
        with_mtp = self.spec_steps > 0
        self.layout = CacheLayout.from_config(text, page_size=config.page_size, kv_dtype=kv_dtype,
                                              state_dtype=config.mamba_ssm_dtype, model_dtype=dtype_name,
                                              tp_size=tp_size, with_mtp=with_mtp)
        budget = self._cache_budget(device)
        if link is not None:  # every rank sizes its pools alike: the smallest budget of any rank
            budget = link.agree_min(budget)
        self.memory: MemoryPlan = plan_memory(
            self.layout, budget, ratio=config.mamba_full_memory_ratio,
            max_mamba_cache_size=config.max_mamba_cache_size, max_running_requests=config.max_running_requests,
            # a prefill engine only runs the draft layer over prompts: it never verifies, so no snapshots
            rollback=with_mtp and config.role != "prefill", draft_kv_bytes_per_token=draft_kv_bytes(text, kv_dtype=kv_dtype, model_dtype=dtype_name,
                                                                       tp_size=tp_size) if with_mtp else 0.0)
        # CUDA graphs pad a decode batch with rows that write to one spare slot and page,
        # allocated past the ones the managers hand out. A speculating engine on one rank has its
        # own graphs (draft + verify, rollback: glmrt.engine.spec_graphs); the decode graphs run one
        # token per request, which it never decodes alone.
        graph_safe = (device.startswith("cuda") and not config.disable_cuda_graph
                      and getattr(self.backend.ops, "decode_graph_safe", False))
        graphs = graph_safe and not with_mtp
        spec_graphs = (graph_safe and with_mtp and config.role != "prefill" and not self.parallel.active
                       and config.page_size > self.spec_steps + 1)
        spare = 1 if graphs or spec_graphs else 0
        # the rollback snapshots sit past the managed slots (and the graphs' spare): a verify step
        # uses row r's for its r-th drafting request, and is done with them when it ends
        self.rollback_base = self.memory.num_slots + spare
        self.cache = ModelCache.allocate(text, self.memory.num_pages + spare,
                                         self.memory.num_slots + spare + self.memory.rollback_slots, device,
                                         page_size=config.page_size, kv_dtype=kv_dtype,
                                         state_dtype=config.mamba_ssm_dtype, model_dtype=dtype_name,
                                         tp_size=tp_size, with_mtp=with_mtp)
        self.runner = ModelRunner(self.model, self.cache, self.eos_ids, parallel=self.parallel, link=link)
        self.host_pool = self._host_pool(config, link) if config.enable_hierarchical_cache else None
        self.runner.host_pool = self.host_pool
        self.context_length = min(config.context_length or text.max_position_embeddings,
                                  self.memory.kv_tokens)
        self.device_name, self.dtype_name, self.kv_dtype = device, dtype_name, kv_dtype
        max_bs = min(config.cuda_graph_max_bs or 256, self.memory.max_running_requests, self.memory.rollback_slots
                     if spec_graphs else 256)
        pad = dict(max_bs=max_bs, max_pages=-(-self.context_length // config.page_size),
                   pad_slot=self.memory.num_slots, pad_page=self.memory.num_pages)
        if graphs:
            self.runner.enable_graphs(**pad)
        if spec_graphs:
            from glmrt.engine.spec_graphs import SpecGraphs
            self.runner.spec_graphs = SpecGraphs(self.model, self.cache, self.spec_steps, **pad)

    def _host_pool(self, config: EngineConfig, link: PlanLink | None):
        """This rank's rows of the host tier, and its disk store (rank 0's tier decides the
        copies and the disk entries of every rank)."""
        from glmrt.cache.host_tier import build_host_pool

        several = self.parallel.active
        pool = build_host_pool(self.cache, int(config.hicache_size * 1e9), config.hicache_ratio,
                               link if several else None)
        self.disk_store = None
        if config.hicache_storage_dir is not None:
            self.disk_store = self._disk_store(config, link if several else None)
        if several and self.parallel.rank == 0:
            pool.journal = []  # its operations travel to the other ranks with the next step
        elif several and self.disk_store is not None:
            from glmrt.cache.disk_tier import DiskMirror
            pool.disk_mirror = DiskMirror(self.disk_store, pool)
        return pool

    def _disk_store(self, config: EngineConfig, link: PlanLink | None):
        """The disk tier's store: the directory itself on one rank; on several, a directory per
        rank (its shard of each entry), holding the same keys: files an earlier run left on
        some ranks only are removed on all. Only rank 0's store evicts (by its cap); the
        others follow its removals."""
        from glmrt.cache.node_store import LocalDiskStore

        capacity = int(config.hicache_storage_size * 1e9)
        if link is None:
            return LocalDiskStore(config.hicache_storage_dir, capacity)
        rank = self.parallel.rank
        store = LocalDiskStore(os.path.join(config.hicache_storage_dir, f"rank{rank}"),
                               capacity if rank == 0 else 2**62)
        everywhere = None
        for listed in link.gather_bytes("\n".join(store.keys()).encode()):
            keys = set(listed.decode().split("\n")) - {""}
            everywhere = keys if everywhere is None else everywhere & keys
        for key in store.keys():
            if key not in everywhere:
                store.remove(key)
        return store

    def _load_model(self, device: str):
        from glmrt.model.loader import load_checkpoint, load_dummy

        cfg = self.config
        if cfg.load_format == "dummy":
            from glmrt.checkpoint.presets import preset_config
            from glmrt.config import load_model_config
            mc = load_model_config(cfg.model) if cfg.model else preset_config(cfg.preset or "tiny")
            return load_dummy(mc, self.backend.ops, dtype=self.dtype, device=device, quantization=cfg.quantization,
                              seed=cfg.seed, with_mtp=cfg.speculative_steps > 0, with_vision=cfg.load_vision,
                              parallel=self.parallel)
        if not cfg.model:
            raise ValueError("no model: give a checkpoint directory (or load_format='dummy' with a preset)")
        model, _ = load_checkpoint(os.path.expanduser(cfg.model), self.backend.ops, dtype=self.dtype,
                                   device=device, with_mtp=cfg.speculative_steps > 0, with_vision=cfg.load_vision,
                                   parallel=self.parallel)
        return model

    def _read_generation_config(self) -> dict:
        if self.config.model:
            path = os.path.join(os.path.expanduser(self.config.model), "generation_config.json")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    return json.load(f)
        return {}

    def _cache_budget(self, device: str) -> int:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()  # blocks the allocator caches but nobody uses count as free
            free, _total = torch.cuda.mem_get_info()
            return int(free * self.config.mem_fraction_static)
        return int(self.config.cache_memory_gb * 2**30)

    def follow(self) -> None:
        """A rank other than 0: run the steps rank 0 publishes until the engine stops."""
        self.runner.follow()

"""`glmrt up [TOPOLOGY.toml]`: start a deployment in the foreground.

Flags override the file. With no file and no model it serves the embedded default: one host,
a unified engine, the shipped trained `tiny-trained` checkpoint (glmrt/checkpoint/tiny_trained),
the best backend available, on 127.0.0.1:30000. SIGTERM or Ctrl-C drains and
stops. This process runs the supervisor and the api actor and never imports torch; on a node of
rank > 0 (--node-rank, glmrt.nodes) it runs only that node's engine ranks (cli/nodes.py).

What cannot run is refused in one line with exit status 2 before any actor starts: a bad value
(glmrt.topology_checks.validate), `gpus` the machine lacks, a port in use, an SGLang flag glmrt does not
build (cli/peer_flags.py), weights and cache pools the GPU (or --cache-memory-gb) cannot hold
(glmrt.engine.fit), node flags that cannot work here (glmrt.nodes, cli/nodes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys

from actors.logs import configure_logging
from cli.parsing import field_help, print_error, with_default
from cli.peer_flags import add_peer_flags
from glmrt import env
from glmrt.devices import gpu_count
from glmrt.actor_kinds import ENGINE_KINDS
from glmrt.engine.config import LOAD_FORMATS, MODEL_DTYPES, EngineConfig
from glmrt.nodes import NodeSection
from glmrt.topology import ApiSection, LogSection, ModelSection, TopologyError, default_topology, load_topology
from glmrt.topology_checks import place_parallel_engines, validate

log = logging.getLogger("glmrt")

# Not engine flags: [model]'s keys and flags (model, preset, load_format, quantization, dtype, backend,
# kv_cache_dtype), placement (role, load_vision; device follows an entry's gpus, or [engine] device).
_ENGINE_FLAG_SKIP = {"model", "preset", "load_format", "quantization", "dtype", "backend", "kv_cache_dtype",
                     "device", "role", "load_vision"}


# Kernel choices (SGLang's spellings); backends/adapters.py holds the table and refuses what a backend lacks.
_FLAG_HELP = {
    "attention_backend": "auto | dsa (GLM-5.3-Flash attention is DSA + KDA)",
    "dsa_prefill_backend": "auto | triton (cuda-h200 default; opt-in on cuda-blackwell, rocm-mi355x) | torch (tilelang / trtllm / flashmla are not shipped: refused)",
    "dsa_decode_backend": "auto | triton (cuda-h200, cuda-blackwell, rocm-mi355x) | torch (reference)",
    "moe_runner_backend": "auto | triton (cuda-h200, cuda-blackwell, rocm-mi355x) | torch (reference); "
                          "flashinfer_trtllm / deep_gemm / ... are not shipped: refused",
    "linear_attn_backend": "KDA layers: auto | triton (cuda-h200, cuda-blackwell, rocm-mi355x) | torch (reference)",
    "fp8_activations": "fp8 weights: auto | dynamic (w8a8: e4m3 activations per token and 128-wide block, the "
                       "Triton kernel sets' default) | none (w8a16, the reference's numerics)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a deployment (foreground)",
                       description="Start the actors of a topology (default: one host, unified engine, the tiny "
                                   "model) and serve the OpenAI API. Flags override the topology file, whose values "
                                   "override the defaults shown.")
    p.add_argument("topology", nargs="?", help="topology.toml (omitted: the embedded default)")
    p.add_argument("--model", "--model-path", help=field_help(ModelSection, "path"))
    p.add_argument("--served-model-name", help=field_help(ModelSection, "served_model_name"))
    p.add_argument("--backend", choices=["auto", "reference", "cuda-h200", "cuda-blackwell", "rocm-mi355x"],
                   help=field_help(ModelSection, "backend", "kernel set (auto: cuda-h200 on SM90, cuda-blackwell on "
                                                            "SM100, rocm-mi355x on gfx950, else reference)"))
    p.add_argument("--dtype", choices=MODEL_DTYPES, help=field_help(ModelSection, "dtype"))
    p.add_argument("--kv-cache-dtype", help=field_help(ModelSection, "kv_cache_dtype", "auto | bfloat16 | fp8_e4m3 | "
                   "the model dtype (auto: bfloat16 on cuda-h200, fp8_e4m3 on cuda-blackwell / rocm-mi355x)"))
    p.add_argument("--load-format", choices=LOAD_FORMATS, help=field_help(ModelSection, "load_format"))
    p.add_argument("--quantization", help=field_help(ModelSection, "quantization", "weight format: auto (the "
                   "checkpoint's) | fp8 | mxfp4 | nvfp4; with --load-format dummy, fp8 quantises the random weights"))
    for name in ("host", "port", "max_request_mb", "max_queued_requests", "allowed_local_media_path",
                 "mm_feature_transport", "allow_remote_media", "limit_mm_per_prompt"):
        _add_field_flag(p, ApiSection, name)
    p.add_argument("--api-key", default=env.api_key(), help=field_help(ApiSection, "api_key", "Bearer key every "
                   "route but /health requires, also set by GLMRT_API_KEY (unset: open)."))
    p.add_argument("--tokenizer-replicas", type=int, help="tokenizer processes (default: the topology's, 1)")
    p.add_argument("--engine-replicas", type=int, help="engine processes, one GPU each where GPUs are placed "
                                                       "(default: the topology's, 1)")
    p.add_argument("--tp-size", "--tp", "--tensor-parallel-size", type=int, dest="tp_size",
                   help=with_default("tensor-parallel degree: ranks of each engine, one process and one GPU "
                                     "each", "the topology's tp, 1"))
    p.add_argument("--ep-size", "--ep", "--expert-parallel-size", type=int, dest="ep_size",
                   help=with_default("expert-parallel degree of each engine: 1 (every rank holds every expert, "
                                     "split by intermediate size) or --tp-size (each rank holds 1/tp of the "
                                     "experts)", "the topology's ep, 1"))
    p.add_argument("--dp-size", "--dp", "--data-parallel-size", type=int, dest="dp_size",
                   help=with_default("engine replicas (data parallelism: each serves its own requests; the same "
                                     "as --engine-replicas)", "the topology's, 1"))
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help=with_default("seconds the actors have to become ready", 600.0))
    for f in dataclasses.fields(LogSection):
        _add_field_flag(p, LogSection, f.name)
    g = p.add_argument_group("nodes (one engine's ranks over several hosts; every node runs glmrt up with the "
                             "same topology)")
    for f in dataclasses.fields(NodeSection):
        _add_field_flag(g, NodeSection, f.name)
    g = p.add_argument_group("engine flags (override [engine])")
    for f in dataclasses.fields(EngineConfig):
        if f.name not in _ENGINE_FLAG_SKIP:
            _add_field_flag(g, EngineConfig, f.name, _FLAG_HELP.get(f.name))
    add_peer_flags(p)
    p.set_defaults(func=run)


def _add_field_flag(group, cls, name: str, text: str | None = None) -> None:
    """The flag `--name` that sets field `name` of config dataclass `cls` (unset: the file's value)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    flag, helptext = "--" + name.replace("_", "-"), field_help(cls, name, text)
    if f.type in ("bool", bool):
        group.add_argument(flag, action="store_true", default=None, help=helptext)
        return
    kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
    group.add_argument(flag, type=kind, default=None, help=helptext)


def embedded_checkpoint() -> str:
    """The embedded default model: the trained tiny-trained checkpoint shipped in the package
    (written by `glmrt train`; glmrt/checkpoint/tiny_trained/README.md says how)."""
    import glmrt  # its path only: importing glmrt.checkpoint here would load more than the api needs
    return os.path.join(os.path.dirname(glmrt.__file__), "checkpoint", "tiny_trained")


def build_topology(args: argparse.Namespace):
    topo = load_topology(args.topology) if args.topology else default_topology()
    model = topo.model
    over = {k: getattr(args, k) for k in ("dtype", "backend", "kv_cache_dtype", "load_format", "quantization")
            if getattr(args, k, None) is not None}
    if args.model:
        over["path"] = os.path.abspath(os.path.expanduser(args.model))
    if args.served_model_name:
        over["served_model_name"] = args.served_model_name
    model = dataclasses.replace(model, **over)
    engine = dict(topo.engine)
    for f in dataclasses.fields(EngineConfig):
        v = getattr(args, f.name, None)
        if f.name not in _ENGINE_FLAG_SKIP and v is not None:
            engine[f.name] = v
    api = topo.api
    api_over = {k: getattr(args, k) for k in ("host", "port", "api_key", "max_request_mb", "max_queued_requests",
                                              "allowed_local_media_path", "allow_remote_media",
                                              "mm_feature_transport", "limit_mm_per_prompt")
                if getattr(args, k, None) is not None}
    if api_over.get("allowed_local_media_path"):
        api_over["allowed_local_media_path"] = os.path.abspath(os.path.expanduser(api_over["allowed_local_media_path"]))
    api = dataclasses.replace(api, **api_over)
    logs = dataclasses.replace(topo.log, **{f.name: getattr(args, f.name) for f in dataclasses.fields(LogSection)
                                            if getattr(args, f.name, None) is not None})
    nodes = dataclasses.replace(topo.nodes, **{f.name: getattr(args, f.name) for f in dataclasses.fields(NodeSection)
                                               if getattr(args, f.name, None) is not None})
    if nodes.curve_key_file:
        nodes = dataclasses.replace(nodes, curve_key_file=os.path.abspath(os.path.expanduser(nodes.curve_key_file)))
    topo = dataclasses.replace(topo, model=model, engine=engine, api=api, log=logs, nodes=nodes)
    topo = _apply_parallel_flags(topo, args)
    for flag, kind in (("tokenizer_replicas", "tokenizer"), ("engine_replicas", "engine")):
        n = getattr(args, flag)
        if n is not None:
            if n < 1:
                raise TopologyError(f"--{flag.replace('_', '-')} must be >= 1 (got {n})")
            if topo.actor(kind) is None:
                raise TopologyError(f"--{flag.replace('_', '-')}: the topology runs no {kind!r} actor; set the "
                                    "replicas of its entries in the topology file")
            topo = topo.with_replicas(kind, n)
    # the file was validated as it was read: what is new here is the flags', and the machine's GPUs
    num_gpus = gpu_count()
    validate(topo, num_gpus=num_gpus, flags=True)
    topo = place_parallel_engines(topo, num_gpus or 0)
    configs = topo.engine_configs()
    if "prefill" in configs:
        try:
            env.kv_transfer()
        except ValueError as e:
            raise TopologyError(str(e)) from None
    options = check_backend_options(configs)
    if "prefill" in configs and "decode" in configs:
        # a prefill can only hand state to a decode of the same KV layout
        kv = {k: options[k].kv_cache_dtype for k in ("prefill", "decode") if k in options}
        if len(kv) == 2 and "auto" not in kv.values() and kv["prefill"] != kv["decode"]:
            raise TopologyError(f"prefill and decode must agree on the KV cache dtype: prefill {kv['prefill']} "
                                f"({options['prefill'].backend}), decode {kv['decode']} ({options['decode'].backend}); "
                                "set --kv-cache-dtype")
    return topo


def _apply_parallel_flags(topo, args: argparse.Namespace):
    """--tp-size / --ep-size set every engine entry's tp / ep; --dp-size its replicas (as
    --engine-replicas does). Values the flags alone make impossible are refused in their spelling."""
    tp, ep, dp = args.tp_size, args.ep_size, args.dp_size
    for flag, n in (("--tp-size", tp), ("--ep-size", ep), ("--dp-size", dp)):
        if n is not None and n < 1:
            raise TopologyError(f"{flag} must be >= 1 (got {n})")
    if ep is not None:
        tp_now = tp if tp is not None else max((a.tp for a in topo.actors if a.kind in ENGINE_KINDS), default=1)
        if ep not in (1, tp_now):
            raise TopologyError(f"--ep-size {ep} must be 1 or --tp-size ({tp_now})")
    if dp is not None:
        if topo.actor("engine") is None:
            raise TopologyError("--dp-size: the topology runs no 'engine' actor; set the replicas of its entries "
                                "in the topology file")
        if args.engine_replicas is not None and args.engine_replicas != dp:
            raise TopologyError(f"--dp-size {dp} and --engine-replicas {args.engine_replicas} disagree; give one")
        args.engine_replicas = dp
    over = {k: v for k, v in (("tp", tp), ("ep", ep)) if v is not None}
    if not over:
        return topo
    actors = tuple(dataclasses.replace(a, **over) if a.kind in ENGINE_KINDS else a for a in topo.actors)
    return dataclasses.replace(topo, actors=actors)


def check_parallel_shapes(topo, model_config) -> str | None:
    """The model sizes each engine's tp / ep must divide (its ranks hold equal shares of the
    attention heads, the vocabulary, the MLP widths and the experts). Returns the refusal, or None."""
    text = model_config.text
    for a in topo.actors:
        if a.kind not in ENGINE_KINDS or a.tp == 1:
            continue
        sizes = [("num_attention_heads", text.num_attention_heads, a.tp),
                 ("linear_num_heads", text.linear_num_heads, a.tp), ("vocab_size", text.vocab_size, a.tp),
                 ("intermediate_size", text.intermediate_size, a.tp)]
        sizes.append(("n_routed_experts", text.n_routed_experts, a.ep) if a.ep > 1
                     else ("moe_intermediate_size", text.moe_intermediate_size, a.tp))
        for name, total, parts in sizes:
            if total % parts:
                size = "ep (--ep-size)" if name == "n_routed_experts" else "tp (--tp-size)"
                return (f"{a.kind}: {size} = {parts} does not divide the model's {name} ({total}); pick a size "
                        f"that divides it")
    return None


def check_backend_options(configs: dict[str, EngineConfig], probe=None) -> dict:
    """Refuse an illegal backend request (backends/adapters.py: the rules) before any actor starts.

    Names no backend accepts are refused without looking at the machine. A request that depends on
    the hardware (a named hardware backend, or `auto` with any option set) probes it once in a child
    interpreter (this process never imports torch); the engine checks again when it starts. Returns
    the resolved options of the engine kinds it could resolve.
    """
    from backends.adapters import (BackendError, IllegalOption, check_request, needs_hardware, probe_hardware,
                                   resolve_options)
    hardware: list = []   # probed once, lazily
    resolved = {}
    for kind, cfg in configs.items():
        req = cfg.backend_request()
        dtype = cfg.dtype if cfg.dtype != "auto" else ("float32" if cfg.device.startswith("cpu") else None)
        try:
            check_request(req, model_dtype=dtype)
            if cfg.load_format == "dummy" and cfg.quantization not in (None, "auto", "fp8"):
                raise IllegalOption("quantization", cfg.quantization, None, "--load-format dummy generates random "
                                    "weights in the model dtype or fp8 (FP4 formats are read from checkpoints and "
                                    "dequantised on load)", ["auto", "fp8"])
            named = cfg.backend not in (None, "auto")
            if needs_hardware(req) or (len({c.backend for c in configs.values()}) > 1):
                if not hardware:
                    hardware.append((probe or probe_hardware)())
                if hardware[0] is not None or named:
                    resolved[kind] = resolve_options(hardware[0], req, model_dtype=dtype)
            elif cfg.backend == "reference":
                resolved[kind] = resolve_options(None, req, model_dtype=dtype)
        except BackendError as e:
            raise TopologyError(f"{kind}: {e}") from None
    return resolved


def check_cache_layout(configs: dict[str, EngineConfig], model_config) -> str | None:
    """The engine values only the checkpoint can judge (the page size against its pooled index keys),
    through the same CacheLayout check the engine makes. Returns the refusal, or None."""
    from glmrt.cache.layout import CacheLayout

    for kind, cfg in configs.items():
        try:
            CacheLayout.from_config(model_config.text, page_size=cfg.page_size)
        except ValueError as e:
            return f"{kind}: --page-size: {e}"
    return None


def check_speculative(configs: dict[str, EngineConfig], model_config) -> str | None:
    """Speculative decoding drafts with the checkpoint's MTP layer: one without it is refused."""
    for kind, cfg in configs.items():
        if cfg.speculative_algorithm != "none" and model_config.text.num_nextn_predict_layers < 1:
            return (f"{kind}: --speculative-algorithm {cfg.speculative_algorithm} needs the checkpoint's MTP layer, "
                    "and this checkpoint has none (num_nextn_predict_layers 0 in config.json)")
    return None


def check_checkpoint_weights(configs: dict[str, EngineConfig], model_config) -> str | None:
    """An explicit --quantization must name the checkpoint's own weight format (glmrt does not re-quantise
    a checkpoint on load). Returns the refusal, or None."""
    q = model_config.quantization
    stored = "bf16" if q is None else getattr(q, "scheme", q.quant_method)
    for kind, cfg in configs.items():
        asked = cfg.quantization
        if asked in (None, "auto") or cfg.load_format == "dummy":
            continue
        asked = {"modelopt_fp4": "nvfp4", "fp8_block": "fp8"}.get(str(asked).lower(), str(asked).lower())
        if asked != stored:
            alts = "auto" if stored == "bf16" else f"auto, {stored}"
            return (f"{kind}: --quantization (quantization) {cfg.quantization!r} is refused: the checkpoint's weights "
                    f"are {stored}. Rule: the weight format is the checkpoint's; glmrt does not re-quantise a "
                    f"checkpoint on load. Alternatives: {alts}, or a checkpoint stored as {asked}.")
    return None


def check_memory_fit(topo, model_config, num_gpus: int | None = None, free_bytes=None, fit=None) -> str | None:
    """Each engine entry's weights and pools against its device, before minutes of loading: on a GPU
    the weights of one rank's shard + reserves + pools against the GPU's free memory (glmrt.engine.fit,
    in a child interpreter: this process never imports torch); on the CPU the pools against
    --cache-memory-gb. Returns the refusal, or None (also when the GPU's memory cannot be read: the
    engine checks again before it loads)."""
    from backends.adapters import BackendError, resolve_options
    from glmrt.cache.layout import CacheLayout
    from glmrt.devices import gpu_free_bytes
    from glmrt.engine.memory import plan_memory

    num_gpus = gpu_count() if num_gpus is None else num_gpus
    for a in topo.actors:
        if a.kind not in ENGINE_KINDS:
            continue
        cfg = topo.engine_config(a)
        where = f"{a.kind} (tp {a.tp}, ep {a.ep})"
        if cfg.device == "cpu" or (cfg.device == "auto" and not num_gpus):
            dtype = cfg.resolved_dtype("cpu")
            try:  # the reference kernels' KV default (the model dtype); a bad request is check_backend_options'
                kv = resolve_options("cpu", {**cfg.backend_request(), "backend": "reference"},
                                     model_dtype=dtype).kv_cache_dtype
            except BackendError:
                continue
            spec = cfg.speculative_steps > 0
            layout = CacheLayout.from_config(model_config.text, page_size=cfg.page_size, kv_dtype=kv,
                                             state_dtype=cfg.mamba_ssm_dtype, model_dtype=dtype, tp_size=a.tp,
                                             with_mtp=spec)
            try:
                plan = plan_memory(layout, int(cfg.cache_memory_gb * 2**30), ratio=cfg.mamba_full_memory_ratio,
                                   max_mamba_cache_size=cfg.max_mamba_cache_size,
                                   max_running_requests=cfg.max_running_requests,
                                   rollback=spec and cfg.role != "prefill")
            except ValueError as e:
                return f"{where}: --cache-memory-gb {cfg.cache_memory_gb}: {e}"
            if cfg.context_length is not None and plan.kv_tokens < cfg.context_length:
                return (f"{where}: --cache-memory-gb {cfg.cache_memory_gb} gives a KV pool of {plan.kv_tokens:,} "
                        f"tokens, less than one request of --context-length {cfg.context_length:,}")
            continue
        gpus = list(a.gpus[:a.tp]) or [int(cfg.device.split(":")[1]) if ":" in cfg.device else 0]
        free = (free_bytes or gpu_free_bytes)(gpus)
        if not free:
            continue
        gpu_bytes = min(free.values())
        plan = (fit or _fit_in_child)(cfg, gpu_bytes, a.tp, a.ep)
        if plan.get("refusal"):
            return f"{where} does not fit on GPU {', '.join(map(str, gpus))}: {plan['refusal']}"
    return None


def _fit_in_child(cfg: EngineConfig, gpu_bytes: int, tp: int, ep: int) -> dict:
    """glmrt.engine.fit in a child interpreter (torch, the meta device only)."""
    out = subprocess.run([sys.executable, "-m", "glmrt.engine.fit", "--engine", json.dumps(dataclasses.asdict(cfg)),
                          "--gpu-bytes", str(gpu_bytes), "--tp-size", str(tp), "--ep-size", str(ep)],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise TopologyError(f"could not compute the memory plan of the engine: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_model(topo, path: str):
    """The checks only the checkpoint can answer, on every node -> its ModelConfig, or the exit
    status of the refusal printed."""
    from glmrt.config import ConfigError, load_model_config

    try:
        mc = load_model_config(path)
    except ConfigError as e:
        return refuse(str(e))
    refusal = (check_checkpoint_weights(topo.engine_configs(), mc) or check_speculative(topo.engine_configs(), mc)
               or check_cache_layout(topo.engine_configs(), mc) or check_parallel_shapes(topo, mc))
    if refusal:
        return refuse(refusal)
    try:
        refusal = check_memory_fit(topo, mc)
    except TopologyError as e:
        refusal = str(e)
    if refusal:
        return refuse(refusal)
    return mc


def refuse(message: str) -> int:
    """The one-line refusal of `glmrt up` (exit status 2), argparse's way."""
    return print_error("glmrt up", message)


def check_port_free(host: str, port: int) -> str | None:
    """Bind the API's address once, as the server will (SO_REUSEADDR), so a port in use is refused
    before any actor starts. Returns the refusal, or None."""
    if port == 0:
        return None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return port_refusal(host, port, e)
    return None


def port_refusal(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use (another glmrt or server listens there); stop it or pick --port"
    return f"cannot listen on {host}:{port}: {e.strerror or e}; pick --host / --port"


def run(args: argparse.Namespace) -> int:
    if not args.ready_timeout > 0:
        return refuse(f"--ready-timeout must be > 0 (got {args.ready_timeout})")
    try:
        topo = build_topology(args)
    except (TopologyError, ValueError, TypeError) as e:
        return refuse(str(e))
    path = topo.model.path
    if topo.model.preset is not None:   # the server needs the tokenizer and config a preset has no files for
        p = topo.model.preset
        return refuse(f"[model] preset {p!r}: glmrt up serves a checkpoint directory; write one with `glmrt "
                      f"make-checkpoint --preset {p} --no-weights --out DIR` and serve it with [model] path = DIR "
                      f"and load_format = \"dummy\" (random weights, as the preset would have)")
    if path is not None and not os.path.exists(os.path.join(path, "config.json")):
        return refuse(f"no config.json in {path}")
    from cli.nodes import check_node_addresses, serve_node
    refusal = check_node_addresses(topo.nodes) or (topo.nodes.node_rank == 0
                                                   and check_port_free(topo.api.host, topo.api.port))
    if refusal:
        return refuse(refusal)
    configure_logging(topo.log.log_level)
    if path is None:
        path = embedded_checkpoint()
        topo = dataclasses.replace(topo, model=dataclasses.replace(topo.model, path=path))
    if topo.nodes.node_rank > 0:
        return serve_node(topo, path)
    try:
        import uvloop
        return uvloop.run(serve(topo, path, args.ready_timeout))
    except ImportError:
        return asyncio.run(serve(topo, path, args.ready_timeout))


async def serve(topo, path: str, ready_timeout: float) -> int:
    from actors.api import ApiServer
    from actors.supervisor import Supervisor
    from transport.channels import make_run_dir

    mc = check_model(topo, path)
    if isinstance(mc, int):
        return mc
    gen_path = os.path.join(path, "generation_config.json")
    gen = json.load(open(gen_path, encoding="utf-8")) if os.path.exists(gen_path) else {}
    served = topo.model.served_model_name or os.path.basename(os.path.normpath(path))
    run_dir = str(make_run_dir())
    api_holder: list = []
    sup = Supervisor(topo, run_dir, path, vocab_size=mc.text.vocab_size,
                     on_failure=lambda actor_id: api_holder and api_holder[0].fail_actor(actor_id),
                     on_restarted=lambda actor_id: api_holder and api_holder[0].actor_restarted(actor_id))
    api = ApiServer(sup, served_model=served, host=topo.api.host, port=topo.api.port, api_key=topo.api.api_key,
                    max_request_mb=topo.api.max_request_mb, max_queued_requests=topo.api.max_queued_requests,
                    generation_config=gen, log_requests=not topo.log.disable_log_requests,
                    limit_mm_per_prompt=topo.api.limit_mm_per_prompt)
    api_holder.append(api)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await api.start()   # before any actor: a port taken since check_port_free is refused here
    except OSError as e:
        await api.stop()
        await sup.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        return refuse(port_refusal(topo.api.host, topo.api.port, e))
    rc = 0
    try:
        log.info("serving %r on http://%s:%s (%s)", served, topo.api.host, topo.api.port,
                 ", ".join(f"{a.kind} x{a.replicas}" for a in topo.actors))
        await sup.start()
        waiter = asyncio.create_task(api.shutdown_requested.wait())
        ready = asyncio.create_task(sup.wait_ready(ready_timeout))
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({ready, stopper, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if ready in done and not ready.result():
            log.error("the deployment did not become ready (see the actor logs above)")
            rc = 1
        elif ready in done:
            log.info("ready")
            await asyncio.wait({stopper, waiter}, return_when=asyncio.FIRST_COMPLETED)
        for t in (waiter, ready, stopper):
            t.cancel()
    finally:
        log.info("draining and stopping")
        sup.stopping = True
        deadline = loop.time() + 30
        while api.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await api.stop()
        await sup.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    return rc

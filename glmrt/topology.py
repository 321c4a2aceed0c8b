"""The config tree of a deployment (`glmrt up topology.toml`) and its one validation pass. No torch.

    [model]     ModelSection: path, dtype, kv_cache_dtype, backend, load_format, preset, ...
    [engine]    engine flags (glmrt.engine.config.EngineConfig fields)
    [api]       ApiSection: host, port, api_key, max_request_mb, max_queued_requests, media
    [log]       LogSection: log_level, log_interval, disable_log_requests (every process glmrt starts)
    [nodes]     NodeSection: nnodes, node_rank, dist_init_addr, curve_key_file (glmrt.nodes)
    [[actors]]  ActorSpec: kind, replicas, gpus, tp, ep, process, engine (per-entry engine overrides)

`Topology` is the root. Unknown keys are refused while the file is read; what else must hold for a
topology to run is checked by glmrt.topology_checks.validate, once the file and the flags are
merged and before any actor starts. Without a file,
`default_topology()` is one host: tokenizer, unified engine and detokenizer, one each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from glmrt.actor_kinds import ENGINE_KINDS, KIND_NAMES, canonical_kind, kind_of, known_spellings
from glmrt.config_bounds import bounded
from glmrt.engine.config import LOAD_FORMATS, MODEL_DTYPES, EngineConfig
from glmrt.mm_limits import DEFAULT_LIMITS
from glmrt.nodes import NodeSection

FEATURE_TRANSPORTS = ("cpu", "cuda_ipc", "auto")
LOG_LEVELS = ("debug", "info", "warning", "error")


class TopologyError(ValueError):
    """A topology that cannot run; the message names the key or entry."""


@dataclass(frozen=True)
class ModelSection:
    path: str | None = None
    """Checkpoint directory (HF format); None: the embedded trained checkpoint (glmrt/checkpoint/tiny_trained)."""
    dtype: str = bounded("auto", choices=MODEL_DTYPES)
    """Model dtype (auto: bfloat16 on a GPU, float32 on the CPU)."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype (EngineConfig.kv_cache_dtype)."""
    backend: str = "auto"
    """Kernel set (EngineConfig.backend)."""
    load_format: str = bounded("auto", choices=LOAD_FORMATS)
    """auto (safetensors) | dummy (random weights)."""
    preset: str | None = None
    """The preset an engine builds with load_format = "dummy" and no path (memory plans read it; `glmrt
    up` refuses it: a server needs a checkpoint directory's tokenizer and config)."""
    quantization: str | None = None
    """Weight format (EngineConfig.quantization)."""
    served_model_name: str | None = None
    """The model id the API reports (None: the checkpoint directory's name)."""


@dataclass(frozen=True)
class ApiSection:
    host: str = "127.0.0.1"
    """Address the OpenAI API listens on."""
    port: int = bounded(30000, ge=0, lt=65536)
    """TCP port of the API (0: any free port)."""
    api_key: str | None = None
    """Bearer key every route but /health requires (None: open)."""
    max_request_mb: float = bounded(32.0, gt=0)
    """Largest request body accepted, in MiB."""
    max_queued_requests: int = bounded(1024, ge=1)
    """Requests in flight beyond which the API answers 503."""
    allowed_local_media_path: str | None = None
    """Local image/video paths are served only under this directory."""
    allow_remote_media: bool = False
    """Fetch http(s) image/video URLs."""
    limit_mm_per_prompt: str = DEFAULT_LIMITS
    """Images and videos one chat request may carry, as JSON (more is a 400 before any is opened)."""
    mm_feature_transport: str = bounded("auto", choices=FEATURE_TRANSPORTS)
    """vision actor -> engine: cpu | cuda_ipc | auto (cuda_ipc when they share GPUs)."""


@dataclass(frozen=True)
class LogSection:
    """What the processes of a deployment log (named as SGLang's and vLLM's flags are)."""

    log_level: str = bounded("info", choices=LOG_LEVELS)
    """The least severe log line every glmrt process prints: debug | info | warning | error."""
    log_interval: float = bounded(10.0, ge=0)
    """Seconds between an engine's stats lines, printed only when it worked since the last one (0: none)."""
    disable_log_requests: bool = False
    """No log line per finished request."""


@dataclass(frozen=True)
class ActorSpec:
    kind: str
    """One of glmrt.actor_kinds.KIND_NAMES."""
    replicas: int = 1
    """Processes of this kind (bounds: the kind's min_replicas, MAX_REPLICAS)."""
    gpus: tuple[int, ...] = ()
    """GPUs the replicas are placed on: one each in turn (tp = 1), or replicas x tp of them, tp
    consecutive ones per replica (empty on a GPU machine: the first replicas x tp GPUs)."""
    tp: int = 1
    """Tensor-parallel degree of an engine: ranks (processes, one GPU each) per replica."""
    ep: int = 1
    """Expert-parallel degree of an engine: 1 (every rank holds every expert, split by
    intermediate size) or tp (each rank holds 1/tp of the experts)."""
    process: str | None = None
    """Entries sharing a process name run in one process (one replica each)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Engine flags of this entry, over [engine]."""


@dataclass(frozen=True)
class Topology:
    """The root of the config tree. Each actor's own typed section (glmrt.actor_config) is derived
    from it by the supervisor; an engine's is `engine_config(spec)`."""

    model: ModelSection = ModelSection()
    """The checkpoint and the model-wide engine options."""
    engine: dict[str, Any] = field(default_factory=dict)
    """The engine flags set by [engine] and the command line, only those set: `engine_config` lays
    them over [model] and under an entry's own engine table, and checks the result."""
    api: ApiSection = ApiSection()
    """The OpenAI API server."""
    log: LogSection = LogSection()
    """The log lines of every process of the deployment."""
    actors: tuple[ActorSpec, ...] = ()
    """One entry per actor kind placed (glmrt.actor_kinds)."""
    nodes: NodeSection = NodeSection()
    """The nodes the deployment spans and this one's rank (glmrt.nodes)."""

    @property
    def feature_transport(self) -> str:
        """The vision -> engine hop: cuda_ipc when asked (validated), or auto on shared GPUs."""
        mode = self.api.mm_feature_transport
        if mode != "auto":
            return mode
        vis = self.actor("vision")
        engines = self.prompt_engines()
        if vis is not None and vis.gpus and engines and all(list(e.gpus) == list(vis.gpus) for e in engines):
            return "cuda_ipc"
        return "cpu"

    @property
    def engine_kinds(self) -> tuple[str, ...]:
        """The actor kinds that run a model: ("engine",) or ("prefill", "decode")."""
        return tuple(k for k in ENGINE_KINDS if self.actor(k) is not None) or ("engine",)

    def actor(self, kind: str) -> ActorSpec | None:
        return next((a for a in self.actors if a.kind == kind), None)

    def prompt_engines(self) -> list[ActorSpec]:
        """The engine entries that compute prompts (and so take vision embeddings)."""
        return [a for a in self.actors if kind_of(a.kind).computes_prompts]

    def engine_config(self, spec: ActorSpec | None = None) -> EngineConfig:
        """The engine config one engine entry runs with: [model] + [engine] + the entry's overrides,
        its role set by its kind and the vision tower left to a vision actor when one is placed."""
        m = self.model
        kw: dict[str, Any] = {"model": m.path, "dtype": m.dtype, "kv_cache_dtype": m.kv_cache_dtype,
                              "backend": m.backend, "load_format": m.load_format, "preset": m.preset,
                              "quantization": m.quantization}
        kw.update(self.engine)
        if spec is not None:
            kw.update(spec.engine)
            kw["role"] = kind_of(spec.kind).engine_role
        if self.actor("vision") is not None:
            kw["load_vision"] = False
        return EngineConfig(**kw)

    def engine_configs(self) -> dict[str, EngineConfig]:
        """The engine config of every engine entry, by kind."""
        return {a.kind: self.engine_config(a) for a in self.actors if a.kind in ENGINE_KINDS}

    def with_replicas(self, kind: str, n: int) -> "Topology":
        actors = tuple(dataclasses.replace(a, replicas=n) if a.kind == kind else a for a in self.actors)
        return dataclasses.replace(self, actors=actors)


def _table(data: dict, key: str) -> dict:
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise TopologyError(f"[{key}] must be a table, got {table!r}")
    return table


def _take(table: dict, cls, where: str, renames: dict[str, str] | None = None) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in table.items():
        key = (renames or {}).get(key, key)
        if key not in names:
            raise TopologyError(f"unknown key {key!r} in {where}; known: {', '.join(sorted(names))}")
        out[key] = value
    return out


def _mm_limits_text(value: Any) -> str:
    """[api] limit_mm_per_prompt as the flag's JSON text (validate() reads it)."""
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except TypeError:  # a TOML date or time
            pass
    elif isinstance(value, str):
        return value
    raise TopologyError(f"[api] limit_mm_per_prompt must be a table such as {{image = 8, video = 2}} or its JSON "
                        f"text (got {value!r})")


def _expand_paths(kw: dict, *names: str) -> dict:
    """`~` in a path key means the home directory, for every actor that reads the path."""
    for name in names:
        if isinstance(kw.get(name), str):
            kw[name] = os.path.expanduser(kw[name])
    return kw


# Engine fields a topology sets elsewhere: given in an engine table they would be overwritten.
_PLACED_ENGINE_FIELDS = {
    "model": "the checkpoint is [model] path, one for every actor",
    "preset": "a preset is [model] preset",
    "role": "an engine's role is its entry's kind (engine, prefill or decode)",
}


def _engine_flags(table: dict, where: str) -> dict:
    names = set(EngineConfig.field_names()) - set(_PLACED_ENGINE_FIELDS)
    for key in table:
        if key in _PLACED_ENGINE_FIELDS:
            raise TopologyError(f"{key!r} is not an engine flag in {where}: {_PLACED_ENGINE_FIELDS[key]}")
        if key not in names:
            raise TopologyError(f"unknown engine flag {key!r} in {where}; known: {', '.join(sorted(names))}")
    return dict(table)


def parse_topology(data: dict) -> Topology:
    known = {"model", "engine", "api", "log", "actors", "nodes"}
    for key in data:
        if key not in known:
            raise TopologyError(f"unknown top-level key {key!r}; known: {', '.join(sorted(known))}")
    model = ModelSection(**_expand_paths(_take(_table(data, "model"), ModelSection, "[model]"), "path"))
    engine = _engine_flags(_table(data, "engine"), "[engine]")
    api = _take(_table(data, "api"), ApiSection, "[api]")
    if "limit_mm_per_prompt" in api:  # a TOML table, or the flag's JSON text
        api["limit_mm_per_prompt"] = _mm_limits_text(api["limit_mm_per_prompt"])
    api = ApiSection(**_expand_paths(api, "allowed_local_media_path"))
    logs = LogSection(**_take(_table(data, "log"), LogSection, "[log]"))
    nodes = NodeSection(**_expand_paths(_take(_table(data, "nodes"), NodeSection, "[nodes]"), "curve_key_file"))
    actors = []
    entries = data.get("actors", [])
    if not isinstance(entries, list):
        raise TopologyError("actors must be an array of tables ([[actors]])")
    for i, entry in enumerate(entries):
        where = f"[[actors]] entry {i}"
        if not isinstance(entry, dict):
            raise TopologyError(f"{where} must be a table")
        kw = _take(entry, ActorSpec, where)
        if "kind" not in kw:
            raise TopologyError(f"{where} has no 'kind' (one of: {', '.join(KIND_NAMES)})")
        kind = canonical_kind(str(kw["kind"]))
        if kind is None:
            raise TopologyError(f"{where}: unknown actor kind {kw['kind']!r}; known: {known_spellings()}")
        kw["kind"] = kind
        try:
            kw["gpus"] = tuple(int(g) for g in kw.get("gpus", ()))
        except (TypeError, ValueError):
            raise TopologyError(f"{where}: gpus must be a list of GPU indices, got {kw['gpus']!r}") from None
        if not isinstance(kw.get("engine", {}), dict):
            raise TopologyError(f"{where}: engine must be a table of engine flags")
        kw["engine"] = _engine_flags(kw.get("engine", {}), f"{where} engine")
        actors.append(ActorSpec(**kw))
    topo = Topology(model, engine, api, logs, tuple(actors) if actors else default_topology().actors, nodes)
    from glmrt.topology_checks import validate  # the checks read this module's types
    validate(topo)
    return topo


def load_topology(path: str) -> Topology:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as e:
        raise TopologyError(f"no topology file at {path}") from e
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"{path} is not valid TOML: {e}") from e
    return parse_topology(data)


def default_topology() -> Topology:
    return Topology(actors=(ActorSpec("tokenizer"), ActorSpec("engine"), ActorSpec("detokenizer")))

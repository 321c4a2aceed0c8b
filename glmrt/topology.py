"""The config tree of a deployment (`glmrt up topology.toml`) and its one validation pass. No torch.

    [model]     ModelSection: path, dtype, kv_cache_dtype, backend, load_format, preset, ...
    [engine]    engine flags (glmrt.engine.config.EngineConfig fields)
    [api]       ApiSection: host, port, api_key, max_request_mb, max_queued_requests, media
    [log]       LogSection: log_level, log_interval, disable_log_requests (every process glmrt starts)
    [nodes]     NodeSection: nnodes, node_rank, dist_init_addr, curve_key_file (glmrt.nodes)
    [[actors]]  ActorSpec: kind, replicas, gpus, tp, ep, process, engine (per-entry engine overrides)

`Topology` is the root. `validate(topo)` is the pass `glmrt up` runs after the file and the flags
are merged and before any actor starts: it checks every section's fields against their declared
bounds (glmrt.config_bounds), the placement of the actors, and that a prefill and a decode engine
can hand state to each other. Unknown keys are refused while the file is read. Without a file,
`default_topology()` is one host: tokenizer, unified engine and detokenizer, one each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable

from glmrt.actor_kinds import (ENGINE_KINDS, KIND_NAMES, REQUIRED_KINDS, SCALABLE_KINDS, canonical_kind, kind_of,
                               known_spellings)
from glmrt.config_bounds import ConfigValueError, bounded, check_fields, flag_spelling, key_spelling
from glmrt.engine.config import LOAD_FORMATS, MODEL_DTYPES, EngineConfig
from glmrt.mm_limits import DEFAULT_LIMITS, parse_mm_limits
from glmrt.nodes import NodesError, NodeSection, check_nodes

FEATURE_TRANSPORTS = ("cpu", "cuda_ipc", "auto")
LOG_LEVELS = ("debug", "info", "warning", "error")
# A prefill hands its pages and state to a decode as they lie in memory: these must agree.
PD_LAYOUT_FIELDS = ("model", "dtype", "kv_cache_dtype", "mamba_ssm_dtype", "page_size", "load_format", "preset",
                    "quantization", "speculative_algorithm")


# Most processes of one actor kind: a scale request past it is refused before a process starts.
MAX_REPLICAS = 64


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


def validate(topo: Topology, num_gpus: int | None = None, *, flags: bool = False) -> None:
    """The one validation pass: raise TopologyError, a one-line message naming the field, for the
    first thing in `topo` that cannot run. `flags`: the values came from the command line, so
    the message spells a field as its flag (`--page-size`), else as its key (`[engine] page_size`)."""
    spell = flag_spelling if flags else key_spelling
    _check_section(topo.model, "" if flags else "[model] ", spell)
    _check_section(topo.api, "" if flags else "[api] ", spell)
    try:
        parse_mm_limits(topo.api.limit_mm_per_prompt)
    except ValueError as e:
        raise TopologyError(f"{'' if flags else '[api] '}{spell('limit_mm_per_prompt')} {e}") from None
    _check_section(topo.log, "" if flags else "[log] ", spell)
    _check_section(topo.nodes, "" if flags else "[nodes] ", spell)
    _check_placement(topo, num_gpus)
    try:
        check_nodes(topo.nodes, topo.actors, spell)
    except NodesError as e:
        raise TopologyError(("" if flags else "[nodes] ") + str(e)) from None
    configs = {}
    for spec in topo.actors:
        if spec.kind in ENGINE_KINDS:
            try:
                configs[spec.kind] = topo.engine_config(spec)
            except ConfigValueError as e:
                raise TopologyError(_engine_where(topo, spec, e.name, flags) + e.message(spell)) from None
    _check_host_tiers(topo, configs, spell)
    if "prefill" in configs and "decode" in configs:
        pre, dec = configs["prefill"], configs["decode"]
        for name in PD_LAYOUT_FIELDS:
            if getattr(pre, name) != getattr(dec, name):
                raise TopologyError(f"prefill and decode must agree on {spell(name)}: prefill {getattr(pre, name)!r}, "
                                    f"decode {getattr(dec, name)!r} (their state could not be handed over)")


def _check_host_tiers(topo: Topology, configs: dict, spell: Callable[[str], str]) -> None:
    """The host tiers of all engine replicas, one per rank, must fit in the host's available
    memory (each engine checks its ranks' again once its device pools are sized; on a GPU a
    --hicache-ratio tier is known only then)."""
    want, parts = 0.0, []
    for spec in topo.actors:
        cfg = configs.get(spec.kind)
        if cfg is None or not cfg.enable_hierarchical_cache:
            continue
        if cfg.hicache_size > 0:
            each = cfg.hicache_size * 1e9
        elif not spec.gpus:  # a CPU engine: its pools are cache_memory_gb
            each = cfg.hicache_ratio * cfg.cache_memory_gb * 2**30
        else:
            continue
        want += each * spec.replicas * spec.tp  # every rank holds a tier of its own
        ranks = f" x {spec.tp} ranks" if spec.tp > 1 else ""
        parts.append(f"{spec.kind} {spec.replicas}{ranks} x {each / 2**30:.2f} GiB")
    if not parts:
        return
    from glmrt.devices import mem_available_bytes
    free = mem_available_bytes()
    if want > free:
        raise TopologyError(f"{spell('hicache_size')} / {spell('hicache_ratio')}: the host tiers need "
                            f"{want / 2**30:.2f} GiB of host memory ({', '.join(parts)}) and {free / 2**30:.2f} GiB "
                            f"is available")


def _check_section(section: Any, where: str, spell: Callable[[str], str]) -> None:
    try:
        check_fields(section)
    except ConfigValueError as e:
        raise TopologyError(where + e.message(spell)) from None


def _engine_where(topo: Topology, spec: ActorSpec, name: str, flags: bool) -> str:
    """Where a bad engine value was written: the entry's own engine table, [engine] or [model]
    (nothing for a flag: its spelling says where)."""
    if name in spec.engine:
        return f"[[actors]] {spec.kind} engine: "
    if flags:
        return ""
    if name in topo.engine:
        return "[engine] "
    return "[model] " if any(f.name == name for f in dataclasses.fields(ModelSection)) else ""


def _check_placement(topo: Topology, num_gpus: int | None) -> None:
    kinds = [a.kind for a in topo.actors]
    for k in set(kinds):
        if kinds.count(k) > 1:
            raise TopologyError(f"actor kind {k!r} is listed {kinds.count(k)} times; use one entry with replicas")
    for a in topo.actors:
        row = kind_of(a.kind)
        for name in ("replicas", "tp", "ep"):
            if isinstance(getattr(a, name), bool) or not isinstance(getattr(a, name), int):
                raise TopologyError(f"{a.kind}: {name} must be an integer, got {getattr(a, name)!r}")
        if a.replicas < row.min_replicas:
            extra = " (leave the entry out to run the tower in the engine)" if a.kind == "vision" else ""
            raise TopologyError(f"{a.kind}: replicas must be >= {row.min_replicas}, got {a.replicas}{extra}")
        if a.replicas > MAX_REPLICAS:
            raise TopologyError(f"{a.kind}: replicas must be <= {MAX_REPLICAS}, got {a.replicas}")
        if a.kind not in ("prefill", "decode"):
            _check_parallel(a, num_gpus, topo.nodes.nnodes)
        if a.gpus and not row.uses_gpus:
            raise TopologyError(f"{a.kind} does not run a model and takes no GPUs (gpus = {list(a.gpus)})")
        if num_gpus == 0 and a.gpus:
            raise TopologyError(f"{a.kind}: gpus = {list(a.gpus)}, but this machine has no GPU; leave gpus out to "
                                "run it on the CPU")
        if num_gpus is not None:
            for g in a.gpus:
                if not 0 <= g < num_gpus:
                    raise TopologyError(f"{a.kind}: gpu {g} does not exist (this machine has {num_gpus} GPUs)")
        if a.process is not None and a.replicas != 1:
            raise TopologyError(f"{a.kind}: process = {a.process!r} co-locates one replica; replicas must be 1")
        if a.gpus and a.tp == 1 and a.replicas > 1 and len(a.gpus) not in (1, a.replicas):
            raise TopologyError(f"{a.kind}: {a.replicas} replicas cannot be placed on gpus {list(a.gpus)}")
    _check_pd_parallel(topo, num_gpus)
    has_engine = "engine" in kinds
    has_pd = "prefill" in kinds or "decode" in kinds
    if has_engine and has_pd:
        raise TopologyError("a topology has either an 'engine' actor or the 'prefill' + 'decode' pair, not both")
    if has_pd and not ("prefill" in kinds and "decode" in kinds):
        missing = "decode" if "prefill" in kinds else "prefill"
        raise TopologyError(f"prefill/decode disaggregation needs both kinds; the {missing!r} actor is missing")
    if not has_engine and not has_pd:
        raise TopologyError("the topology has no 'engine' actor (or 'prefill' + 'decode' pair)")
    if topo.api.mm_feature_transport == "cuda_ipc":
        vis, engines = topo.actor("vision"), topo.prompt_engines()
        if vis is None:
            raise TopologyError("mm_feature_transport = 'cuda_ipc' needs a separate 'vision' actor")
        if not vis.gpus or any(list(e.gpus) != list(vis.gpus) for e in engines):
            raise TopologyError("mm_feature_transport = 'cuda_ipc' needs the vision actor and the engines on the same "
                                f"GPUs (vision {list(vis.gpus)}, engines {[list(e.gpus) for e in engines]}); use "
                                "'cpu' or 'auto'")
    for needed in REQUIRED_KINDS:
        if needed not in kinds:
            raise TopologyError(f"the topology has no {needed!r} actor")


def _check_pd_parallel(topo: Topology, num_gpus: int | None) -> None:
    """A prefill and a decode: their tp sizes must match (each prefill rank hands its own share
    of the state to the decode rank of the same number; resharding between sizes is not built)."""
    pre, dec = topo.actor("prefill"), topo.actor("decode")
    if pre is not None and dec is not None and pre.tp != dec.tp and min(pre.tp, dec.tp) >= 1:
        raise TopologyError(f"prefill tp = {pre.tp} and decode tp = {dec.tp} differ: each prefill rank hands its "
                            "share of the state to the decode rank of the same number, and resharding between tp "
                            "sizes is not built; "
                            "give both the same tp")
    for a in (pre, dec):
        if a is not None:
            _check_parallel(a, num_gpus)


def _check_parallel(a: ActorSpec, num_gpus: int | None, nnodes: int = 1) -> None:
    """An entry's tp / ep and the GPUs its ranks need on each node: replicas x tp / nnodes of
    them, one per rank (glmrt.nodes checked that nnodes divides tp)."""
    if a.tp < 1:
        raise TopologyError(f"{a.kind}: tp must be >= 1, got {a.tp}")
    if a.ep < 1:
        raise TopologyError(f"{a.kind}: ep must be >= 1, got {a.ep}")
    if a.tp == 1 and a.ep == 1:
        return
    if kind_of(a.kind).engine_role is None:
        raise TopologyError(f"{a.kind} does not run a model: tp and ep are set on engine, prefill or decode entries")
    if a.ep not in (1, a.tp):
        raise TopologyError(f"{a.kind}: ep = {a.ep} must be 1 or tp ({a.tp}): experts are either split by "
                            "intermediate size on every rank or spread whole over the tp ranks")
    if a.process is not None:
        raise TopologyError(f"{a.kind}: process = {a.process!r} co-locates actors in one process; an engine of "
                            f"tp {a.tp} runs {a.tp} processes")
    need = a.replicas * a.tp // nnodes
    if a.gpus and len(a.gpus) != need:
        per = f" / {nnodes} nodes" if nnodes > 1 else ""
        raise TopologyError(f"{a.kind}: {a.replicas} replicas x tp {a.tp}{per} need {need} gpus, one per rank; "
                            f"got gpus = {list(a.gpus)}")
    if a.gpus and len(set(a.gpus)) != len(a.gpus):
        raise TopologyError(f"{a.kind}: gpus = {list(a.gpus)} lists a GPU twice; each rank needs its own")
    if num_gpus and not a.gpus and need > num_gpus:
        each = " on each node" if nnodes > 1 else ""
        raise TopologyError(f"{a.kind}: {a.replicas} replicas x tp {a.tp} need {need} GPUs{each}, one per rank; "
                            f"this machine has {num_gpus}")


def place_parallel_engines(topo: Topology, num_gpus: int) -> Topology:
    """On a GPU machine, an engine entry of tp > 1 without `gpus` gets the next replicas x tp
    (/ nnodes: this node's ranks) GPUs not listed by another entry (validate() checked that the
    machine has that many)."""
    if not num_gpus:
        return topo
    nnodes = topo.nodes.nnodes
    taken = {g for a in topo.actors for g in a.gpus}
    actors = []
    for a in topo.actors:
        need = a.replicas * a.tp // (nnodes if a.kind == "engine" else 1)
        if a.tp > 1 and not a.gpus:
            free = [g for g in range(num_gpus) if g not in taken][:need]
            if len(free) < need:
                raise TopologyError(f"{a.kind}: {a.replicas} replicas x tp {a.tp} need {need} GPUs "
                                    f"that no other entry lists; this machine has {num_gpus}")
            taken.update(free)
            a = dataclasses.replace(a, gpus=tuple(free))
        actors.append(a)
    return dataclasses.replace(topo, actors=tuple(actors))


def check_scale_request(kind: str, n: int) -> str:
    """What `glmrt scale KIND=N` may ask of any deployment; returns the canonical kind."""
    name = canonical_kind(kind)
    if name is None or name not in SCALABLE_KINDS:
        raise ValueError(f"cannot scale {kind!r}; scalable kinds: {', '.join(SCALABLE_KINDS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} needs at least 1 replica, got {n}")
    if n > MAX_REPLICAS:
        raise ValueError(f"{name}: at most {MAX_REPLICAS} replicas, got {n}")
    return name


def validate_scale(topo: Topology, kind: str, n: int) -> str:
    """What `glmrt scale KIND=N` may ask of the deployment `topo`; returns the canonical kind."""
    name = check_scale_request(kind, n)
    spec = topo.actor(name)
    if spec is None:
        raise ValueError(f"this deployment runs no {name!r} actor")
    if spec.process:
        raise ValueError(f"{name} shares process {spec.process!r} with other actors; co-located actors "
                         "are not scaled one kind at a time")
    if topo.nodes.nnodes > 1 and name in ENGINE_KINDS:
        raise ValueError(f"{name}: a deployment over {topo.nodes.nnodes} nodes runs one engine whose ranks span "
                         "them; it is not scaled")
    if spec.tp > 1 and spec.gpus and n * spec.tp > len(spec.gpus):
        raise ValueError(f"{name}: {n} replicas x tp {spec.tp} need {n * spec.tp} GPUs, one per rank; its entry "
                         f"lists {len(spec.gpus)} (gpus = {list(spec.gpus)})")
    return name

"""The topology file (`glmrt up topology.toml`): which actors run, how many, where. No torch.

    [model]     path, dtype, kv_cache_dtype, backend, load_format, preset, served_model_name
    [engine]    engine flags (glmrt.engine.config.EngineConfig fields)
    [api]       host, port, api_key, max_request_mb, max_queued_requests
    [[actors]]  kind, replicas, gpus, tp, process, engine (per-entry engine overrides)

Unknown keys and impossible placements are refused with a message naming them. Without a
file, `default_topology()` is one host: tokenizer, unified engine and detokenizer, one each.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from typing import Any

from glmrt.engine.config import EngineConfig

ACTOR_KINDS = ("tokenizer", "vision", "engine", "prefill", "decode", "detokenizer")
_KIND_ALIASES = {"unified": "engine"}


class TopologyError(ValueError):
    """A topology that cannot run; the message names the key or entry."""


@dataclass(frozen=True)
class ModelSection:
    path: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    backend: str = "auto"
    load_format: str = "auto"
    preset: str | None = None
    quantization: str | None = None
    served_model_name: str | None = None


@dataclass(frozen=True)
class ApiSection:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_request_mb: float = 32.0
    max_queued_requests: int = 1024
    allowed_local_media_path: str | None = None   # local image/video paths only under this directory
    allow_remote_media: bool = False               # fetch http(s) image/video URLs
    mm_feature_transport: str = "auto"             # vision actor -> engine: cpu | cuda_ipc | auto


@dataclass(frozen=True)
class ActorSpec:
    kind: str
    replicas: int = 1
    gpus: tuple[int, ...] = ()
    tp: int = 1
    process: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Topology:
    model: ModelSection = ModelSection()
    engine: dict[str, Any] = field(default_factory=dict)
    api: ApiSection = ApiSection()
    actors: tuple[ActorSpec, ...] = ()

    @property
    def feature_transport(self) -> str:
        """The vision -> engine hop: cuda_ipc when asked (validated), or auto on shared GPUs."""
        mode = self.api.mm_feature_transport
        if mode != "auto":
            return mode
        vis = self.actor("vision")
        engines = [a for a in self.actors if a.kind in ("engine", "prefill")]
        if vis is not None and vis.gpus and engines and all(list(e.gpus) == list(vis.gpus) for e in engines):
            return "cuda_ipc"
        return "cpu"

    @property
    def engine_kinds(self) -> tuple[str, ...]:
        """The actor kinds that run a model: ("engine",) or ("prefill", "decode")."""
        return ("prefill", "decode") if self.actor("prefill") else ("engine",)

    def actor(self, kind: str) -> ActorSpec | None:
        return next((a for a in self.actors if a.kind == kind), None)

    def engine_config(self, spec: ActorSpec | None = None) -> EngineConfig:
        """The engine flags of one engine entry: [model] + [engine] + the entry's overrides."""
        m = self.model
        kw: dict[str, Any] = {"model": m.path, "dtype": m.dtype, "kv_cache_dtype": m.kv_cache_dtype,
                              "backend": m.backend, "load_format": m.load_format, "preset": m.preset,
                              "quantization": m.quantization}
        kw.update(self.engine)
        if spec is not None:
            kw.update(spec.engine)
        return EngineConfig(**kw)

    def with_replicas(self, kind: str, n: int) -> "Topology":
        actors = tuple(dataclasses.replace(a, replicas=n) if a.kind == kind else a for a in self.actors)
        return dataclasses.replace(self, actors=actors)


def _take(table: dict, cls, where: str, renames: dict[str, str] | None = None) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in table.items():
        key = (renames or {}).get(key, key)
        if key not in names:
            raise TopologyError(f"unknown key {key!r} in {where}; known: {', '.join(sorted(names))}")
        out[key] = value
    return out


def _engine_flags(table: dict, where: str) -> dict:
    names = set(EngineConfig.field_names())
    for key in table:
        if key not in names:
            raise TopologyError(f"unknown engine flag {key!r} in {where}; known: {', '.join(sorted(names))}")
    return dict(table)


def parse_topology(data: dict) -> Topology:
    known = {"model", "engine", "api", "actors"}
    for key in data:
        if key not in known:
            raise TopologyError(f"unknown top-level key {key!r}; known: {', '.join(sorted(known))}")
    model = ModelSection(**_take(data.get("model", {}), ModelSection, "[model]"))
    engine = _engine_flags(data.get("engine", {}), "[engine]")
    api = ApiSection(**_take(data.get("api", {}), ApiSection, "[api]"))
    actors = []
    for i, entry in enumerate(data.get("actors", [])):
        where = f"[[actors]] entry {i}"
        if not isinstance(entry, dict):
            raise TopologyError(f"{where} must be a table")
        kw = _take(entry, ActorSpec, where)
        if "kind" not in kw:
            raise TopologyError(f"{where} has no 'kind' (one of: {', '.join(ACTOR_KINDS)})")
        kind = _KIND_ALIASES.get(kw["kind"], kw["kind"])
        if kind not in ACTOR_KINDS:
            raise TopologyError(f"{where}: unknown actor kind {kw['kind']!r}; known: {', '.join(ACTOR_KINDS)}, unified")
        kw["kind"] = kind
        kw["gpus"] = tuple(int(g) for g in kw.get("gpus", ()))
        kw["engine"] = _engine_flags(kw.get("engine", {}), f"{where} engine")
        actors.append(ActorSpec(**kw))
    topo = Topology(model, engine, api, tuple(actors) if actors else default_topology().actors)
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


def validate(topo: Topology, num_gpus: int | None = None) -> None:
    kinds = [a.kind for a in topo.actors]
    for k in set(kinds):
        if kinds.count(k) > 1:
            raise TopologyError(f"actor kind {k!r} is listed {kinds.count(k)} times; use one entry with replicas")
    for a in topo.actors:
        if a.replicas < 0 or (a.replicas == 0 and a.kind in ("tokenizer", "detokenizer")):
            raise TopologyError(f"{a.kind}: replicas must be >= 1, got {a.replicas}")
        if a.tp < 1:
            raise TopologyError(f"{a.kind}: tp must be >= 1, got {a.tp}")
        if a.tp > 1:
            raise TopologyError(f"{a.kind}: tp={a.tp} — tensor parallelism is not available in this build; use tp = 1")
        if a.gpus and a.kind in ("tokenizer", "detokenizer"):
            raise TopologyError(f"{a.kind} does not run a model and takes no GPUs (gpus = {list(a.gpus)})")
        if num_gpus is not None:
            for g in a.gpus:
                if not 0 <= g < num_gpus:
                    raise TopologyError(f"{a.kind}: gpu {g} does not exist (this machine has {num_gpus} GPUs)")
        if a.process is not None and a.replicas != 1:
            raise TopologyError(f"{a.kind}: process = {a.process!r} co-locates one replica; replicas must be 1")
        if a.gpus and a.replicas > 1 and len(a.gpus) not in (1, a.replicas * a.tp):
            raise TopologyError(f"{a.kind}: {a.replicas} replicas x tp {a.tp} cannot be placed on gpus {list(a.gpus)}")
    has_engine = "engine" in kinds
    has_pd = "prefill" in kinds or "decode" in kinds
    if has_engine and has_pd:
        raise TopologyError("a topology has either an 'engine' actor or the 'prefill' + 'decode' pair, not both")
    if has_pd and not ("prefill" in kinds and "decode" in kinds):
        missing = "decode" if "prefill" in kinds else "prefill"
        raise TopologyError(f"prefill/decode disaggregation needs both kinds; the {missing!r} actor is missing")
    if not has_engine and not has_pd:
        raise TopologyError("the topology has no 'engine' actor (or 'prefill' + 'decode' pair)")
    if topo.api.mm_feature_transport not in ("cpu", "cuda_ipc", "auto"):
        raise TopologyError(f"mm_feature_transport must be cpu, cuda_ipc or auto, got {topo.api.mm_feature_transport!r}")
    if topo.api.mm_feature_transport == "cuda_ipc":
        vis, engines = topo.actor("vision"), [a for a in topo.actors if a.kind in ("engine", "prefill")]
        if vis is None:
            raise TopologyError("mm_feature_transport = 'cuda_ipc' needs a separate 'vision' actor")
        if not vis.gpus or any(list(e.gpus) != list(vis.gpus) for e in engines):
            raise TopologyError("mm_feature_transport = 'cuda_ipc' needs the vision actor and the engines on the same "
                                f"GPUs (vision {list(vis.gpus)}, engines {[list(e.gpus) for e in engines]}); use "
                                "'cpu' or 'auto'")
    vision = topo.actor("vision")
    if vision is not None and vision.replicas < 1:
        raise TopologyError("vision: replicas must be >= 1 (leave the entry out to run the tower in the engine)")
    for needed in ("tokenizer", "detokenizer"):
        if needed not in kinds:
            raise TopologyError(f"the topology has no {needed!r} actor")

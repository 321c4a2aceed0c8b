"""What a deployment's topology must satisfy to run (glmrt.topology holds the tree itself).

`validate(topo)` is the one pass `glmrt up` runs after the file and the flags are merged and
before any actor starts: every section's fields against their declared bounds
(glmrt.config_bounds), the placement of the actors on GPUs and nodes, the host tiers against the
host's memory, and that a prefill and a decode engine can hand state to each other.
`place_parallel_engines` seats tensor-parallel engines on free GPUs; `check_scale_request` and
`validate_scale` are what `glmrt scale KIND=N` may ask.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from glmrt.actor_kinds import ENGINE_KINDS, REQUIRED_KINDS, SCALABLE_KINDS, canonical_kind, kind_of
from glmrt.config_bounds import ConfigValueError, check_fields, flag_spelling, key_spelling
from glmrt.mm_limits import parse_mm_limits
from glmrt.nodes import NodesError, check_nodes
from glmrt.topology import ActorSpec, ModelSection, Topology, TopologyError

# A prefill hands its pages and state to a decode as they lie in memory: these must agree.
PD_LAYOUT_FIELDS = ("model", "dtype", "kv_cache_dtype", "mamba_ssm_dtype", "page_size", "load_format", "preset",
                    "quantization", "speculative_algorithm")
# Most processes of one actor kind: a scale request past it is refused before a process starts.
MAX_REPLICAS = 64


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

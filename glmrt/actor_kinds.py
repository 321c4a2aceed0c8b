"""The table of actor kinds a topology places: one row per kind, read by the topology, the
supervisor, the actor entry point and `glmrt up`. No torch: the actor classes are named by
import path and loaded only in the actor's own process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmrt import protocol as P
from glmrt.actor_config import (DetokenizerActorConfig, EngineActorConfig, TokenizerActorConfig,
                                VisionActorConfig)


@dataclass(frozen=True)
class ActorKind:
    name: str
    """As topology files, `glmrt scale` and actor ids ("engine/0") spell it."""
    actor_class: str
    """`module:Class` of the actor, imported in the actor process only."""
    config_type: type
    """The typed section its RunSpec.config holds (glmrt.actor_config)."""
    inbox: Any
    """The protocol union its inbox decodes."""
    aliases: tuple[str, ...] = ()
    """Other spellings accepted for `name`."""
    uses_gpus: bool = False
    """May be placed on GPUs; a process of kinds that do not runs with CUDA hidden."""
    engine_role: str | None = None
    """The EngineConfig.role of an engine kind (None: not an engine)."""
    computes_prompts: bool = False
    """An engine that runs prompts, and so takes a vision actor's embeddings."""
    required: bool = False
    """Every topology has one."""
    min_replicas: int = 0
    """Fewest replicas its entry may ask for."""
    scalable: bool = False
    """`glmrt scale` may change its replica count."""


KINDS: tuple[ActorKind, ...] = (
    ActorKind("tokenizer", "actors.tokenizer:TokenizerActor", TokenizerActorConfig, P.TOKENIZER_IN,
              required=True, min_replicas=1, scalable=True),
    ActorKind("vision", "actors.vision:VisionActor", VisionActorConfig, P.VISION_IN, uses_gpus=True,
              min_replicas=1),
    ActorKind("engine", "actors.engine:EngineActor", EngineActorConfig, P.ENGINE_IN, aliases=("unified",),
              uses_gpus=True, engine_role="unified", computes_prompts=True, scalable=True),
    ActorKind("prefill", "actors.engine:EngineActor", EngineActorConfig, P.ENGINE_IN, uses_gpus=True,
              engine_role="prefill", computes_prompts=True, scalable=True),
    ActorKind("decode", "actors.engine:EngineActor", EngineActorConfig, P.ENGINE_IN, uses_gpus=True,
              engine_role="decode", scalable=True),
    ActorKind("detokenizer", "actors.detokenizer:DetokenizerActor", DetokenizerActorConfig, P.DETOK_IN,
              required=True, min_replicas=1, scalable=True),
)
BY_NAME = {k.name: k for k in KINDS}
KIND_NAMES = tuple(BY_NAME)
ENGINE_KINDS = tuple(k.name for k in KINDS if k.engine_role is not None)
REQUIRED_KINDS = tuple(k.name for k in KINDS if k.required)
SCALABLE_KINDS = tuple(k.name for k in KINDS if k.scalable)
_ALIASES = {alias: k.name for k in KINDS for alias in k.aliases}


def canonical_kind(name: str) -> str | None:
    """The kind `name` spells (an alias resolved), or None when no kind is called that."""
    name = _ALIASES.get(name, name)
    return name if name in BY_NAME else None


def kind_of(name: str) -> ActorKind:
    """The row of kind `name` (a canonical name: see canonical_kind)."""
    return BY_NAME[name]


def known_spellings() -> str:
    """Every accepted spelling, for refusals: "tokenizer, vision, ..., unified"."""
    return ", ".join((*KIND_NAMES, *_ALIASES))

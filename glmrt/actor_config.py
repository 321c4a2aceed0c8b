"""The typed config section each actor process is handed (RunSpec.config). No torch.

The supervisor builds one of these per actor from the validated topology; it travels as JSON
(msgspec) on the actor's command line and is decoded back into the same type by the actor's
kind (glmrt.actor_kinds). Frozen: an actor keeps what it finds at runtime on itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmrt.engine.config import EngineConfig


@dataclass(frozen=True)
class ActorLogConfig:
    """How an actor process logs (the deployment's [log] section), whatever its kind."""

    level: str = "info"
    """The least severe line printed: debug | info | warning | error (validated by `glmrt up`)."""


@dataclass(frozen=True)
class MediaPolicy:
    """Which image/video sources the tokenizer may open."""

    allowed_local_media_path: str | None = None
    """Local image/video paths are served only under this directory (None: no local paths)."""
    allow_remote_media: bool = False
    """Fetch http(s) image/video URLs (size-limited, with a timeout)."""


@dataclass(frozen=True)
class TokenizerActorConfig:
    """What a tokenizer actor is handed."""

    model_path: str
    """Checkpoint directory holding tokenizer.json and config.json."""
    vocab_size: int
    """The model's vocabulary size (token ids at or above it are refused)."""
    media: MediaPolicy = field(default_factory=MediaPolicy)
    """Where image/video inputs may come from."""
    vision_replicas: int = 0
    """Vision actors to send pixels to (0: the engine runs the vision tower itself)."""


@dataclass(frozen=True)
class DetokenizerActorConfig:
    """What a detokenizer actor is handed."""

    model_path: str
    """Checkpoint directory holding tokenizer.json."""


@dataclass(frozen=True)
class VisionActorConfig:
    """What a vision actor is handed."""

    model_path: str
    """Checkpoint directory holding the vision tower's weights."""
    dtype: str = "auto"
    """The engines' dtype, so both vision paths compute alike (auto: bfloat16 on a GPU, else float32)."""
    feature_transport: str = "cpu"
    """How embeddings reach the engine: cpu (tensor frames) | cuda_ipc (GPU handles, same GPUs only)."""
    torch_threads: int = 1
    """torch CPU threads of the actor process."""


@dataclass(frozen=True)
class EngineActorConfig:
    """What an engine actor (unified, prefill or decode) is handed."""

    engine: EngineConfig
    """The engine's options, role and load_vision set by placement."""
    log_interval: float = 10.0
    """Seconds between the engine's stats lines, printed only when it worked since the last one (0: none)."""
    torch_threads: int = 1
    """torch CPU threads of the actor process."""
    tp: int = 1
    """Ranks of the engine: the actor is rank 0 and starts the others (actors.engine_rank)."""
    ep: int = 1
    """Expert-parallel degree (1 or tp)."""
    nnodes: int = 1
    """Nodes the ranks span (glmrt.nodes): the actor starts only its own node's."""
    dist_init_addr: str | None = None
    """HOST:PORT of the ranks' store (rank 0 hosts it) and the host the CURVE link binds on."""
    curve_key_file: str | None = None
    """The link's CURVE key file (None: keys made at start, exchanged through the store)."""


ActorConfig = TokenizerActorConfig | DetokenizerActorConfig | VisionActorConfig | EngineActorConfig

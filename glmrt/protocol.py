"""Wire types only: every message that crosses an actor boundary, grouped by edge.

Each top-level message is a tagged msgspec Struct (tag field "t", tag = class name), so one
socket decodes the union its inbox accepts (`ENGINE_IN`, `DETOK_IN`, ... at the bottom).
Nested payload structs (`SamplingParams`, `MMItem`, `TensorRef`, ...) are untagged: the field
that holds them fixes their type.

NOTE: msgspec cannot decode a union that mixes array-like and map-like structs, and the
per-token messages must be array-like (vLLM's hot-path options), so *every* message is
array-like: fields are positional on the wire. Add new fields at the end, with a default.
Per-token messages also skip GC tracking (`gc=False`); they never form reference cycles.

Tensors never travel inside a message: a `TensorRef` (dtype, shape, frame) describes a raw
buffer carried as an out-of-band frame after the msgpack header (see transport/codec.py).

This module imports no torch and nothing of ours but glmrt.sampling_params (data only), so
every actor (and the tests) can load it in milliseconds. The sampling knobs travel as the
engine's own `SamplingParams`, so no field is copied by hand between the api and the sampler.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from glmrt.sampling_params import Grammar, SamplingParams


class Msg(msgspec.Struct, tag_field="t", tag=True, kw_only=True, array_like=True, omit_defaults=True):
    """Base of every top-level message (tagged, positional)."""


class HotMsg(Msg, gc=False):
    """Base of per-token messages: same wire format, not tracked by the cyclic GC."""


class Part(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """Base of untagged payload structs nested inside messages."""


class HotPart(Part, gc=False):
    """Untagged payload nested inside per-token messages."""


# ---------------------------------------------------------------------------------------------
# shared payloads
# ---------------------------------------------------------------------------------------------


class TensorRef(Part):
    """A tensor carried as out-of-band frame `frame` (0 = first frame after the header).

    `dtype` is a torch/numpy dtype name without prefix ("bfloat16", "float32", "int64", ...);
    the frame holds exactly prod(shape) * itemsize bytes, C-contiguous.
    """

    dtype: str
    shape: list[int]
    frame: int


class RequestKey(HotPart, frozen=True):
    """Which request a message is about: the api's response id `rid`, its prompt `prompt` (a
    completion with a list of prompts is one engine request per prompt) and choice `choice`
    (n > 1). Messages about a whole prompt (tokenize, engine and detokenize requests, errors)
    carry choice 0; token and text deltas carry their choice. Inside an engine a request has
    its own string id, mapped to its key by the engine actor, never parsed."""

    rid: str
    prompt: int = 0
    choice: int = 0

    @property
    def request(self) -> RequestKey:
        """The key of the whole prompt's request this choice belongs to."""
        return self if self.choice == 0 else msgspec.structs.replace(self, choice=0)

    def with_choice(self, choice: int) -> RequestKey:
        return msgspec.structs.replace(self, choice=choice)


class MMItem(Part):
    """One image or video after preprocessing; `tensor` is its pixel patches (None once embedded)."""

    kind: Literal["image", "video"]
    grid_thw: list[int]
    num_tokens: int
    tensor: TensorRef | None = None


# ---------------------------------------------------------------------------------------------
# control: any actor <-> supervisor
# ---------------------------------------------------------------------------------------------


class Ready(Msg):
    """An actor finished booting; `info` carries kind-specific facts (pool sizes, backend, ...)."""

    actor: str
    replica: int
    pid: int
    host: str
    gpus: list[int] = []
    info: dict[str, Any] = {}


class Heartbeat(Msg):
    actor: str
    replica: int
    load: float = 0.0
    running: int = 0
    waiting: int = 0


class Shutdown(Msg):
    """Stop the actor; with `drain`, finish (or fail) the requests it holds first."""

    drain: bool = True


class Drained(Msg):
    """The actor holds no more requests and is about to exit."""

    actor: str
    replica: int


# ---------------------------------------------------------------------------------------------
# api -> tokenizer, tokenizer -> api
# ---------------------------------------------------------------------------------------------


class TokenizeRequest(Msg):
    """A validated OpenAI request. Addresses are address ids (e.g. "detokenizer/0")."""

    key: RequestKey
    kind: Literal["chat", "completion"]
    sampling: SamplingParams
    reply_to: str  # the detokenizer that will see this request's tokens
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = {}
    reasoning_effort: str | None = None
    stream: bool = False
    return_token_ids: bool = False
    engine: str | None = None  # engine (or prefill) replica chosen by the api; None: tokenizer picks
    decode: str | None = None  # PD only: the decode replica the prefill hands the request to
    arrival: float = 0.0
    # The context the prompt plus an explicit max_tokens must fit in (the tokenizer refuses the
    # request otherwise); None: max_tokens was omitted and the engine stops at the context's end.
    max_model_len: int | None = None
    grammar: Grammar | None = None  # structured output: the engine compiles and enforces it


class TokenizerError(Msg):
    """Bad input found while tokenizing (context too long, bad image, ...): answer `status`."""

    key: RequestKey
    status: int
    message: str
    code: str | None = None


# ---------------------------------------------------------------------------------------------
# tokenizer -> detokenizer, tokenizer -> engine (or prefill)
# ---------------------------------------------------------------------------------------------


class DetokenizeRequest(Msg):
    """Registers a request with its detokenizer, sent by the tokenizer before the EngineRequest.

    NOTE: it races the engine's first TokenOut (different senders into one PULL socket), so
    the detokenizer buffers tokens of an unknown request until this arrives.
    """

    key: RequestKey
    sampling: SamplingParams
    prompt_tokens: int
    stream: bool = False
    reasoning: bool = False  # parse <think>...</think> into reasoning (template opened it)
    tools: list[dict[str, Any]] | None = None  # parse tool calls when set
    prompt_token_ids: list[int] | None = None  # echoed to the api when return_token_ids
    engine: str | None = None  # where to send Abort when a stop string ends the request
    arrival: float = 0.0


class EngineRequest(Msg):
    key: RequestKey
    prompt_ids: list[int]
    sampling: SamplingParams
    detokenizer: str
    mm_items: list[MMItem] = []
    decode: str | None = None  # PD only: where the prefill hands the request's state
    arrival: float = 0.0
    # NOTE: the engine keeps the request's DetokenizeRequest (the tokenizer built it): the
    # engine alone also holds the tokens generated so far, so it alone can rebuild a restarted
    # detokenizer's state in one message (DetokenizeReplay), racing no other sender
    detokenize: DetokenizeRequest | None = None
    grammar: Grammar | None = None  # compiled before the request is added: a bad one answers 400


# ---------------------------------------------------------------------------------------------
# engine -> detokenizer (hot path)
# ---------------------------------------------------------------------------------------------


class TokenOut(HotMsg):
    """New tokens of one choice. `first_index` is token_ids[0]'s position in the output, so the
    detokenizer orders tokens that reach it out of order from a prefill and a decode engine."""

    key: RequestKey  # with its choice
    token_ids: list[int]
    first_index: int
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    spec_verify_ct: int = 0  # speculative decoding: the choice's decode steps so far (each verified a draft)


class TokenBatch(HotMsg):
    """All TokenOuts of one engine step bound for one detokenizer."""

    items: list[TokenOut]


class EngineError(Msg):
    """The engine failed a request (also forwarded detokenizer -> api)."""

    key: RequestKey
    status: int
    message: str
    code: str | None = None  # OpenAI error code, e.g. "context_length_exceeded"


# ---------------------------------------------------------------------------------------------
# detokenizer -> api (hot path)
# ---------------------------------------------------------------------------------------------


class ToolCallDelta(HotPart):
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


class Usage(HotPart):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    spec_verify_ct: int = 0


class TopLogprob(HotPart):
    token_id: int
    token: str
    logprob: float


class TokenLogprob(HotPart):
    """OpenAI's logprobs entry for one output token (`token` is its text, byte-escaped by the
    detokenizer when it is not valid UTF-8 on its own)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = []


class TextOut(HotMsg):
    """A delta of one choice: new text, reasoning and tool-call fragments since the last one."""

    key: RequestKey  # with its choice
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = []
    token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's field)
    usage: Usage | None = None  # set on the last delta of a choice
    logprobs: list[TokenLogprob] | None = None
    prompt_token_ids: list[int] | None = None  # first delta only, when return_token_ids


class TextBatch(HotMsg):
    items: list[TextOut]


# ---------------------------------------------------------------------------------------------
# api -> engine / tokenizer / detokenizer
# ---------------------------------------------------------------------------------------------


class Abort(Msg):
    """Drop the request `key` names, every choice of it (client gone), or with `choice_only`
    only its choice `key.choice` (a stop string matched in that choice); unknown keys are
    ignored."""

    key: RequestKey
    choice_only: bool = False

    def drops(self, key: RequestKey) -> bool:
        """Whether this abort covers choice `key`."""
        return key.request == self.key.request and (not self.choice_only or key.choice == self.key.choice)


# ---------------------------------------------------------------------------------------------
# a restarted detokenizer: api -> engine -> detokenizer
# ---------------------------------------------------------------------------------------------


class ChoiceProgress(Part):
    """How many output tokens of choice `key` the api has received the text of."""

    key: RequestKey  # with its choice
    received: int = 0


class ReplayRequest(Msg):
    """Api -> every engine: `detokenizer` restarted and lost its requests' state. For each
    request named in `progress` (its choice-0 entry is always there) the engine holding it sends
    the restarted detokenizer a DetokenizeReplay."""

    detokenizer: str
    progress: list[ChoiceProgress] = []


class ReplayedChoice(Part):
    """One choice's output so far, from index 0 (`tokens.first_index` is 0); the api has the
    text of its first `received` tokens already."""

    tokens: TokenOut
    received: int = 0


class DetokenizeReplay(Msg):
    """Engine -> a restarted detokenizer: a request's DetokenizeRequest and the tokens of each
    choice generated so far (finished choices included), so the detokenizer rebuilds its
    incremental state and emits only what the api has not received."""

    request: DetokenizeRequest
    choices: list[ReplayedChoice] = []


# ---------------------------------------------------------------------------------------------
# engine -> api
# ---------------------------------------------------------------------------------------------


class EngineStats(Msg):
    actor: str
    replica: int
    kv_pages_total: int = 0
    kv_pages_free: int = 0
    state_slots_total: int = 0
    state_slots_free: int = 0
    max_running_requests: int = 0
    running: int = 0
    waiting: int = 0
    counters: dict[str, float] = {}


# ---------------------------------------------------------------------------------------------
# prefill -> decode handoff
# ---------------------------------------------------------------------------------------------


class StateComponent(Part, tag_field="kind"):
    """Rows of one request's state in the pool tensors `TENSORS` (each [layers, rows, ...]):
    the pages of a paged pool, or the request's live slot of a state pool. One subclass per
    kind, so the set grows by adding a struct; a transfer pairs two lists kind by kind, row by
    row, and `num_bytes` (every tensor, every layer) must agree on both sides."""

    TENSORS: ClassVar[tuple[str, ...]] = ()
    rows: list[int]
    num_bytes: int

    @property
    def kind(self) -> str:
        return self.__struct_config__.tag


class MLALatentPages(StateComponent, tag="mla_latent_pages"):
    """The MLA latent (compressed KV) of full and partial prompt pages."""

    TENSORS: ClassVar[tuple[str, ...]] = ("latent",)


class IndexerKeyPages(StateComponent, tag="indexer_pages"):
    """The pooled DSA indexer keys of the same pages."""

    TENSORS: ClassVar[tuple[str, ...]] = ("pooled",)


class IndexerTail(StateComponent, tag="indexer_tail"):
    """The indexer's not-yet-pooled keys and gates of the prompt's last partial pool (a slot)."""

    TENSORS: ClassVar[tuple[str, ...]] = ("tail_k", "tail_g")


class KDAConv(StateComponent, tag="kda_conv"):
    """The KDA layers' short-convolution window at the prompt's end (a slot)."""

    TENSORS: ClassVar[tuple[str, ...]] = ("conv",)


class KDARecurrent(StateComponent, tag="kda_recurrent"):
    """The KDA layers' recurrent state at the prompt's end (a slot)."""

    TENSORS: ClassVar[tuple[str, ...]] = ("recurrent",)


class KeptHidden(StateComponent, tag="kept_hidden"):
    """The final hidden state of the prompt's last position (a slot): the MTP draft layer's first
    input on the decode side (speculative decoding only)."""

    TENSORS: ClassVar[tuple[str, ...]] = ("last_hidden",)


AnyStateComponent = MLALatentPages | IndexerKeyPages | IndexerTail | KDAConv | KDARecurrent | KeptHidden


class HandoffLayout(Part):
    """What must be equal on both sides for one engine's state to be valid in the other's pools."""

    model: str
    dtype: str
    kv_dtype: str
    state_dtype: str
    tp: int
    page_size: int
    num_dsa: int
    num_indexer: int
    num_kda: int
    kv_lora_rank: int
    conv_dim: int


class HandoffOffer(Msg):
    """Prefill -> decode: a prompt is computed, its first token sent; can you take it? A
    `layout` unlike the decode's is refused by name. `transfer_info` is the prefill's
    transfer-engine peer info (transport/kv)."""

    rid: str
    key: RequestKey  # the choice the decode will serve
    prompt_ids: list[int]
    first_token: int
    sampling: SamplingParams
    detokenizer: str
    prefill: str
    layout: HandoffLayout
    transfer_info: bytes
    cached_tokens: int = 0
    detokenize: DetokenizeRequest | None = None  # the decode keeps it for a detokenizer replay
    grammar: Grammar | None = None  # the decode owns the matcher from here (first token replayed)


class HandoffAccept(Msg):
    """Decode -> prefill: room reserved (or refused, with the reason). Only pages from
    `reused_tokens` on are missing; `components` are the decode rows to write them into."""

    rid: str
    ok: bool
    decode: str
    reason: str | None = None
    reused_tokens: int = 0
    components: list[AnyStateComponent] = []
    transfer_info: bytes = b""  # the decode's transfer-engine peer info (its rank 0's)
    rank_transfer_info: list[bytes] = []  # tp > 1: ranks 1.. of the decode, by rank


class KVHandoff(Msg):
    """Prefill -> decode: `components` (the accepted rows) are written into the decode's pools;
    the request decodes on from its first token."""

    rid: str
    components: list[AnyStateComponent]


class HandoffDone(Msg):
    """Decode -> prefill: the state arrived (or did not); the prefill side may let go. Also
    prefill -> decode when the write failed, so the decode gives its reservation back."""

    rid: str
    ok: bool
    reason: str | None = None


# ---------------------------------------------------------------------------------------------
# tokenizer -> vision -> engine
# ---------------------------------------------------------------------------------------------


class VisionRequest(Msg):
    """Tokenizer -> vision actor: pixel patches (tensor frames) of a request's items; the
    embeddings go to `engine`, which holds the request until they arrive."""

    key: RequestKey
    items: list[MMItem]
    engine: str = ""
    detokenizer: str = ""


class VisionResult(Msg):
    """Embeddings of `VisionRequest.items`, one TensorRef per item, in order (or an error)."""

    key: RequestKey
    embeddings: list[TensorRef]
    error: str | None = None
    cuda_ipc: list[dict[str, Any]] | None = None  # feature transport cuda_ipc: handles instead of frames


# ---------------------------------------------------------------------------------------------
# what each inbox accepts (one Codec per union)
# ---------------------------------------------------------------------------------------------

CONTROL = Ready | Heartbeat | Shutdown | Drained
SUPERVISOR_IN = Ready | Heartbeat | Drained
TOKENIZER_IN = TokenizeRequest | Abort | Shutdown
VISION_IN = VisionRequest | Abort | Shutdown
ENGINE_IN = (
    EngineRequest | Abort | KVHandoff | VisionResult | Shutdown
    | HandoffOffer | HandoffAccept | HandoffDone | ReplayRequest
)
DETOK_IN = DetokenizeRequest | TokenOut | TokenBatch | EngineError | Abort | Shutdown | DetokenizeReplay
API_IN = TextOut | TextBatch | TokenizerError | EngineError | EngineStats | Shutdown
ANY_MSG = (
    Ready | Heartbeat | Shutdown | Drained | TokenizeRequest | TokenizerError | EngineRequest
    | DetokenizeRequest | TokenOut | TokenBatch | EngineError | TextOut | TextBatch | Abort
    | EngineStats | KVHandoff | VisionRequest | VisionResult
    | HandoffOffer | HandoffAccept | HandoffDone | ReplayRequest | DetokenizeReplay
)

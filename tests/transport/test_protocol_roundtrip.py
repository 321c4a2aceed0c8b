"""Every protocol message round-trips through a Codec; bad input becomes a ProtocolError."""

import pickle
import subprocess
import sys
import typing

import msgspec
import numpy as np
import pytest

from glmrt import protocol as P
from glmrt.sampling_params import SamplingParams
from transport.codec import Codec, ProtocolError, as_buffer, describe, tensor_from_frame

SAMPLING = SamplingParams(temperature=0.7, top_k=20, seed=3, stop_token_ids=[2], max_tokens=64,
                         logprobs=True, top_logprobs=2, stop=["\n\n"], include_stop_str_in_output=True)
REF = P.TensorRef(dtype="float32", shape=[2, 3], frame=0)
LAYOUT = P.HandoffLayout(model="tiny", dtype="bfloat16", kv_dtype="bfloat16", state_dtype="float32", tp=1,
                         page_size=64, num_dsa=2, num_indexer=2, num_kda=2, kv_lora_rank=32, conv_dim=96)
ITEM = P.MMItem(kind="image", grid_thw=[1, 4, 4], num_tokens=4, tensor=REF)
TOKEN_OUT = P.TokenOut(key=P.RequestKey(rid="r1", choice=1), token_ids=[5, 6], first_index=1, finished=True,
                       finish_reason="stop", prompt_tokens=9, completion_tokens=3, cached_tokens=4,
                       logprobs=[-0.1, -0.2], top_logprobs=[[(5, -0.1), (7, -2.0)], [(6, -0.2)]])
TEXT_OUT = P.TextOut(
    key=P.RequestKey(rid="r1", prompt=2), text="hi", reasoning="hmm", token_ids=[5, 6], finished=True,
    finish_reason="tool_calls",
    tool_calls=[P.ToolCallDelta(index=0, id="call_1", name="get", arguments='{"a": 1}')],
    usage=P.Usage(prompt_tokens=9, completion_tokens=2, cached_tokens=4),
    logprobs=[P.TokenLogprob(token_id=5, token="hi", logprob=-0.1,
                             top_logprobs=[P.TopLogprob(token_id=5, token="hi", logprob=-0.1)])],
    prompt_token_ids=[1, 2, 3])
DETOKENIZE = P.DetokenizeRequest(key=P.RequestKey(rid="r1"), sampling=SAMPLING, prompt_tokens=3, stream=True,
                                 reasoning=True, tools=[{"type": "function"}], prompt_token_ids=[1, 2, 3],
                                 engine="engine/0")

SAMPLES = [
    P.Ready(actor="engine", replica=0, pid=123, host="h", gpus=[0, 1], info={"kv_pages": 10, "backend": "ref"}),
    P.Heartbeat(actor="engine", replica=1, load=0.5, running=3, waiting=1),
    P.Shutdown(drain=False),
    P.Drained(actor="tokenizer", replica=0),
    P.TokenizeRequest(key=P.RequestKey(rid="r1"), kind="chat", sampling=SAMPLING, reply_to="detokenizer/0",
                      messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}],
                      chat_template_kwargs={"enable_thinking": False}, reasoning_effort="low", stream=True,
                      return_token_ids=True, engine="engine/1", arrival=12.5),
    P.TokenizeRequest(key=P.RequestKey(rid="r2"), kind="completion", sampling=SamplingParams(),
                      reply_to="detokenizer/0",
                      prompt=[1, 2, 3]),
    P.TokenizeRequest(key=P.RequestKey(rid="r3"), kind="completion", sampling=SamplingParams(), reply_to="d",
                      prompt="once"),
    P.TokenizerError(key=P.RequestKey(rid="r1"), status=400, message="context too long",
                     code="context_length_exceeded"),
    P.EngineRequest(key=P.RequestKey(rid="r1"), prompt_ids=[1, 2, 3], sampling=SAMPLING, detokenizer="detokenizer/0",
                    mm_items=[ITEM, P.MMItem(kind="video", grid_thw=[2, 4, 4], num_tokens=8)],
                    decode="decode/0", arrival=1.0, detokenize=DETOKENIZE),
    DETOKENIZE,
    TOKEN_OUT,
    P.TokenOut(key=P.RequestKey(rid="r2"), token_ids=[7], first_index=0),
    P.TokenBatch(items=[TOKEN_OUT, P.TokenOut(key=P.RequestKey(rid="r2"), token_ids=[7], first_index=0)]),
    P.EngineError(key=P.RequestKey(rid="r1"), status=500, message="oom"),
    TEXT_OUT,
    P.TextOut(key=P.RequestKey(rid="r2"), text="a"),
    P.TextBatch(items=[TEXT_OUT, P.TextOut(key=P.RequestKey(rid="r2"))]),
    P.Abort(key=P.RequestKey(rid="r1")),
    P.EngineStats(actor="engine", replica=0, kv_pages_total=100, kv_pages_free=50, running=2,
                  counters={"prompt_tokens": 10.0, "hit_rate": 0.5}),
    P.HandoffOffer(rid="r1", key=P.RequestKey(rid="a", choice=1), prompt_ids=[1, 2, 3], first_token=9, sampling=SAMPLING, detokenizer="detokenizer/0",
                   prefill="prefill/0", layout=LAYOUT, transfer_info=b"peer", cached_tokens=2, detokenize=DETOKENIZE),
    P.HandoffAccept(rid="r1", ok=True, decode="decode/1", reused_tokens=64,
                    components=[P.MLALatentPages(rows=[4, 5], num_bytes=131072), P.KDAConv(rows=[3], num_bytes=96)],
                    transfer_info=b"peer"),
    P.HandoffAccept(rid="r1", ok=False, decode="decode/1", reason="page_size differs"),
    P.HandoffDone(rid="r1", ok=False, reason="timeout"),
    P.KVHandoff(rid="r1", components=[P.IndexerKeyPages(rows=[4], num_bytes=512),
                                      P.IndexerTail(rows=[3], num_bytes=64),
                                      P.KDARecurrent(rows=[3], num_bytes=128)]),
    P.ReplayRequest(detokenizer="detokenizer/0", progress=[
        P.ChoiceProgress(key=P.RequestKey(rid="r1"), received=3),
        P.ChoiceProgress(key=P.RequestKey(rid="r1", choice=1))]),
    P.DetokenizeReplay(request=DETOKENIZE, choices=[
        P.ReplayedChoice(tokens=P.TokenOut(key=P.RequestKey(rid="r1"), token_ids=[5, 6, 7], first_index=0), received=2),
        P.ReplayedChoice(tokens=TOKEN_OUT)]),
    P.VisionRequest(key=P.RequestKey(rid="r1"), items=[ITEM]),
    P.VisionResult(key=P.RequestKey(rid="r1"), embeddings=[REF, P.TensorRef(dtype="bfloat16", shape=[4, 8], frame=1)]),
]

INBOXES = {"CONTROL": P.CONTROL, "SUPERVISOR_IN": P.SUPERVISOR_IN, "TOKENIZER_IN": P.TOKENIZER_IN,
           "VISION_IN": P.VISION_IN, "ENGINE_IN": P.ENGINE_IN, "DETOK_IN": P.DETOK_IN, "API_IN": P.API_IN}


def _all_messages() -> set[type]:
    seen, todo = set(), [P.Msg]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub is not P.HotMsg:
                seen.add(sub)
    return seen


def test_samples_cover_every_message():
    assert _all_messages() == {type(m) for m in SAMPLES}
    assert set(typing.get_args(P.ANY_MSG)) == _all_messages()
    union_members = set().union(*(typing.get_args(u) for u in INBOXES.values()))
    assert union_members == _all_messages()  # every message has an inbox that accepts it


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_roundtrip(msg):
    codec = Codec(P.ANY_MSG)
    frames = codec.encode(msg)
    assert len(frames) == 1
    back, tensors = codec.decode([bytes(frames[0])])
    assert back == msg and type(back) is type(msg) and tensors == []


@pytest.mark.parametrize("name", INBOXES)
def test_union_channel_decodes_each_kind(name):
    union = INBOXES[name]
    codec = Codec(union)
    members = set(typing.get_args(union))
    for msg in SAMPLES:
        wire = Codec(P.ANY_MSG).encode(msg)
        if type(msg) in members:
            assert codec.decode(wire)[0] == msg
        else:
            with pytest.raises(ProtocolError):
                codec.decode(wire)  # a valid message this inbox does not accept
            with pytest.raises(TypeError):
                codec.encode(msg)  # caught at the sender


def test_hot_path_options():
    for cls in (P.TokenOut, P.TokenBatch, P.TextOut, P.TextBatch, P.ToolCallDelta, P.Usage, P.RequestKey):
        cfg = cls.__struct_config__
        assert cfg.array_like and cfg.omit_defaults and not cfg.gc, cls
    assert P.TokenOut.__struct_config__.tag_field == "t"
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(P.Abort(key=P.RequestKey(rid="x"))))
    assert wire == ["Abort", ["x", 0, 0], False]


def test_request_key():
    """One typed key names a request, its prompt and its choice; an Abort covers the whole
    request or, with choice_only, one choice."""
    whole = P.RequestKey(rid="cmpl-1", prompt=1)
    second = whole.with_choice(2)
    assert second == P.RequestKey(rid="cmpl-1", prompt=1, choice=2) and second.request == whole
    assert whole.request is whole and {second: "x"}[P.RequestKey(rid="cmpl-1", prompt=1, choice=2)] == "x"
    with pytest.raises(AttributeError):
        second.choice = 0  # frozen: safe as a dict key
    everything, one = P.Abort(key=whole), P.Abort(key=second, choice_only=True)
    assert everything.drops(whole) and everything.drops(second)
    assert one.drops(second) and not one.drops(whole) and not one.drops(second.with_choice(1))
    assert not everything.drops(P.RequestKey(rid="cmpl-1", prompt=0))
    assert not everything.drops(P.RequestKey(rid="cmpl-2", prompt=1))


def test_messages_carry_the_engine_sampling_type():
    """Every message with sampling knobs holds glmrt.sampling_params.SamplingParams itself, so
    no hop copies the knobs field by field (and none can drop one)."""
    holders = [cls for cls in _all_messages() if "sampling" in cls.__struct_fields__]
    assert {c.__name__ for c in holders} >= {"TokenizeRequest", "EngineRequest", "DetokenizeRequest"}
    for cls in holders:
        (field,) = [f for f in msgspec.structs.fields(cls) if f.name == "sampling"]
        assert field.type is SamplingParams, cls
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(SAMPLING), type=SamplingParams)
    assert back == SAMPLING and back.validate() is back


@pytest.mark.parametrize("payload", [
    msgspec.msgpack.encode(["NoSuchMessage", "r1"]),  # unknown tag
    msgspec.msgpack.encode({"t": "Abort", "key": ["r1", 0, 0]}),  # map form of an array-like message
    msgspec.msgpack.encode(["Abort", 5]),  # wrong field type
    msgspec.msgpack.encode(["Abort"]),  # missing field
    msgspec.msgpack.encode(["TokenizeRequest", ["r", 0, 0], "poem", {}, "d"]),  # bad literal
    b"\xc1garbage\x00\xff",
    b"",
    pickle.dumps(P.Abort(key=P.RequestKey(rid="r1"))),
    pickle.dumps({"t": "Abort", "rid": "r1"}),
], ids=["unknown-tag", "map", "field-type", "missing", "literal", "garbage", "empty", "pickle", "pickle-dict"])
def test_bad_payload_is_protocol_error(payload):
    with pytest.raises(ProtocolError):
        Codec(P.ANY_MSG).decode([payload])


def test_empty_frame_list():
    with pytest.raises(ProtocolError):
        Codec(P.ANY_MSG).decode([])


def test_oversize_rejected():
    codec = Codec(P.ANY_MSG, max_message_bytes=1024)
    big = P.Abort(key=P.RequestKey(rid="x" * 2000))
    with pytest.raises(ProtocolError, match="max_message_bytes"):
        codec.encode(big)
    with pytest.raises(ProtocolError, match="max_message_bytes"):
        codec.decode(Codec(P.ANY_MSG).encode(big))
    with pytest.raises(ProtocolError, match="max_message_bytes"):  # a tensor frame counts too
        codec.decode([codec.encode(P.Abort(key=P.RequestKey(rid="x")))[0], b"\0" * 1025])
    with pytest.raises(ProtocolError, match="tensor frames"):
        Codec(P.ANY_MSG, max_frames=2).decode([codec.encode(P.Abort(key=P.RequestKey(rid="x")))[0], b"", b"", b""])


def test_numpy_tensor_frames_zero_copy():
    codec = Codec(P.VISION_IN | P.ENGINE_IN)
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    b = np.arange(10, dtype=np.int64)
    c = np.arange(12, dtype=np.float16).reshape(3, 4).T  # non-contiguous: copied
    msg = P.VisionResult(key=P.RequestKey(rid="r"), embeddings=[describe(t, i) for i, t in enumerate((a, b, c))])
    frames = codec.encode(msg, [a, b, c])
    assert len(frames) == 4
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), a)  # sent without a copy
    back, tframes = codec.decode(frames)
    assert back == msg
    outs = [tensor_from_frame(ref, tframes[ref.frame]) for ref in back.embeddings]
    for want, got in zip((a, b, c), outs):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.shares_memory(outs[0], a)  # in-process: decoding views the same memory


def test_other_buffers():
    mv = memoryview(bytearray(b"abcdef"))
    assert bytes(as_buffer(mv)) == b"abcdef"
    assert bytes(as_buffer(b"xy")) == b"xy"
    nested = memoryview(np.arange(6, dtype=np.int16).reshape(2, 3))
    assert as_buffer(nested).nbytes == 12
    with pytest.raises(TypeError):
        as_buffer(object())
    with pytest.raises(TypeError):
        as_buffer(np.array([object()]))


def test_tensor_frame_validation():
    with pytest.raises(ProtocolError, match="needs"):
        tensor_from_frame(P.TensorRef(dtype="float32", shape=[3], frame=0), b"\0" * 8)
    with pytest.raises(ProtocolError, match="dtype"):
        tensor_from_frame(P.TensorRef(dtype="object", shape=[1], frame=0), b"\0" * 8)
    with pytest.raises(ProtocolError, match="negative"):
        tensor_from_frame(P.TensorRef(dtype="uint8", shape=[-1, -2], frame=0), b"\0" * 2)
    with pytest.raises(TypeError, match="as_torch"):
        tensor_from_frame(P.TensorRef(dtype="bfloat16", shape=[1], frame=0), b"\0" * 2)
    empty = tensor_from_frame(P.TensorRef(dtype="float32", shape=[0, 4], frame=0), b"")
    assert empty.shape == (0, 4)


def test_torch_tensor_frames():
    torch = pytest.importorskip("torch")
    codec = Codec(P.VisionResult)
    a = torch.randn(4, 8).to(torch.bfloat16)
    b = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # non-contiguous
    c = torch.ones(3, requires_grad=True)
    msg = P.VisionResult(key=P.RequestKey(rid="r"), embeddings=[describe(t, i) for i, t in enumerate((a, b, c))])
    assert msg.embeddings[0].dtype == "bfloat16"
    frames = codec.encode(msg, [a, b, c])
    assert np.frombuffer(frames[1], np.uint8).ctypes.data == a.data_ptr()  # zero-copy send
    back, tframes = codec.decode([bytes(frames[0]), *frames[1:]])
    outs = [tensor_from_frame(ref, tframes[ref.frame], as_torch=True) for ref in back.embeddings]
    for want, got in zip((a, b, c), outs):
        assert got.dtype == want.dtype and torch.equal(got, want.detach())
    assert outs[0].data_ptr() == a.data_ptr()  # torch.frombuffer views the frame
    arr = tensor_from_frame(back.embeddings[1], tframes[1])
    assert np.array_equal(arr, b.numpy())


def test_protocol_and_transport_import_no_torch():
    code = ("import sys, glmrt.protocol, transport.codec, transport.channels; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)

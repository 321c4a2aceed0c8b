"""Hardware adapters (backends/adapters.py): detection, defaults, the legal table, refusals.

All on CPU: the hardware is faked (torch.cuda monkeypatched, or named), kernel availability is
passed in, and `glmrt up` is driven through its real argument path with the hardware probe
pinned by GLMRT_HARDWARE, so nothing here needs a GPU or starts a server.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from backends import adapters, registry
from backends.adapters import (ADAPTERS, NOT_SHIPPED, BackendError, IllegalOption, check_request,
                               needs_hardware, resolve_options)
from backends.reference import ReferenceOps

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ALL = lambda _a: True  # noqa: E731  (every kernel set installed)
KERNEL_OPTIONS = ("attention_backend", "dsa_prefill_backend", "dsa_decode_backend", "moe_runner_backend",
                  "linear_attn_backend")
HW_OF = {"cuda-h200": "sm90", "cuda-blackwell": "sm100", "rocm-mi355x": "gfx950", "reference": "cpu"}


# ---- detection ------------------------------------------------------------------------------
def fake_gpu(monkeypatch, *, capability=None, arch=None):
    """A CUDA device of `capability`, a ROCm device of `arch`, or (neither) no GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None or arch is not None)
    monkeypatch.setattr(torch.version, "hip", "7.0.0" if arch else None, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: SimpleNamespace(gcnArchName=arch))


@pytest.mark.parametrize("capability,arch,hw,backend", [
    ((9, 0), None, "sm90", "cuda-h200"),                  # H100 / H200
    ((10, 0), None, "sm100", "cuda-blackwell"),           # B200 / GB200
    ((10, 3), None, "sm100", "cuda-blackwell"),           # B300 / GB300
    ((12, 0), None, "cuda-other", "reference"),           # consumer Blackwell: no adapter
    ((8, 0), None, "cuda-other", "reference"),            # A100
    (None, "gfx950:sramecc+:xnack-", "gfx950", "rocm-mi355x"),
    (None, "gfx942:sramecc+:xnack-", "rocm-other", "reference"),  # MI300X
    (None, None, "cpu", "reference"),
])
def test_detection_picks_the_adapter(monkeypatch, capability, arch, hw, backend):
    fake_gpu(monkeypatch, capability=capability, arch=arch)
    assert registry.detect_hardware() == hw
    assert resolve_options(registry.detect_hardware(), {}, installed=ALL).backend == backend


def test_auto_without_the_kernels_installed_falls_back_to_the_reference():
    for hw in ("sm90", "sm100", "gfx950"):
        o = resolve_options(hw, {}, installed=lambda _a: False)
        assert (o.backend, o.kv_cache_dtype, o.dsa_decode_backend) == ("reference", "bfloat16", "torch")


# ---- defaults -------------------------------------------------------------------------------
@pytest.mark.parametrize("hw,want", [
    ("sm90", dict(backend="cuda-h200", kv_cache_dtype="bfloat16", attention_backend="dsa",
                  dsa_prefill_backend="triton", dsa_decode_backend="triton", moe_runner_backend="triton",
                  linear_attn_backend="triton")),
    ("sm100", dict(backend="cuda-blackwell", kv_cache_dtype="fp8_e4m3", attention_backend="dsa",
                   dsa_prefill_backend="torch", dsa_decode_backend="triton", moe_runner_backend="triton",
                   linear_attn_backend="triton")),
    ("gfx950", dict(backend="rocm-mi355x", kv_cache_dtype="fp8_e4m3", attention_backend="dsa",
                    dsa_prefill_backend="torch", dsa_decode_backend="triton", moe_runner_backend="triton",
                    linear_attn_backend="triton")),
    ("cpu", dict(backend="reference", kv_cache_dtype="float32", attention_backend="dsa",
                 dsa_prefill_backend="torch", dsa_decode_backend="torch", moe_runner_backend="torch",
                 linear_attn_backend="torch")),
])
def test_defaults_per_adapter(hw, want):
    o = resolve_options(hw, {}, installed=ALL)
    assert {k: getattr(o, k) for k in want} == want
    assert (o.quantization, o.speculative_algorithm, o.cuda_graph_backend_prefill) == (None, "none", "off")
    assert o.hardware == hw and o.backend in o.describe()


def test_declared_formats():
    h200, bw, mi = ADAPTERS["cuda-h200"], ADAPTERS["cuda-blackwell"], ADAPTERS["rocm-mi355x"]
    assert (h200.preferred_weights, bw.preferred_weights, mi.preferred_weights) == ("fp8", "nvfp4", "mxfp4")
    for a in ADAPTERS.values():  # no FP4 GEMM anywhere: FP4 is dequantised on load, and says so
        assert set(a.weights) == set(adapters.WEIGHT_FORMATS)
        assert all("on load" in a.weights[f] for f in ("mxfp4", "nvfp4"))
    for a in (bw, mi):  # untested hardware is declared as such
        assert "never run" in a.tested
    assert [r["backend"] for r in adapters.table()] == list(ADAPTERS)


def test_a_bf16_default_follows_a_wider_model_dtype():
    assert resolve_options("sm90", {}, model_dtype="float32", installed=ALL).kv_cache_dtype == "float32"
    assert resolve_options("sm90", {}, model_dtype="bfloat16", installed=ALL).kv_cache_dtype == "bfloat16"
    assert resolve_options("sm100", {}, model_dtype="float32", installed=ALL).kv_cache_dtype == "fp8_e4m3"
    assert resolve_options("cpu", {"backend": "reference"}, model_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert resolve_options(None, {"backend": "reference"}).kv_cache_dtype == "auto"  # device not known yet


# ---- the legal table ------------------------------------------------------------------------
LEGAL = [
    ("sm90", {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e4m3"}),   # legal on H200, off by default
    ("sm90", {"kv_cache_dtype": "bf16"}, {"kv_cache_dtype": "bfloat16"}),
    ("sm90", {"kv_cache_dtype": "float32"}, None),                             # refused below unless fp32 model
    ("sm100", {"kv_cache_dtype": "bfloat16"}, {"kv_cache_dtype": "bfloat16"}),
    ("gfx950", {"kv_cache_dtype": "BF16"}, {"kv_cache_dtype": "bfloat16"}),
    ("cpu", {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e4m3"}),
    ("cpu", {"kv_cache_dtype": "float16"}, {"kv_cache_dtype": "float16"}),
    # SGLang's flags in their own spellings, where glmrt has the thing
    ("sm90", {"attention_backend": "dsa", "kv_cache_dtype": "bfloat16", "moe_runner_backend": "triton",
              "quantization": "fp8"}, {"attention_backend": "dsa", "moe_runner_backend": "triton",
                                       "quantization": "fp8"}),
    ("sm90", {"dsa_decode_backend": "triton", "dsa_prefill_backend": "torch"},
     {"dsa_decode_backend": "triton", "dsa_prefill_backend": "torch"}),
    ("sm100", {"linear_attn_backend": "triton"}, {"linear_attn_backend": "triton"}),  # SGLang's GB300 flag
    ("sm100", {"quantization": "modelopt_fp4"}, {"quantization": "nvfp4"}),
    ("gfx950", {"quantization": "mxfp4"}, {"quantization": "mxfp4"}),
    ("sm90", {"quantization": "nvfp4"}, {"quantization": "nvfp4"}),              # dequantised on load
    ("sm90", {"speculative_algorithm": "off"}, {"speculative_algorithm": "none"}),
    ("sm90", {"speculative_algorithm": "nextn"}, {"speculative_algorithm": "EAGLE"}),   # SGLang's spellings
    ("cpu", {"speculative_algorithm": "MTP"}, {"speculative_algorithm": "EAGLE"}),
    ("sm100", {"cuda_graph_backend_prefill": "off"}, {"cuda_graph_backend_prefill": "off"}),
    ("sm90", {"backend": "reference", "dsa_decode_backend": "torch"}, {"backend": "reference"}),
    ("sm100", {"backend": "cuda-blackwell", "kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8_e4m3"}),
]


@pytest.mark.parametrize("hw,req,want", [c for c in LEGAL if c[2] is not None])
def test_legal_combinations(hw, req, want):
    o = resolve_options(hw, req, installed=ALL)
    assert {k: getattr(o, k) for k in want} == want


def test_the_model_dtype_is_always_a_legal_kv_dtype():
    assert resolve_options("sm90", {"kv_cache_dtype": "float32"}, model_dtype="float32",
                           installed=ALL).kv_cache_dtype == "float32"


# ---- refusals: each names the rule and the alternatives ---------------------------------------
def refused(hw, req, **kw) -> IllegalOption:
    with pytest.raises(IllegalOption) as ei:
        resolve_options(hw, req, **{"installed": ALL, **kw})
    e = ei.value
    msg = str(e)
    assert isinstance(e, registry.BackendError) and registry.BackendError is BackendError
    assert e.rule and f"Rule: {e.rule}" in msg
    assert e.alternatives and "Alternatives" in msg and all(alt in msg for alt in e.alternatives)
    assert adapters.label(e.option) in msg and repr(e.value) in msg
    return e


REFUSED = [
    # (hardware, request, option, words of the rule, alternatives)
    # SGLang's KV/DSA pairings name TileLang and TRT-LLM, which glmrt does not ship
    ("sm90", {"kv_cache_dtype": "bfloat16", "dsa_prefill_backend": "tilelang", "dsa_decode_backend": "tilelang"},
     "dsa_prefill_backend", "TileLang", ("auto", "torch")),
    ("sm90", {"kv_cache_dtype": "bfloat16", "dsa_decode_backend": "tilelang"},
     "dsa_decode_backend", "TileLang DSA with fp8 KV is not a valid CUDA combination", ("auto", "triton")),
    ("sm100", {"kv_cache_dtype": "fp8_e4m3", "dsa_decode_backend": "trtllm"},
     "dsa_decode_backend", "TRT-LLM", ("auto", "triton")),
    ("gfx950", {"kv_cache_dtype": "fp8_e4m3", "dsa_decode_backend": "tilelang"},
     "dsa_decode_backend", "fp8 KV on MI355X", ("auto", "triton")),
    ("gfx950", {"dsa_prefill_backend": "trtllm"}, "dsa_prefill_backend", "not the MI355X backend", ("auto", "torch")),
    ("sm100", {"moe_runner_backend": "flashinfer_trtllm"}, "moe_runner_backend", "FlashInfer", ("auto", "triton")),
    ("sm90", {"moe_runner_backend": "deep_gemm"}, "moe_runner_backend", "DeepGEMM", ("auto", "triton")),
    ("sm90", {"attention_backend": "flashmla"}, "attention_backend", "FlashMLA", ("auto", "dsa")),
    ("sm90", {"attention_backend": "fa3"}, "attention_backend", "FlashAttention 3", ("auto", "dsa")),
    ("sm90", {"attention_backend": "triton"}, "attention_backend", "--dsa-decode-backend triton", ("auto", "dsa")),
    # what glmrt has, but not on this adapter
    ("cpu", {"dsa_prefill_backend": "triton"}, "dsa_prefill_backend", "torch only", ("auto", "torch")),
    ("cpu", {"dsa_decode_backend": "triton"}, "dsa_decode_backend", "torch only", ("auto", "torch")),
    ("cpu", {"moe_runner_backend": "triton"}, "moe_runner_backend", "torch only", ("auto", "torch")),
    ("cpu", {"linear_attn_backend": "triton"}, "linear_attn_backend", "torch only", ("auto", "torch")),
    # not built on any backend (legal means built)
    ("gfx950", {"speculative_algorithm": "DFLASH2"}, "speculative_algorithm", "no DFlash2", ("auto", "none", "EAGLE")),
    ("gfx950", {"cuda_graph_backend_prefill": "breakable"}, "cuda_graph_backend_prefill",
     "decode graphs", ("auto", "off")),
    ("cpu", {"cuda_graph_backend_prefill": "breakable"}, "cuda_graph_backend_prefill", "eagerly", ("auto", "off")),
    # KV dtypes
    ("sm90", {"kv_cache_dtype": "float32"}, "kv_cache_dtype", "or the model dtype", ("auto", "bfloat16", "fp8_e4m3")),
    ("sm100", {"kv_cache_dtype": "float16"}, "kv_cache_dtype", "fp8_e4m3 (the default",
     ("auto", "fp8_e4m3", "bfloat16")),
    ("sm90", {"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype", "e5m2 is not implemented",
     ("auto", "bfloat16", "fp8_e4m3")),
    ("gfx950", {"kv_cache_dtype": "int8"}, "kv_cache_dtype", "unknown value", ("auto", "fp8_e4m3", "bfloat16")),
    # weights
    ("sm90", {"quantization": "bf16"}, "quantization", "leave it auto", ("auto", "fp8", "mxfp4", "nvfp4")),
    ("sm90", {"quantization": "int4"}, "quantization", "unknown value", ("auto", "fp8")),
    # the backend itself
    ("sm90", {"backend": "rocm-mi355x"}, "backend", "this machine is sm90", ("auto", "cuda-h200", "reference")),
    ("gfx950", {"backend": "cuda-h200"}, "backend", "NVIDIA H100 / H200", ("auto", "rocm-mi355x", "reference")),
    ("cpu", {"backend": "cuda-blackwell"}, "backend", "this machine is cpu", ("auto", "reference")),
    ("sm90", {"backend": "tpu"}, "backend", "unknown backend", ("auto", "reference", "cuda-h200")),
]


@pytest.mark.parametrize("hw,req,option,rule,alternatives", REFUSED)
def test_refusals_name_the_rule_and_the_alternatives(hw, req, option, rule, alternatives):
    e = refused(hw, req)
    assert e.option == option
    assert rule in e.rule, e.rule
    assert set(alternatives) <= set(e.alternatives), e.alternatives


@pytest.mark.parametrize("hw", ["sm90", "sm100", "gfx950", "cpu"])
@pytest.mark.parametrize("option,value,words,alternatives", [
    ("speculative_algorithm", "dflash2", "no DFlash2 or separate draft model", ("auto", "none", "EAGLE")),
    ("speculative_algorithm", "STANDALONE", "only chain drafting from the checkpoint's MTP layer",
     ("auto", "none", "EAGLE")),
    ("cuda_graph_backend_prefill", "breakable", "prefill always runs eagerly", ("auto", "off")),
])
def test_unbuilt_features_are_refused_everywhere(hw, option, value, words, alternatives):
    """Legal means built: no adapter accepts DFlash2 drafting or prefill graphs, and the refusal says what
    glmrt runs instead; without the hardware every backend refuses them."""
    e = refused(hw, {option: value})
    assert e.option == option and words in e.rule and e.alternatives == alternatives
    with pytest.raises(IllegalOption, match="refused on every backend"):
        check_request({option: value})


def test_up_refuses_the_flags_of_unbuilt_features(up_cli, capsys, tmp_path):
    """`glmrt up` refuses their flags (SGLang's spellings) in one line saying what glmrt runs instead, and
    takes no topology key for them: both before anything starts."""
    for flag, value, words in (("--speculative-draft-model-path", "/m", "checkpoint's own MTP layer"),
                               ("--cuda-graph-backend-prefill", "breakable", "prefill runs eagerly")):
        with pytest.raises(SystemExit) as ei:
            up_cli(flag, value, hardware="sm90")
        err = capsys.readouterr().err
        assert ei.value.code == 2 and err.startswith(f"glmrt up: error: {flag}: ") and words in err, err
    path = tmp_path / "t.toml"
    path.write_text('[engine]\ncuda_graph_backend_prefill = "breakable"\n')
    assert up_cli(str(path), hardware="sm90") == 2
    assert "unknown engine flag 'cuda_graph_backend_prefill'" in capsys.readouterr().err


def test_every_unshipped_library_is_refused_for_every_kernel_option_everywhere():
    for hw in ("sm90", "sm100", "gfx950", "cpu"):
        for option in KERNEL_OPTIONS:
            for name, why in NOT_SHIPPED.items():
                e = refused(hw, {option: name})
                assert e.option == option and why in e.rule and "does not ship" in e.rule
                assert e.alternatives[0] == "auto" and name not in e.alternatives


def test_missing_kernels_are_refused_when_named():
    e = refused("sm90", {"backend": "cuda-h200"}, installed=lambda _a: False)
    assert "'triton'" in e.rule and e.alternatives == ("auto", "reference")


def test_unknown_option_keys_are_refused():
    with pytest.raises(BackendError, match="unknown backend option"):
        resolve_options("sm90", {"kv_dtype": "fp8_e4m3"}, installed=ALL)


def test_check_request_without_the_hardware():
    e = pytest.raises(IllegalOption, check_request, {"dsa_decode_backend": "tilelang"}).value
    assert "refused on every backend" in str(e) and {"auto", "triton", "torch"} <= set(e.alternatives)
    check_request({"dsa_decode_backend": "triton"})   # legal somewhere: the hardware decides
    check_request({"kv_cache_dtype": "float32"})      # the reference takes it
    with pytest.raises(IllegalOption, match="cuda-h200"):
        check_request({"backend": "cuda-h200", "kv_cache_dtype": "float32"})
    check_request({"backend": "cuda-h200", "kv_cache_dtype": "float32"}, model_dtype="float32")
    assert not needs_hardware({"backend": "auto", "kv_cache_dtype": None})
    assert not needs_hardware({"backend": "reference", "kv_cache_dtype": "fp8_e4m3"})
    assert needs_hardware({"backend": "cuda-h200"}) and needs_hardware({"kv_cache_dtype": "fp8_e4m3"})


# ---- the kernel sets behind the table ----------------------------------------------------------
@pytest.fixture
def clean_registry(monkeypatch):
    snapshot = dict(registry._FACTORIES)
    for mod in ("backends.cuda_blackwell", "backends.rocm_mi355x"):  # re-import: registration is the side effect
        monkeypatch.delitem(sys.modules, mod, raising=False)
    yield
    registry._FACTORIES.clear()
    registry._FACTORIES.update(snapshot)


@pytest.mark.skipif(not HAVE_TRITON, reason="the hardware kernel sets need Triton")
@pytest.mark.parametrize("capability,arch,name,cls", [((10, 0), None, "cuda-blackwell", "CudaBlackwellOps"),
                                                      (None, "gfx950", "rocm-mi355x", "RocmMI355XOps")])
def test_registry_loads_the_kernel_set_lazily_on_its_hardware(monkeypatch, clean_registry, capability, arch, name,
                                                              cls):
    from backends.cuda_h200 import CudaH200Ops

    registry._FACTORIES.pop(name, None)
    fake_gpu(monkeypatch, capability=capability, arch=arch)
    b = registry.get_backend("auto", device="cpu")
    assert b.name == name and type(b.ops).__name__ == cls and b.ops.name == name
    assert isinstance(b.ops, CudaH200Ops) and isinstance(b.ops, ReferenceOps)
    assert registry.get_backend(name, device="cpu").name == name
    with pytest.raises(BackendError, match="needs"):
        registry.resolve_name(name, hardware="sm90")


@pytest.mark.skipif(not HAVE_TRITON, reason="the hardware kernel sets need Triton")
def test_the_table_matches_what_the_kernel_sets_override():
    """A row that says `triton` must be backed by an override of the reference op (and `torch` by none)."""
    from backends.cuda_h200 import CudaH200Ops

    def overrides(method: str) -> bool:
        return getattr(CudaH200Ops, method) is not getattr(ReferenceOps, method)

    for a in (ADAPTERS["cuda-h200"], ADAPTERS["cuda-blackwell"], ADAPTERS["rocm-mi355x"]):
        assert (a.dsa_decode_backends[0] == "triton") == (overrides("sparse_mla") and overrides("indexer_select"))
        assert (a.moe_runner_backends[0] == "triton") == overrides("moe_experts")
        assert (a.linear_attn_backends[0] == "triton") == (overrides("causal_conv") and overrides("kda"))


def test_adapters_import_no_torch():
    code = "import sys, backends.adapters, cli.up; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ---- the engine on the reference backend and the CPU (on any host): KV dtype into the pools,
# refusal before any weight loads
def test_engine_allocates_the_resolved_kv_dtype():
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine

    cfg = EngineConfig(load_format="dummy", preset="tiny", cache_memory_gb=0.01, load_vision=False, backend="reference",
                       device="cpu")
    eng = Engine(cfg, log=lambda *a: None)
    assert eng.options.backend == "reference" and eng.cache.kv.latent.dtype == torch.float32
    eng8 = Engine(cfg.replace(kv_cache_dtype="fp8_e4m3"), log=lambda *a: None)
    # e4m3 values + fp32 scales per 128 in one byte row (backends/kv_fp8.py); indexer keys stay fp32
    lat = eng8.cache.kv.latent
    assert eng8.layout.kv_dtype == "fp8_e4m3" and lat.dtype == torch.uint8
    assert lat.shape[-1] == eng8.layout.latent_row_bytes == eng8.layout.kv_lora_rank + 4
    assert eng8.cache.kv.pooled.dtype == torch.float32
    from glmrt.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    prompt = list(range(5, 45))
    got, want = eng8.generate([prompt], params)[0][0], eng.generate([prompt], params)[0][0]
    # On this prompt fp32's top-1 leads its runner-up by >= 0.16 nats at every step and the fp8 rounding
    # of the latent moves a logprob by ~0.1: every token agrees, each logprob within 0.25 of fp32's,
    # and not equal to it (the decode steps really read the fp8 cache).
    assert got.output_ids == want.output_ids and len(got.output_ids) == 6
    drift = [abs(a - b) for a, b in zip(got.logprobs, want.logprobs)]
    assert max(drift) < 0.25 and min(drift) > 0, drift


def test_engine_fp8_activations_option():
    """--fp8-activations reaches the kernel set (auto keeps its own: none on the reference); on
    bf16 fp8 weights "dynamic" quantises the activations (a different product), both generate."""
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="fp8_activations"):
        EngineConfig(fp8_activations="w8a8")
    cfg = EngineConfig(load_format="dummy", preset="tiny", quantization="fp8", dtype="bfloat16",
                       cache_memory_gb=0.01, load_vision=False, backend="reference", device="cpu")
    engines = {mode: Engine(cfg.replace(fp8_activations=mode), log=lambda *a: None) for mode in ("auto", "dynamic")}
    assert engines["auto"].backend.ops.fp8_activations == "none"
    ops = engines["dynamic"].backend.ops
    assert ops.fp8_activations == "dynamic"
    lin = next(m for m in engines["dynamic"].model.modules() if getattr(m, "is_fp8", False) and m.weight.dim() == 2)
    x = torch.randn(3, lin.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    a8 = ops.linear(x, lin.weight, None, lin.weight_scale_inv, lin.block)
    a16 = engines["auto"].backend.ops.linear(x, lin.weight, None, lin.weight_scale_inv, lin.block)
    assert 0 < float((a8.float() - a16.float()).norm() / a16.float().norm()) < 0.1
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for eng in engines.values():
        assert len(eng.generate([list(range(5, 25))], params)[0][0].output_ids) == 3


def test_engine_refuses_before_loading(monkeypatch):
    from glmrt.engine import engine as engine_mod
    from glmrt.engine.config import EngineConfig

    monkeypatch.setattr(engine_mod.Engine, "_load_model", lambda *a: pytest.fail("weights loaded"))
    with pytest.raises(IllegalOption, match="torch only"):
        engine_mod.Engine(EngineConfig(load_format="dummy", preset="tiny", backend="reference", device="cpu",
                                       dsa_decode_backend="triton"))


# ---- glmrt up: refused at start, before anything spawns --------------------------------------------
@pytest.fixture
def up_cli(monkeypatch):
    """cli.main.main for `glmrt up` with the server path booby-trapped: a refusal must come first."""
    from cli import main as cli_main
    from cli import up

    monkeypatch.setattr(up, "embedded_checkpoint", lambda: pytest.fail("got past validation"))
    monkeypatch.setattr(up, "serve", lambda *a, **k: pytest.fail("got past validation"))
    # the same answers whether or not this environment has Triton (CI does not): the hardware
    # adapters' kernel packages count as installed
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: object() if name == "triton" else real(name, *a, **k))

    def run(*argv, hardware="cpu"):
        monkeypatch.setenv("GLMRT_HARDWARE", hardware)
        return cli_main.main(["up", *argv])
    return run


@pytest.mark.parametrize("argv,hardware,needle", [
    (["--dsa-decode-backend", "tilelang"], "sm90", "TileLang"),
    (["--dsa-prefill-backend", "trtllm", "--kv-cache-dtype", "fp8_e4m3"], "sm100", "TRT-LLM"),
    (["--moe-runner-backend", "flashinfer_trtllm"], "sm100", "FlashInfer"),
    (["--attention-backend", "fa4"], "sm90", "FlashAttention 4"),
    (["--kv-cache-dtype", "float32"], "gfx950", "rocm-mi355x caches KV"),
    (["--kv-cache-dtype", "fp8_e5m2"], "sm90", "e5m2"),
    (["--backend", "rocm-mi355x"], "sm90", "this machine is sm90"),
    (["--backend", "cuda-h200"], "cpu", "this machine is cpu"),
    (["--dsa-decode-backend", "triton"], "cpu", "torch only"),
    (["--load-format", "dummy", "--quantization", "nvfp4"], "sm100", "--load-format dummy"),
])
def test_up_refuses_with_the_rule(up_cli, capsys, argv, hardware, needle):
    assert up_cli(*argv, hardware=hardware) == 2
    err = capsys.readouterr().err
    assert err.startswith("glmrt up: error: engine: ") and needle in err and "Rule:" in err and "Alternatives" in err


def test_up_refuses_a_topology_file(up_cli, capsys, tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(textwrap.dedent("""
        [engine]
        dsa_decode_backend = "flashmla_sparse"
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "engine"
        [[actors]]
        kind = "detokenizer"
    """))
    assert up_cli(str(path), hardware="sm90") == 2
    assert "FlashMLA" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_TRITON, reason="cuda-blackwell needs Triton installed to resolve")
def test_up_refuses_pd_pairs_whose_kv_dtypes_differ(up_cli, capsys, tmp_path):
    path = tmp_path / "pd.toml"
    path.write_text(textwrap.dedent("""
        [[actors]]
        kind = "tokenizer"
        [[actors]]
        kind = "prefill"
        engine = { backend = "reference" }
        [[actors]]
        kind = "decode"
        [[actors]]
        kind = "detokenizer"
    """))
    assert up_cli(str(path), hardware="sm100") == 2
    err = capsys.readouterr().err
    assert "KV cache dtype" in err and "bfloat16" in err and "fp8_e4m3" in err


@pytest.mark.skipif(not HAVE_TRITON, reason="cuda-h200 needs Triton installed to resolve")
def test_up_accepts_legal_options(monkeypatch):
    from cli import up
    from cli.main import build_parser

    monkeypatch.setenv("GLMRT_HARDWARE", "sm90")
    args = build_parser().parse_args(["up", "--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "dsa",
                                      "--dsa-decode-backend", "triton", "--moe-runner-backend", "triton"])
    topo = up.build_topology(args)
    cfg = topo.engine_config(topo.actor("engine"))
    assert (cfg.kv_cache_dtype, cfg.dsa_decode_backend, cfg.moe_runner_backend) == ("fp8_e4m3", "triton", "triton")


def test_up_checks_the_checkpoint_weight_format():
    from cli.up import check_checkpoint_weights
    from glmrt.engine.config import EngineConfig

    bf16 = SimpleNamespace(quantization=None)
    mx = SimpleNamespace(quantization=SimpleNamespace(scheme="mxfp4", quant_method="quark"))
    assert check_checkpoint_weights({"engine": EngineConfig(model="x")}, bf16) is None
    assert check_checkpoint_weights({"engine": EngineConfig(model="x", quantization="mxfp4")}, mx) is None
    msg = check_checkpoint_weights({"engine": EngineConfig(model="x", quantization="fp8")}, bf16)
    assert "Rule:" in msg and "re-quantise" in msg and "Alternatives: auto" in msg
    msg = check_checkpoint_weights({"engine": EngineConfig(model="x", quantization="modelopt_fp4")}, mx)
    assert "mxfp4" in msg and "Alternatives: auto, mxfp4" in msg


def test_up_subprocess_fails_fast_without_serving(tmp_path):
    """The real console path: refused with exit 2 in well under the server's start time, nothing spawned."""
    env = {**os.environ, "GLMRT_HARDWARE": "sm90"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cli.main", "up", "--dsa-decode-backend", "tilelang",
                        "--kv-cache-dtype", "fp8_e4m3", "--port", "1"], capture_output=True, text=True, env=env,
                       timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    assert "TileLang" in r.stderr and "Rule:" in r.stderr and "Alternatives" in r.stderr
    assert "serving" not in r.stdout and not (tmp_path / "cache").exists()

"""Hardware adapters: per kernel set, its defaults and its legal option combinations. No torch.

One declarative `Adapter` per backend name (`reference`, `cuda-h200`, `cuda-blackwell`,
`rocm-mi355x`): the hardware it runs on, the default and legal KV-cache dtypes, the weight
formats and how each one runs, the attention / DSA / MoE kernel names it answers to, and
whether it captures decode CUDA graphs. `resolve_options(hardware, requested)` fills the
defaults and refuses an illegal request with `IllegalOption` (a
`BackendError`, re-exported by `backends.registry`) whose message names the rule and the alternatives.
`glmrt up` calls it before any actor starts; the engine calls it again on the hardware it
detects, before it loads weights.

SGLang's recipes for the model pair kernel libraries (TileLang or TRT-LLM DSA, FlashInfer/TRT-LLM
MoE runners, FlashMLA, FA4) with KV dtypes. glmrt ships none of those libraries: asking for
one is refused with what glmrt runs instead. Only what exists in this build is accepted: the
Triton kernels of `backends/kernels/` (DSA decode, fused MoE, KDA, norms, mHC) and the torch
reference for the rest. `cuda-blackwell` and `rocm-mi355x` reuse those portable Triton kernels
and have never run on their hardware; nothing here, or in their modules, claims anything about
speed. Legal means built: chain speculative decoding (EAGLE, from the checkpoint's MTP layer) runs
on every adapter, through the same ops as decoding; DFlash2 drafting and breakable prefill CUDA
graphs are not built, so no adapter accepts them; a request naming them (`speculative_algorithm`,
`cuda_graph_backend_prefill`) is refused with what glmrt runs instead.

`quantization` is the weight format asked for (None: the checkpoint's own). FP4 formats have
no native GEMM here: every adapter dequantises them on load; `preferred_weights` is the format
SGLang's recipes ship for that hardware.

This module imports no torch and no project package, so `glmrt up` (which never loads torch)
can check a request in milliseconds.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Iterable, Mapping


class BackendError(ValueError):
    """A backend that cannot run here, or an illegal combination; the message says why."""


class IllegalOption(BackendError):
    """One refused option: the message names the option, the rule and the legal alternatives."""

    def __init__(self, option: str, value: str, backend: str | None, rule: str, alternatives: Iterable[str]):
        self.option, self.value, self.backend = option, value, backend
        self.rule, self.alternatives = rule, tuple(dict.fromkeys(alternatives))
        where = f" on {backend}" if backend else ""
        alts = ", ".join(self.alternatives) or "none"
        super().__init__(f"{label(option)} {value!r} is refused{where}. Rule: {rule}. Alternatives{where}: {alts}.")


# option -> its `glmrt up` flag. cuda_graph_backend_prefill has none: nothing is built behind it, and a
# request naming it (through the Python API) is refused with what is built.
OPTIONS = {
    "backend": "--backend",
    "kv_cache_dtype": "--kv-cache-dtype",
    "quantization": "--quantization",
    "attention_backend": "--attention-backend",
    "dsa_prefill_backend": "--dsa-prefill-backend",
    "dsa_decode_backend": "--dsa-decode-backend",
    "moe_runner_backend": "--moe-runner-backend",
    "linear_attn_backend": "--linear-attn-backend",
    "speculative_algorithm": "--speculative-algorithm",
    "cuda_graph_backend_prefill": None,
}

WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4", "nvfp4")
"""bf16: unquantised (the model dtype: bf16, fp16 or fp32); fp8: e4m3 with 128x128 block scales
(DeepSeek-V3 convention, the released checkpoint); mxfp4 / nvfp4: SGLang's MI355X / Blackwell
checkpoints."""

_FP4_ON_LOAD = "dequantised to the model dtype on load (no FP4 GEMM kernel in this build; memory as bf16)"

_ALIASES = {
    "kv_cache_dtype": {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                       "float": "float32", "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"},
    "quantization": {"modelopt_fp4": "nvfp4", "fp8_block": "fp8"},
    "speculative_algorithm": {"eagle": "EAGLE", "nextn": "EAGLE", "mtp": "EAGLE", "dflash": "DFLASH2",
                              "dflash2": "DFLASH2", "none": "none", "off": "none"},
}

# Kernel libraries SGLang's recipes name and glmrt does not ship: refused for every option that
# selects kernels, on every adapter.
NOT_SHIPPED = MappingProxyType({
    "tilelang": "TileLang DSA kernels are not shipped with glmrt (SGLang's recipes pair them with bf16 KV on "
                "H100/H200 and Blackwell and with fp8 KV on MI355X; TileLang DSA with fp8 KV is not a valid CUDA "
                "combination)",
    "trtllm": "TRT-LLM DSA kernels are not shipped with glmrt (SGLang's Blackwell default, paired with fp8 KV; "
              "disabled on H100/H200 and not the MI355X backend)",
    "trtllm_mla": "TRT-LLM MLA kernels are not shipped with glmrt",
    "flashmla": "FlashMLA is not shipped with glmrt (glmrt's sparse MLA is its own Triton kernel)",
    "flashmla_sparse": "FlashMLA is not shipped with glmrt (glmrt's sparse MLA is its own Triton kernel)",
    "flashmla_kv": "FlashMLA is not shipped with glmrt (glmrt's sparse MLA is its own Triton kernel)",
    "cutlass_mla": "CUTLASS MLA kernels are not shipped with glmrt",
    "fa3": "FlashAttention 3 is not shipped with glmrt (GLM-5.3-Flash attention is DSA + KDA)",
    "fa4": "FlashAttention 4 is not shipped with glmrt (in SGLang's recipes it runs only the DFlash2 draft)",
    "flashinfer": "FlashInfer is not shipped with glmrt",
    "aiter": "AITER (ROCm kernels) is not shipped with glmrt",
    "deepgemm": "DeepGEMM is not shipped with glmrt",
    "deep_gemm": "DeepGEMM is not shipped with glmrt",
    "flashinfer_trtllm": "FlashInfer's TRT-LLM MoE runner (SGLang's Blackwell/H200 recipes) is not shipped with "
                         "glmrt",
    "flashinfer_cutlass": "FlashInfer's CUTLASS MoE runner is not shipped with glmrt",
    "flashinfer_mxfp4": "FlashInfer's MXFP4 MoE runner is not shipped with glmrt",
    "flashinfer_cutedsl": "FlashInfer's CuTe-DSL MoE runner is not shipped with glmrt",
    "cutlass": "CUTLASS MoE kernels are not shipped with glmrt",
    "triton_kernel": "the triton_kernels MoE package is not shipped with glmrt",
})
_KERNEL_OPTIONS = ("attention_backend", "dsa_prefill_backend", "dsa_decode_backend", "moe_runner_backend",
                   "linear_attn_backend")

_NO_SPECULATIVE = ("only chain drafting from the checkpoint's MTP layer is built (EAGLE; NEXTN and MTP are its "
                   "other spellings): no DFlash2 or separate draft model")

# Values glmrt knows but does not accept anywhere, with the reason (beyond "not on this adapter").
_NOT_BUILT = {
    ("attention_backend", "triton"): "glmrt's attention is always DSA (MLA layers) + KDA; its Triton kernels are "
                                     "chosen with --dsa-decode-backend triton, the default on the CUDA/ROCm kernel "
                                     "sets",
    ("kv_cache_dtype", "fp8_e5m2"): "glmrt's FP8 KV format is e4m3; e5m2 is not implemented",
    ("kv_cache_dtype", "fp4_e2m1"): "FP4 KV is not implemented",
    ("quantization", "bf16"): "unquantised weights need no --quantization: leave it auto (the checkpoint's format)",
    ("quantization", "bfloat16"): "unquantised weights need no --quantization: leave it auto (the checkpoint's "
                                  "format)",
    **{("speculative_algorithm", algo): _NO_SPECULATIVE for algo in ("DFLASH2", "STANDALONE")},
    ("cuda_graph_backend_prefill", "breakable"): "prefill always runs eagerly; the only CUDA graphs glmrt "
                                                 "builds are decode graphs (glmrt.engine.cuda_graphs)",
}


@dataclass(frozen=True)
class Adapter:
    name: str
    hardware: tuple[str, ...]
    """`registry.detect_hardware()` ids it runs on; () = anywhere."""
    devices: str
    kernels: str
    tested: str
    """What has been run where, in words. No speed claims."""
    default_kv_dtype: str
    """'model' = the model dtype. A 'bfloat16' default follows an fp32/fp16 model (parity runs)."""
    kv_dtypes: tuple[str, ...]
    """Legal KV dtypes besides the model dtype itself (always legal: no conversion)."""
    weights: Mapping[str, str]
    """weight format -> how it runs here. Absent formats are refused on this adapter."""
    preferred_weights: str
    attention_backends: tuple[str, ...]
    dsa_prefill_backends: tuple[str, ...]
    """First entry = what auto resolves to (as for the next three)."""
    dsa_decode_backends: tuple[str, ...]
    moe_runner_backends: tuple[str, ...]
    linear_attn_backends: tuple[str, ...]
    """KDA layers: the causal conv and the delta-rule recurrence."""
    decode_graphs: bool
    module: str | None = None
    """The kernel module, imported lazily by the registry on matching hardware."""
    needs: str | None = None
    """The Python package the kernel module needs."""
    notes: Mapping[str, str] = field(default_factory=dict)
    """option -> why the adapter's list is what it is (used in refusals)."""


_TRITON_NOTES = {
    "dsa_prefill_backend": "DSA prefill (several tokens per request) runs on the torch path by default here; 'triton' "
                           "runs glmrt's per-token indexer + sparse-MLA kernels (validated on the H200 only, hence "
                           "opt-in on this hardware)",
    "dsa_decode_backend": "DSA decode (one token per request) runs on glmrt's Triton indexer + sparse-MLA kernels",
    "moe_runner_backend": "routed experts run on glmrt's Triton fused-MoE kernel (shapes it does not take fall "
                          "back to torch)",
    "linear_attn_backend": "KDA runs on Triton: glmrt's conv kernel and fla-core's recurrence (torch when fla-core "
                           "is not installed)",
}
_FP8_TRITON = ("routed experts in the Triton fused MoE and every other block-scaled linear in glmrt's Triton "
               "w8a16 linear (fp8 tiles widened in the kernel; no fp8 tensor-core GEMM: DeepGEMM is not shipped)")

ADAPTERS: Mapping[str, Adapter] = MappingProxyType({a.name: a for a in (
    Adapter(
        name="reference", hardware=(), devices="any device torch runs on (CPU or GPU)",
        kernels="pure torch, fp32 and bf16: the oracle every fast kernel is tested against",
        tested="CPU in CI; the model parity run on H200 (bench/RESULTS.md)",
        default_kv_dtype="model", kv_dtypes=("float32", "bfloat16", "float16", "fp8_e4m3"),
        weights=MappingProxyType({"bf16": "native (torch matmul)",
                                  "fp8": "dequantised to the model dtype per matmul (torch)",
                                  "mxfp4": _FP4_ON_LOAD, "nvfp4": _FP4_ON_LOAD}),
        preferred_weights="bf16", attention_backends=("dsa",), dsa_prefill_backends=("torch",),
        dsa_decode_backends=("torch",), moe_runner_backends=("torch",), linear_attn_backends=("torch",),
        decode_graphs=False,
        notes=MappingProxyType({
            "dsa_decode_backend": "the reference kernel set is torch only; Triton kernels need --backend cuda-h200, "
                                  "cuda-blackwell or rocm-mi355x on their hardware",
            "dsa_prefill_backend": "the reference kernel set is torch only",
            "moe_runner_backend": "the reference kernel set is torch only",
            "linear_attn_backend": "the reference kernel set is torch only",
        })),
    Adapter(
        name="cuda-h200", hardware=("sm90",), devices="NVIDIA H100 / H200 (SM90)",
        kernels="the reference plus Triton kernels: DSA indexer + sparse-MLA (decode and prefill), MoE router + "
                "fused MoE, KDA (conv, forget gate, gated norm; fla-core's recurrence), RMSNorm, mHC",
        tested="H200: kernels vs the reference (tests/backends), decode step and parity (bench/RESULTS.md)",
        default_kv_dtype="bfloat16", kv_dtypes=("bfloat16", "fp8_e4m3"),
        weights=MappingProxyType({"bf16": "native (torch matmul; Triton fused MoE)",
                                  "fp8": _FP8_TRITON, "mxfp4": _FP4_ON_LOAD, "nvfp4": _FP4_ON_LOAD}),
        preferred_weights="fp8", attention_backends=("dsa",), dsa_prefill_backends=("triton", "torch"),
        dsa_decode_backends=("triton",), moe_runner_backends=("triton",), linear_attn_backends=("triton",),
        decode_graphs=True, module=".cuda_h200",
        needs="triton",
        notes=MappingProxyType({**_TRITON_NOTES,
                                "dsa_prefill_backend": "DSA prefill runs on glmrt's per-token indexer + sparse-MLA "
                                                       "kernels by default (validated on the H200: bench/RESULTS.md; "
                                                       "they read only the selected rows, where the torch path "
                                                       "expands [heads, tokens, context] scores); 'torch' is the "
                                                       "reference",
                                "kv_cache_dtype": "cuda-h200 caches KV in bfloat16 (the default, SGLang's H100/H200 "
                                                  "pairing), fp8_e4m3 (legal, off by default) or the model dtype"})),
    Adapter(
        name="cuda-blackwell", hardware=("sm100",), devices="NVIDIA B200 / GB200 / B300 / GB300 (SM100, SM103)",
        kernels="the cuda-h200 Triton kernels (portable; no Blackwell-specific kernels)",
        tested="never run on Blackwell hardware: selection logic unit-tested on CPU only",
        default_kv_dtype="fp8_e4m3", kv_dtypes=("fp8_e4m3", "bfloat16"),
        weights=MappingProxyType({"bf16": "native (torch matmul; Triton fused MoE)",
                                  "fp8": _FP8_TRITON, "nvfp4": _FP4_ON_LOAD, "mxfp4": _FP4_ON_LOAD}),
        preferred_weights="nvfp4", attention_backends=("dsa",), dsa_prefill_backends=("torch", "triton"),
        dsa_decode_backends=("triton",), moe_runner_backends=("triton",), linear_attn_backends=("triton",),
        decode_graphs=True, module=".cuda_blackwell", needs="triton",
        notes=MappingProxyType({**_TRITON_NOTES,
                                "kv_cache_dtype": "cuda-blackwell caches KV in fp8_e4m3 (the default, SGLang's "
                                                  "Blackwell pairing), bfloat16 or the model dtype"})),
    Adapter(
        name="rocm-mi355x", hardware=("gfx950",), devices="AMD Instinct MI355X (gfx950)",
        kernels="the cuda-h200 Triton kernels through Triton's ROCm backend (no ROCm-specific kernels)",
        tested="never run on MI355X hardware: selection logic unit-tested on CPU only",
        default_kv_dtype="fp8_e4m3", kv_dtypes=("fp8_e4m3", "bfloat16"),
        weights=MappingProxyType({"bf16": "native (torch matmul; Triton fused MoE)",
                                  "fp8": _FP8_TRITON, "mxfp4": _FP4_ON_LOAD, "nvfp4": _FP4_ON_LOAD}),
        preferred_weights="mxfp4", attention_backends=("dsa",), dsa_prefill_backends=("torch", "triton"),
        dsa_decode_backends=("triton",), moe_runner_backends=("triton",), linear_attn_backends=("triton",),
        decode_graphs=True, module=".rocm_mi355x", needs="triton",
        notes=MappingProxyType({**_TRITON_NOTES,
                                "kv_cache_dtype": "rocm-mi355x caches KV in fp8_e4m3 (the default, SGLang's MI355X "
                                                  "recipe), bfloat16 or the model dtype"})),
)})

HARDWARE_ADAPTERS = tuple(a for a in ADAPTERS.values() if a.hardware)
BACKEND_NAMES = tuple(ADAPTERS)


@dataclass(frozen=True)
class Options:
    """A resolved request: every option filled in for one adapter."""

    backend: str
    hardware: str | None
    kv_cache_dtype: str
    """'auto' only when the model dtype is unknown (the reference, checked before the device is)."""
    quantization: str | None
    """None: as the checkpoint stores it."""
    weights: str
    """How the requested weight format runs here (or the checkpoint's, when quantization is None)."""
    attention_backend: str
    dsa_prefill_backend: str
    dsa_decode_backend: str
    moe_runner_backend: str
    linear_attn_backend: str = "torch"
    speculative_algorithm: str = "none"
    cuda_graph_backend_prefill: str = "off"

    def describe(self) -> str:
        return (f"{self.backend} on {self.hardware or 'its hardware'}: KV {self.kv_cache_dtype}, attention "
                f"{self.attention_backend} (prefill {self.dsa_prefill_backend}, decode {self.dsa_decode_backend}), "
                f"MoE {self.moe_runner_backend}, KDA {self.linear_attn_backend}, weights "
                f"{self.quantization or 'as the checkpoint'}")


def label(option: str) -> str:
    flag = OPTIONS.get(option)
    return f"{flag} ({option})" if flag else option


def adapter(name: str) -> Adapter:
    if name not in ADAPTERS:
        raise IllegalOption("backend", name, None, "unknown backend", ["auto", *ADAPTERS])
    return ADAPTERS[name]


def kernels_installed(a: Adapter) -> bool:
    """Whether the adapter's kernel module could import here (its package is installed; never imported)."""
    if a.needs is None:
        return True
    try:
        return importlib.util.find_spec(a.needs) is not None
    except (ImportError, ValueError):
        return False


def _norm(option: str, value) -> str:
    if value is None:
        return "auto"
    v = str(value).strip()
    if v == "" or v.lower() == "auto":
        return "auto"
    canon = _ALIASES.get(option, {}).get(v.lower())
    if canon:
        return canon
    return v.upper() if option == "speculative_algorithm" else v.lower()


def _pick(hardware: str | None, name: str, installed: Callable[[Adapter], bool]) -> Adapter:
    if name == "auto":
        if hardware is None:
            raise BackendError("backend 'auto' needs the hardware: pass detect_hardware() or name a backend")
        for a in HARDWARE_ADAPTERS:
            if hardware in a.hardware and installed(a):
                return a
        return ADAPTERS["reference"]
    a = adapter(name)
    here = [b.name for b in HARDWARE_ADAPTERS if hardware in b.hardware]
    if hardware is not None and a.hardware and hardware not in a.hardware:
        raise IllegalOption("backend", name, None,
                            f"{name} runs on {a.devices}; this machine is {hardware}",
                            ["auto", *here, "reference"])
    if not installed(a):
        raise IllegalOption("backend", name, None,
                            f"{name}'s kernels need the {a.needs!r} package, which is not installed here "
                            "(pip install -e '.[cuda]')", ["auto", "reference"])
    return a


def _default_kv(a: Adapter, model_dtype: str | None) -> str:
    if a.default_kv_dtype == "model" or (a.default_kv_dtype == "bfloat16" and model_dtype in ("float32", "float16")):
        return model_dtype or "auto"
    return a.default_kv_dtype


def _choose(option: str, value: str, a: Adapter, legal: tuple[str, ...], default: str) -> str:
    """`value` if `a` accepts it for `option` ('auto' -> default), else IllegalOption naming the rule."""
    if value == "auto":
        return default
    if value in legal:
        return value
    alternatives = ["auto", *legal]
    if option in _KERNEL_OPTIONS and value in NOT_SHIPPED:
        raise IllegalOption(option, value, a.name, f"kernel libraries glmrt does not ship — {NOT_SHIPPED[value]}",
                            alternatives)
    if (option, value) in _NOT_BUILT:
        raise IllegalOption(option, value, a.name, _NOT_BUILT[(option, value)], alternatives)
    same_kind = _KERNEL_OPTIONS if option in _KERNEL_OPTIONS else (option,)
    known = {v for b in ADAPTERS.values() for o in same_kind for v in _legal_values(b, o)}
    known |= {"float32", "float16"} if option == "kv_cache_dtype" else set()
    if value in known:
        rule = a.notes.get(option) or f"{a.name} accepts {', '.join(legal) or 'none'} for {option}"
        raise IllegalOption(option, value, a.name, rule, alternatives)
    raise IllegalOption(option, value, a.name, f"unknown value for {option}", alternatives)


def _legal_values(a: Adapter, option: str, model_dtype: str | None = None) -> tuple[str, ...]:
    if option == "kv_cache_dtype":
        return tuple(dict.fromkeys((*a.kv_dtypes, *((model_dtype,) if model_dtype else ()))))
    if option == "quantization":
        return tuple(f for f in a.weights if f != "bf16")
    if option == "speculative_algorithm":
        return ("none", "EAGLE")
    if option == "cuda_graph_backend_prefill":
        return ("off",)
    return {"attention_backend": a.attention_backends, "dsa_prefill_backend": a.dsa_prefill_backends,
            "dsa_decode_backend": a.dsa_decode_backends, "moe_runner_backend": a.moe_runner_backends,
            "linear_attn_backend": a.linear_attn_backends}[option]


def resolve_options(hardware: str | None, requested: Mapping[str, object] | None = None, *,
                    model_dtype: str | None = None,
                    installed: Callable[[Adapter], bool] = kernels_installed) -> Options:
    """Fill the defaults of `requested` (option -> value; None or 'auto' = the default) for `hardware`
    (a `registry.detect_hardware()` id; None = assume a named backend's own hardware).

    Raises IllegalOption (a BackendError) naming the option, the rule and the alternatives.
    """
    req = dict(requested or {})
    unknown = sorted(set(req) - set(OPTIONS))
    if unknown:
        raise BackendError(f"unknown backend option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    v = {k: _norm(k, req.get(k)) for k in OPTIONS}
    a = _pick(hardware, v["backend"], installed)
    hw = hardware or (a.hardware[0] if a.hardware else None)
    if model_dtype is None and (a.hardware or hw not in (None, "cpu")):
        model_dtype = "bfloat16"  # dtype auto on a GPU
    elif model_dtype is None and hw == "cpu":
        model_dtype = "float32"   # dtype auto on the CPU
    kv = _choose("kv_cache_dtype", v["kv_cache_dtype"], a, _legal_values(a, "kv_cache_dtype", model_dtype),
                 _default_kv(a, model_dtype))
    quant = None if v["quantization"] == "auto" else v["quantization"]
    if quant is not None:
        _choose("quantization", quant, a, _legal_values(a, "quantization"), quant)
    kw = {opt: _choose(opt, v[opt], a, _legal_values(a, opt), _legal_values(a, opt)[0]) for opt in _KERNEL_OPTIONS}
    spec = _choose("speculative_algorithm", v["speculative_algorithm"], a,
                   _legal_values(a, "speculative_algorithm"), "none")
    graphs = _choose("cuda_graph_backend_prefill", v["cuda_graph_backend_prefill"], a,
                     _legal_values(a, "cuda_graph_backend_prefill"), "off")
    return Options(backend=a.name, hardware=hw, kv_cache_dtype=kv, quantization=quant,
                   weights=a.weights[quant] if quant else "as the checkpoint stores them", **kw,
                   speculative_algorithm=spec, cuda_graph_backend_prefill=graphs)


def check_request(requested: Mapping[str, object], *, model_dtype: str | None = None) -> None:
    """Without the hardware: refuse what no adapter could accept (unknown names, libraries glmrt does
    not ship). A named backend is checked as if on its own hardware. The engine re-checks on the real one."""
    req = dict(requested)
    name = _norm("backend", req.get("backend"))
    if name != "auto":
        resolve_options(None, req, model_dtype=model_dtype, installed=lambda _a: True)
        return
    errors: list[BackendError] = []
    for a in (*HARDWARE_ADAPTERS, ADAPTERS["reference"]):
        try:
            resolve_options(None, {**req, "backend": a.name}, model_dtype=model_dtype, installed=lambda _a: True)
            return
        except BackendError as e:
            errors.append(e)
    first = errors[0]
    if not isinstance(first, IllegalOption):
        raise first
    same = [e for e in errors if isinstance(e, IllegalOption) and e.option == first.option]
    raise IllegalOption(first.option, first.value, None, first.rule + " (refused on every backend)",
                        [alt for e in same for alt in e.alternatives])


def needs_hardware(requested: Mapping[str, object]) -> bool:
    """Whether checking `requested` depends on the machine: a named hardware backend, or `auto` with
    any option set (all-auto requests are legal everywhere by construction)."""
    name = _norm("backend", requested.get("backend"))
    if name == "reference":
        return False
    if name != "auto":
        return True
    return any(_norm(k, v) != "auto" for k, v in requested.items() if k != "backend")


def probe_hardware(timeout: float = 120.0) -> str | None:
    """`registry.detect_hardware()` run in a child interpreter (the caller never imports torch), or None
    when it cannot tell. `GLMRT_HARDWARE` overrides (tests, or a machine whose probe is slow)."""
    forced = os.environ.get("GLMRT_HARDWARE")
    if forced:
        return forced
    try:
        out = subprocess.run([sys.executable, "-c", "from backends.registry import detect_hardware; "
                                                    "print(detect_hardware())"],
                             capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if lines else None


def table() -> list[dict[str, str]]:
    """One row per adapter, for docs and `--help` style listings."""
    rows = []
    for a in ADAPTERS.values():
        rows.append({"backend": a.name, "hardware": "/".join(a.hardware) or "any", "devices": a.devices,
                     "kv default": a.default_kv_dtype, "kv legal": ", ".join(a.kv_dtypes),
                     "weights": ", ".join(f"{k}: {v}" for k, v in a.weights.items()),
                     "dsa": f"prefill {'/'.join(a.dsa_prefill_backends)}, decode {'/'.join(a.dsa_decode_backends)}",
                     "moe": "/".join(a.moe_runner_backends), "kda": "/".join(a.linear_attn_backends),
                     "decode graphs": "yes" if a.decode_graphs else "no", "tested": a.tested})
    return rows

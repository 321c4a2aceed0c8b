"""Session-wide test setup."""

from bench.hf_reference import import_hf_torch_kda

# The HF oracle runs on the CPU here: keep its torch KDA even when fla-core (the `cuda`
# extra, GPU-only Triton kernels) is installed in the environment.
import_hf_torch_kda()

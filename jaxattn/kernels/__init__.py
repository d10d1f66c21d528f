"""Kernel backends of the attention op. One module per backend, forward and backward
side by side: :mod:`jaxattn.kernels.pallas_triton` (forward, decode) and
:mod:`jaxattn.kernels.pallas_triton_vjp` (backward)."""

"""jaxattn for PyTorch tensors (DESIGN.md section 6): the same registry contract, zero-copy
DLPack in both directions, and a backward that runs the JAX backward.

    op = torch_bridge.get_op("attention")          # or "cp_attention"
    out = op(q, k, v, causal=True)                 # torch tensors [B, H, S, D]
    out, lse = op.forward_with_lse(q, k, v)
    out.float().sum().backward()                   # the deterministic JAX backward
    out = torch_bridge.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
                                                   # packed [T, H, D] (flash_attn_varlen_func)

The bridge holds no math: conversion, caching of the jitted JAX functions, and autograd
plumbing through a ``torch.library.custom_op`` (so ``torch.compile(fullgraph=True)``
traces through it). See docs/torch_bridge.md for what is copied and when.
"""

from __future__ import annotations

from torch_bridge.bridge import TorchOp
from torch_bridge.ops import get_op, op_names
from torch_bridge.varlen import varlen_attention

__all__ = ["TorchOp", "get_op", "op_names", "varlen_attention"]

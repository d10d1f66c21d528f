"""jaxattn for PyTorch tensors (DESIGN.md section 6): the same registry contract, zero-copy
DLPack in both directions, and a backward that runs the JAX backward.

    op = torch_bridge.get_op("attention")          # or "cp_attention"
    out = op(q, k, v, causal=True)                 # torch tensors [B, H, S, D]
    out, lse = op.forward_with_lse(q, k, v)
    out.float().sum().backward()                   # the deterministic JAX backward

The bridge holds no math: conversion, caching of the jitted JAX functions, and autograd
plumbing through a ``torch.library.custom_op`` (so ``torch.compile(fullgraph=True)``
traces through it). See docs/torch_bridge.md for what is copied and when.
"""

from __future__ import annotations

from torch_bridge.bridge import TorchOp, get_op, op_names

__all__ = ["TorchOp", "get_op", "op_names"]

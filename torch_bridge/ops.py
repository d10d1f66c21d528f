"""The bridge's ops by name: ``torch_bridge.get_op``."""

from __future__ import annotations

from torch_bridge.bridge import TorchOp
from torch_bridge.paged import PagedOp

_OPS = ("attention", "cp_attention", "paged_attention")


def op_names() -> tuple[str, ...]:
    return _OPS


def get_op(name: str = "attention", *, backend: str | None = None):
    """The op ``name`` for torch tensors: "attention" or "cp_attention" (a
    :class:`~torch_bridge.bridge.TorchOp`), or "paged_attention"
    (:class:`~torch_bridge.paged.PagedOp`: a paged KV cache, forward only).

    Raises:
      KeyError: an unknown name (the message lists the known ones).
    """
    if name not in _OPS:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(_OPS)}")
    if name == "paged_attention":
        return PagedOp(backend)
    return TorchOp(name, backend)

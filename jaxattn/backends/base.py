"""The backend interface: every path of jaxattn asks a backend the same questions.

A backend is one object (a subclass of :class:`Backend`) that implements, for the paths
it serves, the same methods:

* ``forward_with_lse``: attention on the canonical schedule (or, for the reference, in
  plain ``jax.numpy``), differentiable; optional per-sequence causal offsets;
  ``forward_with_lse_btnh`` the same on JAX's ``[B, S, H, D]`` layout (the default
  transposes; kernels that read that layout in place override it);
* ``backward``: the gradients from saved residuals ``(out, lse)``, without a recomputed
  forward (what the torch bridge's autograd runs);
* ``split_states`` / ``split_segment`` / ``fold_states`` / ``backward_over_ranges``: the
  per-SPLIT partial states of a key range, a piece of a split continued from the
  running state of the piece before it, their fold in ascending key order, and the
  backward over key ranges in ascending order (what context parallelism on one device
  needs);
* ``delta`` / ``key_gradients`` / ``query_gradients``: the backward's pieces that a
  device of a mesh computes for its own keys and its own queries (the "cp_mesh" path);
* ``paged_forward``: attention against a paged KV cache;
* ``varlen_forward`` / ``varlen_backward``: packed sequences (FlashAttention's
  ``cu_seqlens`` layout); the default places each sequence in a row of its own and runs
  ``forward_with_lse`` / ``backward`` (:mod:`jaxattn.layout`).

``available()`` says whether the backend runs in this process and ``unsupported(dims,
path)`` whether it serves a call's shapes on a path; ``paths`` declares which paths it has
at all. Ops (:mod:`jaxattn`, :mod:`jaxattn.paged`, :mod:`jaxattn.cp`, the torch bridge,
the harness) resolve a backend through :mod:`jaxattn.registry` and call these methods; they
never name a backend. A backend that cannot serve a call says why, and the op raises:
nothing is ever handed to another backend (that would change the bits).

Layering: ops above :mod:`jaxattn.registry`, the registry above the backends, the
backends above :mod:`jaxattn.schedule`, :mod:`jaxattn.merge` and
:mod:`jaxattn.validation`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import layout, merge
from jaxattn.validation import Dims

#: Every path an op may ask a backend for.
PATHS: tuple[str, ...] = ("attention", "backward", "cp", "cp_mesh", "paged", "varlen")

#: ``(out, lse)``: out in the input dtype (fp32 for partial states), lse fp32 natural log.
OutLse = tuple[jax.Array, jax.Array]


class Backend:
    """One implementation of attention, with the paths it serves.

    Attributes:
      name: the backend's name (``backend=`` of every op).
      description: one line for ``repr`` and reports.
      platforms: the JAX platforms it runs on ("cpu", "gpu", "tpu").
      priority: per platform, its rank for the automatic choice (lower first); a
        platform absent here is never chosen automatically (explicit ``backend=`` only).
      follows_schedule: it computes on the canonical schedule, so it promises every row
        of the invariance matrix (else the first two: a row alone vs in a batch, run to
        run).
      paths: the paths it has (a subset of :data:`PATHS`); ``unsupported`` refuses the
        others by name.
    """

    name: str = ""
    description: str = ""
    platforms: tuple[str, ...] = ()
    priority: Mapping[str, int] = {}
    follows_schedule: bool = True
    paths: frozenset[str] = frozenset(("attention", "backward", "cp", "paged", "varlen"))

    def __repr__(self) -> str:
        return f"<jaxattn backend {self.name!r}: {self.description}>"

    # ------------------------------------------------------------------ capability

    def serving(self, dtype) -> Backend:
        """The backend whose kernels serve a call of ``dtype`` (itself, unless it hands
        a dtype its kernels lack to another backend's kernels on every path: the
        ``mosaic`` backend's fp32 calls are the ``pallas`` kernels'). Ops that combine
        several methods (CP's states and their fold) use this one."""
        return self

    def available(self) -> str | None:
        """None when the backend runs in this process, else the reason it does not."""
        return None

    def unsupported(self, dims: Dims, path: str = "attention", *,
                    page_size: int | None = None) -> str | None:
        """Why the backend cannot serve a call of ``dims`` on ``path`` (``page_size``: the
        paged cache's), or None. The op raises the reason as ValueError."""
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; paths: {', '.join(PATHS)}")
        if path not in self.paths:
            return f"backend {self.name!r} has no {path} path"
        return None

    # ------------------------------------------------------------------- attention

    def forward_with_lse(self, q, k, v, *, causal: bool, scale: float,
                         key_padding_mask=None, causal_offsets=None) -> OutLse:
        """``(out [B, Hq, Sq, D] q.dtype, lse [B, Hq, Sq] fp32)``, differentiable.

        ``scale`` is resolved (a float). ``causal_offsets`` (``[B]`` int, or None for
        ``Skv - Sq``): with ``causal``, key j is visible to query i of sequence b iff
        ``j <= i + causal_offsets[b]``."""
        raise NotImplementedError

    def forward_with_lse_btnh(self, q, k, v, *, causal: bool, scale: float,
                              key_padding_mask=None, causal_offsets=None) -> OutLse:
        """:meth:`forward_with_lse` on JAX's layout (``jax.nn.dot_product_attention``'s
        BTNH): ``q [B, Sq, Hq, D]``, ``k, v [B, Skv, Hkv, D]`` -> ``(out [B, Sq, Hq, D],
        lse [B, Hq, Sq] fp32)``, differentiable, the bits of :meth:`forward_with_lse` on
        the transposed inputs. The default transposes q, k, v and out (XLA copies, and
        their transposes in the gradient); a backend whose kernels read the layout in
        place overrides it."""
        def t(x):
            return jnp.swapaxes(x, 1, 2)

        out, lse = self.forward_with_lse(t(q), t(k), t(v), causal=causal, scale=scale,
                                         key_padding_mask=key_padding_mask,
                                         causal_offsets=causal_offsets)
        return t(out), lse

    def forward_fp32_with_lse(self, q, k, v, **kw) -> OutLse:
        """The same backend on fp32-upcast inputs: fp32 ``(out, lse)``."""
        f32 = jnp.float32
        return self.forward_with_lse(q.astype(f32), k.astype(f32), v.astype(f32), **kw)

    def backward(self, q, k, v, key_padding_mask, out, lse, d_out, d_lse, *, causal: bool,
                 scale: float, causal_offsets=None):
        """``(dq, dk, dv)`` from the forward's residuals ``(out, lse)`` and the cotangents
        of both (``d_lse`` may be None). The default differentiates ``forward_with_lse``
        (it recomputes the forward); kernel backends run their backward kernels."""
        kw = dict(causal=causal, scale=scale, key_padding_mask=key_padding_mask,
                  causal_offsets=causal_offsets)
        _, vjp = jax.vjp(lambda q, k, v: self.forward_with_lse(q, k, v, **kw), q, k, v)
        if d_lse is None:
            d_lse = jnp.zeros(lse.shape, jnp.float32)
        return vjp((d_out.astype(out.dtype), d_lse))

    # ------------------------------------------------------------------------- CP

    def split_states(self, q, k, v, key_padding_mask, causal_offsets, *, causal: bool,
                     scale: float) -> OutLse:
        """The partial states of the keys ``k, v`` for every query row, one per SPLIT of
        keys in ascending order: ``(out [n, B, Hq, Sq, D] fp32, lse [n, B, Hq, Sq])``.
        ``causal_offsets [B]`` int: position of query 0 minus position of key 0. The lse
        is in the backend's own representation; only :meth:`fold_states` reads it."""
        raise NotImplementedError

    #: Whether :meth:`split_segment` carries the kernels' running state across a cut
    #: inside a SPLIT (else CP merges the normalised states of the two sides there).
    carries_split_state: bool = False

    def split_segment(self, q, k, v, key_padding_mask, causal_offsets, carry, *,
                      causal: bool, scale: float, finish: bool):
        """The keys ``k, v`` of one piece of a SPLIT (at most SPLIT keys: the split's
        start, or the keys right after an earlier piece), folded on from the earlier
        piece's running state ``carry`` (None at the split's start) as one kernel folds
        the whole split. With ``finish``: the split's state ``(out [1, B, Hq, Sq, D],
        lse [1, B, Hq, Sq])`` as :meth:`split_states` gives it; else the running state
        (the backend's own pytree) for the next piece. Pieces cut at multiples of
        BLOCK_N give the one call's bits. Only where :attr:`carries_split_state`."""
        raise NotImplementedError(f"backend {self.name!r} carries no running state")

    def fold_states(self, outs, lses, *, natural: bool = True) -> OutLse:
        """Partial states stacked on the leading axis (ascending key ranges) folded left
        to right into one ``(out fp32, lse natural log)``; ``natural=False``: the lse in
        the states' own form (the same here: these states' lse is natural-log)."""
        del natural
        return merge.fold(outs, lses)

    def fold_on(self, state, q, k, v, key_padding_mask, causal_offsets, *, causal: bool,
                scale: float, finish: bool = False):
        """The keys ``k, v`` (a run of whole SPLITs of the one call, from a SPLIT
        boundary) folded onto ``state``, the fold of the one call's earlier splits (``(out
        [B, Hq, Sq, D] fp32, lse [B, Hq, Sq])`` in the states' form of
        :meth:`split_states`; None: none), split after split as the one call folds them.
        Returns the folded state in that form, or with ``finish`` what
        :meth:`finish_state` gives of it (the last keys of the call).
        ``causal_offsets`` may be a Python int: one offset for every sequence, known when
        tracing (a kernel may specialise on it). The default folds :meth:`split_states`
        onto it with :meth:`merge_into`; a backend may do it in one kernel."""
        if isinstance(causal_offsets, (int, np.integer)):
            causal_offsets = jnp.full((q.shape[0],), int(causal_offsets), jnp.int32)
        outs, lses = self.split_states(q, k, v, key_padding_mask, causal_offsets,
                                       causal=causal, scale=scale)
        state = self.merge_into(state, outs, lses)
        return self.finish_state(state, q.dtype) if finish else state

    def fold_window(self, state, q, k, v, key_padding_mask, *, rows: tuple[int, int],
                    keys: tuple[int, int], finish_rows: int, offset: int, causal: bool,
                    scale: float):
        """:meth:`fold_on` of query rows ``rows = (r0, r1)`` of ``q`` against keys ``keys
        = (x, y)`` of ``k, v`` (a run of whole SPLITs of the one call, from a SPLIT
        boundary) with one static causal ``offset`` (row ``r0 + i`` sees key ``x + j``
        iff ``j <= i + offset``), onto ``state``, the folded state of exactly these rows
        (None: none). Rows ``[r0, r0 + finish_rows)`` are finished as :meth:`fold_on`'s
        ``finish`` gives them, the others stay states. Returns ``(finished (out, lse) or
        None, state or None)``: context parallelism's range-major fold, one launch per
        key range over every query shard that sees it. The default slices the window
        and calls :meth:`fold_on` (a backend may read the window in place)."""
        (r0, r1), (x, y) = rows, keys
        n = r1 - r0
        qs, ks, vs = q[:, :, r0:r1], k[:, :, x:y], v[:, :, x:y]
        ms = None if key_padding_mask is None else key_padding_mask[:, x:y]
        res = self.fold_on(state, qs, ks, vs, ms, int(offset), causal=causal, scale=scale,
                           finish=finish_rows == n)
        if finish_rows == n:
            return res, None
        if finish_rows == 0:
            return None, res
        f = finish_rows
        done = self.finish_state((res[0][:, :, :f], res[1][:, :, :f]), q.dtype)
        return done, (res[0][:, :, f:], res[1][:, :, f:])

    def merge_into(self, state, outs, lses):
        """The states ``outs [n, ...], lses [n, ...]`` (ascending key ranges, in
        :meth:`split_states`' form) folded onto ``state`` (that form; None: the empty
        state), left to right by :meth:`fold_states` (an empty state's merge gives the
        other state's bits back)."""
        if state is not None:
            outs = jnp.concatenate([state[0][None], outs])
            lses = jnp.concatenate([state[1][None], lses])
        return self.fold_states(outs, lses, natural=False)

    def finish_state(self, state, dtype) -> OutLse:
        """A folded state of :meth:`fold_on` / :meth:`merge_into` as the call's result:
        ``(out in dtype, lse natural log)``."""
        return state[0].astype(dtype), state[1]

    def backward_over_ranges(self, q, k, v, key_padding_mask, out, lse, d_out, d_lse, *,
                             ranges: Sequence[tuple[int, int]], offsets, causal: bool,
                             scale: float):
        """``(dq, dk, dv)`` of attention over all the keys, with the keys taken in the
        ascending ``ranges`` (dK/dV per range, dQ continued from range to range, in
        ascending key order). ``offsets [B]`` int: position of query 0 minus position of
        key 0. The default differentiates ``forward_with_lse`` over all the keys."""
        del ranges
        return self.backward(q, k, v, key_padding_mask, out, lse, d_out, d_lse,
                             causal=causal, scale=scale, causal_offsets=offsets)

    # ------------------------------------------------------------------- CP mesh

    def delta(self, out, d_out, d_lse):
        """``rowsum(dO * O) - dlse`` per query row, fp32 ``[B, Hq, Sq]``, in a kernel."""
        raise NotImplementedError(f"backend {self.name!r} has no cp_mesh path")

    def key_gradients(self, q, k, v, key_padding_mask, d_out, lse, delta, *, causal: bool,
                      scale: float, causal_offsets):
        """``(dk, dv)`` of the keys ``k, v`` from every row of ``q`` (its final lse and
        delta), in k's dtype; ``causal_offsets [B]``: position of query 0 minus key 0."""
        raise NotImplementedError(f"backend {self.name!r} has no cp_mesh path")

    def query_gradients(self, q, k, v, key_padding_mask, d_out, lse, delta, *,
                        causal: bool, scale: float, causal_offsets):
        """``dq`` of the rows ``q`` over every key of ``k, v``, in q's dtype."""
        raise NotImplementedError(f"backend {self.name!r} has no cp_mesh path")

    # ---------------------------------------------------------------------- paged

    def paged_forward(self, q, k_pages, v_pages, block_table, seq_lens, *, causal: bool,
                      scale: float, layout: str = "HND") -> OutLse:
        """The last ``Sq`` tokens of each sequence against its paged KV
        (``[num_pages, Hkv, page_size, D]`` with ``layout="HND"``, ``[num_pages,
        page_size, Hkv, D]`` with ``"NHD"``; ``block_table [B, max_pages]`` int32,
        ``seq_lens [B]`` int32). The default gathers the pages into contiguous K and V
        (a copy) and runs :meth:`forward_with_lse` with the keys past each sequence's
        length dropped and per-sequence causal offsets ``seq_lens - Sq``."""
        k, v = (gather_pages(x, block_table, layout) for x in (k_pages, v_pages))
        keep = jnp.arange(k.shape[2])[None, :] < seq_lens[:, None]
        offsets = seq_lens - q.shape[2]
        return self.forward_with_lse(q, k, v, causal=causal, scale=scale,
                                     key_padding_mask=keep,
                                     causal_offsets=offsets if causal else None)

    # --------------------------------------------------------------------- varlen

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool,
                       scale: float, max_seqlen_q: int, max_seqlen_k: int) -> OutLse:
        """Packed sequences (FlashAttention's layout): ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv,
        D]``, sequence n's queries ``cu_seqlens_q[n] .. cu_seqlens_q[n+1] - 1`` and keys
        likewise, each with the bottom-right causal rule. ``max_seqlen_*``: static
        capacities (rows of the padded layout). Returns ``(out [Tq, Hq, D], lse [Tq, Hq])``
        of the packed tokens (zeros and -inf past ``cu_seqlens_q[-1]``). Its gradients are
        :meth:`varlen_backward`'s (:func:`jaxattn.varlen.attention` ties the two).

        The default places each sequence in a row of its own (:func:`jaxattn.layout.
        varlen_plan`: keys from key 0, the queries' first real row on a multiple of 64)
        and runs :meth:`forward_with_lse` with per-sequence causal offsets, so every token
        gets the bits of its sequence alone on a backend that follows the schedule. It
        copies the sequences into that layout and back (gathers)."""
        plan = layout.varlen_plan(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  causal=causal)
        zeros = jnp.zeros_like(plan.q_start)
        qp = jnp.swapaxes(layout.pad_packed(q, cu_seqlens_q, plan.q_start, max_seqlen_q), 1, 2)
        kp, vp = (jnp.swapaxes(layout.pad_packed(x, cu_seqlens_k, zeros, max_seqlen_k), 1, 2)
                  for x in (k, v))
        out, lse = self.forward_with_lse(qp, kp, vp, causal=True, scale=scale,
                                         key_padding_mask=plan.key_padding_mask,
                                         causal_offsets=plan.causal_offsets)
        tq = q.shape[0]
        lse = layout.pack_padded(jnp.swapaxes(lse, 1, 2), cu_seqlens_q, plan.q_start, tq)
        inside = (jnp.arange(tq) < cu_seqlens_q[-1])[:, None]
        return (layout.pack_padded(jnp.swapaxes(out, 1, 2), cu_seqlens_q, plan.q_start, tq),
                jnp.where(inside, lse, -jnp.inf))

    def varlen_backward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, d_out, d_lse,
                        *, causal: bool, scale: float, max_seqlen_q: int,
                        max_seqlen_k: int):
        """``(dq, dk, dv)`` of :meth:`varlen_forward` from its residuals (``out [Tq, Hq,
        D]``, ``lse [Tq, Hq]``) and cotangents, without recomputing the forward: the same
        layout, the padding rows with a zero cotangent and lse = +inf (exact zeros), and
        :meth:`backward` (what the torch bridge's autograd runs)."""
        plan = layout.varlen_plan(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  causal=causal)
        zeros = jnp.zeros_like(plan.q_start)

        def rows(x, fill=0.0):  # packed query-side [Tq, Hq, ...] -> [N, Hq, Lq, ...]
            return jnp.swapaxes(layout.pad_packed_values(x, cu_seqlens_q, plan.q_start,
                                                         max_seqlen_q, fill), 1, 2)

        kp, vp = (jnp.swapaxes(layout.pad_packed_values(x, cu_seqlens_k, zeros, max_seqlen_k,
                                                        0.0), 1, 2) for x in (k, v))
        # Not causal: the forward's causal-with-offset call (which skips the blocks past
        # each sequence's keys) has the non-causal call's forward bits, not its
        # backward's (the Mosaic kernels place rows by causal position), so the backward
        # is the non-causal one, with the keys past each sequence masked.
        dq, dk, dv = self.backward(
            rows(q), kp, vp, plan.key_padding_mask, rows(out), rows(lse, jnp.inf),
            rows(d_out.astype(out.dtype)), None if d_lse is None else rows(d_lse),
            causal=causal, scale=scale,
            causal_offsets=plan.causal_offsets if causal else None)
        return (layout.pack_padded_values(jnp.swapaxes(dq, 1, 2), cu_seqlens_q, plan.q_start,
                                          q.shape[0], 0.0),
                *(layout.pack_padded_values(jnp.swapaxes(g, 1, 2), cu_seqlens_k, zeros,
                                            k.shape[0], 0.0) for g in (dk, dv)))


#: Paged KV layouts: HND ``[num_pages, Hkv, page_size, D]`` (jaxattn's default), NHD
#: ``[num_pages, page_size, Hkv, D]`` (vLLM's and FlashInfer's default).
PAGE_LAYOUTS = ("HND", "NHD")


def check_page_layout(layout) -> None:
    """ValueError naming ``layout`` unless it is one of :data:`PAGE_LAYOUTS`."""
    if layout not in PAGE_LAYOUTS:
        raise ValueError(f"layout must be 'HND' ([num_pages, Hkv, page_size, D]) or 'NHD' "
                         f"([num_pages, page_size, Hkv, D]), got {layout!r}")


def page_dims(pages, layout: str = "HND") -> tuple[int, int, int, int]:
    """``(num_pages, Hkv, page_size, D)`` of a page array in ``layout``."""
    check_page_layout(layout)
    n, x, y, d = pages.shape
    return (n, y, x, d) if layout == "NHD" else (n, x, y, d)


def gather_pages(pages, block_table, layout: str = "HND"):
    """Contiguous ``[B, Hkv, max_pages * page_size, D]`` keys or values from pages
    (``[num_pages, Hkv, page_size, D]``, or ``[num_pages, page_size, Hkv, D]`` with
    ``layout="NHD"``)."""
    g = pages[block_table]  # [B, max_pages, Hkv, page_size, D] (HND)
    if layout == "NHD":  # [B, max_pages, page_size, Hkv, D]
        b, n, p, h, d = g.shape
        return jnp.swapaxes(g.reshape(b, n * p, h, d), 1, 2)
    b, n, h, p, d = g.shape
    return jnp.moveaxis(g, 2, 1).reshape(b, h, n * p, d)


class FunctionBackend(Backend):
    """A backend made of one forward function ``(q, k, v, *, causal, scale,
    key_padding_mask) -> (out, lse)`` and nothing else (the "attention" path only): for
    tests and experiments that register a stand-in."""

    paths = frozenset(("attention", "backward"))
    follows_schedule = False

    def __init__(self, name: str, forward_with_lse, *, platforms=("cpu", "gpu"),
                 priority: Mapping[str, int] | None = None, available=None,
                 follows_schedule: bool = False, description: str = ""):
        self.name = name
        self._fn = forward_with_lse
        self.platforms = tuple(platforms)
        self.priority = dict(priority or {})
        self.follows_schedule = follows_schedule
        self.description = description or f"function backend {name!r}"
        if available is not None:
            self.available = available

    def forward_with_lse(self, q, k, v, *, causal, scale, key_padding_mask=None,
                         causal_offsets=None):
        if causal_offsets is not None:
            raise ValueError(f"backend {self.name!r} takes no causal offsets")
        return self._fn(q, k, v, causal=causal, scale=scale,
                        key_padding_mask=key_padding_mask)

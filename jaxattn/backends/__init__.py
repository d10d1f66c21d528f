"""The backends of jaxattn, one folder each, behind one interface
(:class:`jaxattn.backends.base.Backend`):

* ``reference`` (:mod:`.reference`): plain ``jax.numpy``, the ground truth;
* ``pallas`` (:mod:`.pallas`): Pallas kernels, Triton lowering (sm80+; CPU interpret mode);
* ``triton`` (:mod:`.triton`): the same schedule in raw Triton through jax-triton;
* ``mosaic`` (:mod:`.mosaic`): Pallas Mosaic GPU kernels for Hopper (sm90).

:mod:`.common` holds the kernel helpers the Pallas-family kernels share. A new backend
is a folder here with a ``backend.py`` defining a ``BACKEND`` object, listed in
:func:`builtin`.
"""

from __future__ import annotations


def builtin():
    """The backend objects jaxattn registers at import, in registration order."""
    from jaxattn.backends.mosaic.backend import BACKEND as mosaic
    from jaxattn.backends.pallas.backend import BACKEND as pallas
    from jaxattn.backends.reference import BACKEND as reference
    from jaxattn.backends.triton.backend import BACKEND as triton
    return [reference, pallas, triton, mosaic]

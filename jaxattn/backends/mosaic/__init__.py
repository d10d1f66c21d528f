"""The ``"mosaic"`` backend: Pallas Mosaic GPU kernels for Hopper, forward
(:mod:`.forward`), backward (:mod:`.backward`) and the backend object (:mod:`.backend`).
The kernel modules are imported on first use, so importing jaxattn never depends on
``jax.experimental.pallas.mosaic_gpu``."""

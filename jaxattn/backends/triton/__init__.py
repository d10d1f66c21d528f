"""The ``"triton"`` backend: the canonical schedule in raw Triton (:mod:`.kernels`),
launched from JAX through jax-triton (:mod:`.launch`), and the backend object
(:mod:`.backend`). Optional: needs the ``triton`` extra."""

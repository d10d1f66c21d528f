"""The ``"pallas"`` backend: forward kernels (:mod:`.forward`), backward kernels
(:mod:`.backward`) and the backend object (:mod:`.backend`)."""

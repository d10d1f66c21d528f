"""Diagnostics: the single-device comparison harness (:mod:`jaxattn.testing.comparison`)."""

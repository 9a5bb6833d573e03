"""jax_sdm: Sparse Delta Memory for JAX (SPEC 1): a gated delta-rule memory with sparse keys."""
import importlib

from .ops import sdm_write_read
from .reference import sdm_reference
from .step import sdm_step

__all__ = ["sdm_write_read", "sdm_step", "sdm_reference"]
__version__ = "0.1.0"

# Submodules with optional dependencies, imported on first access (`jax_sdm.nn` needs flax).
_LAZY_SUBMODULES = ("nn",)


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

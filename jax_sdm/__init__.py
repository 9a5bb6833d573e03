"""jax_sdm: Sparse Delta Memory for JAX: a gated delta-rule memory with sparse keys (docs/MATH.md)."""
import importlib
from importlib import metadata as _metadata

from .ops import default_chunk_size, sdm_write_read
from .product_key import product_key_topk
from .reference import sdm_reference
from .step import sdm_step

__all__ = ["sdm_write_read", "sdm_step", "sdm_reference", "default_chunk_size", "product_key_topk"]

try:  # one version number: pyproject.toml's, read from the installed package's metadata
    __version__ = _metadata.version("jax_sdm")
except _metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

# Submodules with optional dependencies, imported on first access (`jax_sdm.nn` needs flax).
_LAZY_SUBMODULES = ("nn",)


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

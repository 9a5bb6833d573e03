"""jax_sdm: Sparse Delta Memory for JAX: a gated delta-rule memory with sparse keys (docs/MATH.md)."""
from importlib import metadata as _metadata

from .ops import sdm_write_read
from .reference import sdm_reference

__all__ = ["sdm_write_read", "sdm_reference"]

try:  # one version number: pyproject.toml's, read from the installed package's metadata
    __version__ = _metadata.version("jax_sdm")
except _metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

"""jax_sdm: Sparse Delta Memory for JAX (SPEC 1): a gated delta-rule memory with sparse keys."""
from .ops import sdm_write_read
from .reference import sdm_reference
from .step import sdm_step

__all__ = ["sdm_write_read", "sdm_step", "sdm_reference"]
__version__ = "0.1.0"

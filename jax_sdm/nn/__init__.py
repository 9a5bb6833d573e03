"""Model code on top of `sdm_write_read`, for Flax NNX: the `SparseDeltaMemory` layer and its addressing.

Needs the optional `nn` extra (`pip install "jax_sdm[nn]"`: flax and optax). `import jax_sdm` does not import
this package; `jax_sdm.nn` does, on first access.
"""
try:
    from flax import nnx as _nnx  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without flax
    raise ImportError('jax_sdm.nn needs flax: install the extra with pip install "jax_sdm[nn]"') from err

from .addressing import balanced_factors, product_key_slots, topk_slots
from .layer import SparseDeltaMemory
from .parallel import head_parallel_specs

__all__ = ["SparseDeltaMemory", "head_parallel_specs", "balanced_factors", "product_key_slots", "topk_slots"]

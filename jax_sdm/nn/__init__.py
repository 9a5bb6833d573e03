"""Model code on top of `sdm_write_read`, for Flax NNX: the `SparseDeltaMemory` layer and its addressing.

Needs the optional `nn` extra (`pip install "jax_sdm[nn]"`: flax and optax). `import jax_sdm` does not import
this package; `jax_sdm.nn` does, on first access.
"""
try:
    from flax import nnx as _nnx  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without flax
    raise ImportError('jax_sdm.nn needs flax: install the extra with pip install "jax_sdm[nn]"') from err

from .addressing import balanced_factors, product_key_slots, topk_slots
from .parallel import head_parallel_specs
from .layer import ACTIVATIONS, SparseDeltaMemory, decode_loop, memory_access_stats, weight_decay_mask
from .reference_checkpoint import load_reference_state_dict

__all__ = ["SparseDeltaMemory", "ACTIVATIONS", "balanced_factors", "decode_loop", "head_parallel_specs",
           "load_reference_state_dict", "memory_access_stats", "product_key_slots", "topk_slots", "weight_decay_mask"]

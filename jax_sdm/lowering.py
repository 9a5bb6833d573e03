"""Registration of the jax_sdm XLA FFI handlers with JAX (nothing else).

``jax_sdm._sdm_cpu`` (always built) provides the ``cpu`` handlers and
``jax_sdm._sdm_cuda`` (built when a CUDA compiler was found) the ``CUDA`` ones.
Each module's ``registrations()`` returns ``{target name: PyCapsule}``; every
capsule is registered once, on import of this module, with
``jax.ffi.register_ffi_target(name, capsule, platform=...)``.

Targets (each on cpu and CUDA): ``sdm_phase1``, ``sdm_phase1_bwd``, ``sdm_solve``, ``sdm_forward``, ``sdm_backward``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import threading

import jax


def _find_extension_dir(name: str) -> str | None:
    """A ``jax_sdm`` directory on ``sys.path`` that holds the built module ``name``.

    ``python -m pytest`` run from a source checkout puts the checkout first on
    ``sys.path``, so its ``jax_sdm/`` (which has no built modules) shadows the
    installed package; the built modules are then found in the installed copy.
    """
    pkg = sys.modules[__package__]
    known = {os.path.realpath(p) for p in pkg.__path__}
    for entry in sys.path:
        d = os.path.realpath(os.path.join(entry or os.getcwd(), __package__))
        if d in known or not os.path.isdir(d):
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if os.path.isfile(os.path.join(d, name + suffix)):
                return d
    return None


def _import_extension(name: str, required: bool):
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError as err:
        d = _find_extension_dir(name)
        if d is not None:
            sys.modules[__package__].__path__.append(d)
            return importlib.import_module(f"{__package__}.{name}")
        if not required:
            return None
        raise ImportError(
            f"{__package__}.{name} (the compiled FFI handlers) is not built or not "
            f"installed: build the package with `pip install --no-build-isolation .` "
            f"(or `-e .`)") from err


_sdm_cpu = _import_extension("_sdm_cpu", required=True)
_sdm_cuda = _import_extension("_sdm_cuda", required=False)  # None: built without CUDA

HAS_CUDA_MODULE: bool = _sdm_cuda is not None

# Whether the CUDA chunk steps launch with programmatic dependent launch (the build option SDM_CUDA_PDL, on by
# default; kernels/chunk_steps.h); None without the CUDA module.
CUDA_PROGRAMMATIC_DEPENDENT_LAUNCH: bool | None = (None if _sdm_cuda is None
                                                   else bool(_sdm_cuda.programmatic_dependent_launch))

# platform name (as jax.ffi.register_ffi_target spells it) -> extension module
_MODULES = {"cpu": _sdm_cpu}
if _sdm_cuda is not None:
    _MODULES["CUDA"] = _sdm_cuda

_lock = threading.Lock()
_registered: dict[str, frozenset[str]] = {}


def register() -> None:
    """Registers every handler of the built modules with JAX. Idempotent."""
    with _lock:
        for platform, module in _MODULES.items():
            if platform in _registered:
                continue
            names = []
            for name, capsule in module.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
                names.append(name)
            _registered[platform] = frozenset(names)


def registered_targets() -> dict[str, frozenset[str]]:
    """``{platform: target names}`` registered so far (``cpu``, ``CUDA``)."""
    with _lock:
        return dict(_registered)


def is_registered(name: str, platform: str = "cpu") -> bool:
    """Whether FFI target ``name`` is registered for ``platform``.

    ``platform`` is ``"cpu"`` or ``"CUDA"``; ``"gpu"``/``"cuda"`` mean ``"CUDA"``.
    """
    key = "CUDA" if platform.lower() in ("cuda", "gpu") else platform.lower()
    with _lock:
        return name in _registered.get(key, frozenset())


register()

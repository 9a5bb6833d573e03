"""Registration of the jax_sdm XLA FFI handlers with JAX, and the targets' interfaces.

``jax_sdm._sdm_cpu`` provides the ``cpu`` handlers and ``jax_sdm._sdm_cuda`` (built when a CUDA compiler was found)
the ``CUDA`` ones. Each module's ``registrations()`` returns ``{target name: PyCapsule}``; every capsule is
registered once, on import of this module, with ``jax.ffi.register_ffi_target(name, capsule, platform=...)``.
Both modules describe the targets, declared once in C++ (ffi/targets.h): ``INTERFACES`` holds each target's
operands, attributes and results in order, and ``phase1_workspace_bytes`` / ``chunk_steps_workspace_floats`` the
sizes of the workspace results. The CPU module also has ``sdm_token_recurrence`` (the CPU's no-grad
forward). Without either module (a source tree that is not built) nothing is registered:
``impl="xla"`` and ``impl="reference"`` still work.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import threading
from typing import NamedTuple

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


def _import_extension(name: str):
    """The built module ``jax_sdm.<name>``, or None where it is not built."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        d = _find_extension_dir(name)
        if d is None:
            return None
        sys.modules[__package__].__path__.append(d)
        try:
            return importlib.import_module(f"{__package__}.{name}")
        except ImportError:
            return None


_sdm_cpu = _import_extension("_sdm_cpu")
_sdm_cuda = _import_extension("_sdm_cuda")

HAS_CPU_MODULE: bool = _sdm_cpu is not None
HAS_CUDA_MODULE: bool = _sdm_cuda is not None

# Whether the CUDA chunk steps launch with programmatic dependent launch (the build option SDM_CUDA_PDL, on by
# default; kernels/chunk_steps.h); None without the CUDA module.
CUDA_PROGRAMMATIC_DEPENDENT_LAUNCH: bool | None = (None if _sdm_cuda is None
                                                   else bool(_sdm_cuda.programmatic_dependent_launch))

# platform name (as jax.ffi.register_ffi_target spells it) -> extension module
_MODULES = {platform: module for platform, module in (("cpu", _sdm_cpu), ("CUDA", _sdm_cuda)) if module is not None}
_DESCRIBED_BY = _sdm_cpu or _sdm_cuda  # both describe the same targets


class Interface(NamedTuple):
    """A target's buffers by name, each group in the handler's order: operands, attributes, results, and the
    optional results that may follow them (a workspace only some platforms use)."""
    args: tuple[str, ...]
    attrs: tuple[str, ...]
    results: tuple[str, ...]
    optional_results: tuple[str, ...]


def _interface(buffers) -> Interface:
    of = lambda kind: tuple(name for k, name in buffers if k == kind)
    return Interface(of("Arg"), of("Attr"), of("Ret"), of("Rest"))


INTERFACES: dict[str, Interface] = ({} if _DESCRIBED_BY is None else
                                    {name: _interface(b) for name, b in _DESCRIBED_BY.interfaces().items()})


def interface(target: str) -> Interface:
    """The buffers of FFI target ``target`` (a name of ``INTERFACES``)."""
    try:
        return INTERFACES[target]
    except KeyError:
        raise NotImplementedError(f"jax_sdm: no FFI target {target!r} in this build (targets: "
                                  f"{', '.join(INTERFACES) or 'none: the extension modules are not built'})") from None


def phase1_workspace_bytes(N: int, C: int, W: int, R: int, backward: bool) -> int:
    """Bytes of the workspace result of ``sdm_phase1`` (``backward``: ``sdm_phase1_bwd``) for ``N`` units."""
    return _DESCRIBED_BY.phase1_workspace_bytes(N, C, W, R, backward)


def chunk_steps_workspace_floats(V, NC, P, C, W, R, K, D, backward: bool) -> int:
    """Floats of the workspace result of ``sdm_forward`` / ``sdm_forward_packed`` (``backward``: the backward's)."""
    return _DESCRIBED_BY.chunk_steps_workspace_floats(V, NC, P, C, W, R, K, D, backward)


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


def layer_decode_rank_limits() -> tuple[int, int]:
    """(factors, k) at most that the layer's decode step ranks in its own kernel call (`sdm_layer_decode_rank_step`;
    kernels/decode_step.h); (0, 0) without a built module."""
    if _DESCRIBED_BY is None:
        return 0, 0
    return int(_DESCRIBED_BY.layer_decode_rank_max_factors), int(_DESCRIBED_BY.layer_decode_rank_max_k)


def is_registered(name: str, platform: str = "cpu") -> bool:
    """Whether FFI target ``name`` is registered for ``platform``.

    ``platform`` is ``"cpu"`` or ``"CUDA"``; ``"gpu"``/``"cuda"`` mean ``"CUDA"``.
    """
    key = "CUDA" if platform.lower() in ("cuda", "gpu") else platform.lower()
    with _lock:
        return name in _registered.get(key, frozenset())


register()

"""The installed package: its metadata (one version number, the licence), and what it offers with and without its
compiled modules."""
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys

import jax_sdm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_is_the_installed_metadata_and_pyproject():
    installed = importlib.metadata.version("jax_sdm")
    assert jax_sdm.__version__ == installed
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert installed == declared


def test_licence_in_metadata():
    meta = importlib.metadata.metadata("jax_sdm")
    assert meta.get("License-Expression") == "Apache-2.0" or "Apache" in (meta.get("License") or ""), dict(meta)
    assert "Apache License" in (ROOT / "LICENSE").read_text()


_NO_MODULES = """
import importlib.abc, json, sys
import numpy as np


class Unbuilt(importlib.abc.MetaPathFinder):  # the compiled modules, as in a source tree that is not built
    def find_spec(self, name, path=None, target=None):
        if name in ("jax_sdm._sdm_cpu", "jax_sdm._sdm_cuda"):
            raise ImportError(name + " is not built")


sys.meta_path.insert(0, Unbuilt())
import jax
jax.config.update("jax_platforms", "cpu")
import jax_sdm
from jax_sdm import kernel_path, lowering

rng = np.random.default_rng(0)
B, T, H, K, D, W, R = 1, 9, 2, 16, 4, 2, 2
args = dict(bank=rng.standard_normal((B, H, K, D)).astype(np.float32),
            k_idx=rng.integers(0, K, (B, T, H, W)), k_val=rng.standard_normal((B, T, H, W)).astype(np.float32),
            v=rng.standard_normal((B, T, H, D)).astype(np.float32), beta=rng.random((B, T, H)).astype(np.float32),
            g=-rng.random((B, T, H)).astype(np.float32), q_idx=rng.integers(0, K, (B, T, H, R)),
            q_val=rng.standard_normal((B, T, H, R)).astype(np.float32))
auto = jax_sdm.sdm_write_read(**args, chunk_size=4)
xla = jax_sdm.sdm_write_read(**args, chunk_size=4, impl="xla")
try:
    jax_sdm.sdm_write_read(**args, impl="ffi")
    error = None
except NotImplementedError as e:
    error = str(e)
print(json.dumps(dict(modules=[lowering.HAS_CPU_MODULE, lowering.HAS_CUDA_MODULE], interfaces=len(lowering.INTERFACES),
                      available=kernel_path.kernels_available(),
                      same=all(bool(np.array_equal(a, b)) for a, b in zip(auto, xla)), error=error)))
"""


def test_imports_and_serves_pure_jax_without_its_compiled_modules():
    """Without the extension modules (a source tree that is not built) the package imports, registers nothing,
    runs impl="auto" as impl="xla", and impl="ffi" says what is missing."""
    out = subprocess.run([sys.executable, "-c", _NO_MODULES], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["modules"] == [False, False] and got["interfaces"] == 0 and not got["available"]
    assert got["same"]
    assert "impl='ffi' has no cpu kernels" in got["error"] and "not built" in got["error"], got["error"]


def test_every_registered_target_is_described():
    """The extension modules describe every target (ffi/targets.h), each with its operands and results; the CPU
    module registers all of them, the CUDA module all but the CPU's own no-grad token recurrence; the kernel
    path's targets are among them."""
    from jax_sdm import kernel_path, lowering

    cpu_only = {"sdm_token_recurrence"}
    if lowering._sdm_cpu is not None:
        assert set(lowering._sdm_cpu.registrations()) == set(lowering.INTERFACES)
    if lowering._sdm_cuda is not None:
        assert set(lowering._sdm_cuda.registrations()) == set(lowering.INTERFACES) - cpu_only
    assert cpu_only <= set(lowering.INTERFACES) or not lowering.INTERFACES
    assert set(kernel_path.KERNEL_TARGETS) <= set(lowering.INTERFACES)
    for name, face in lowering.INTERFACES.items():
        assert face.args and face.results, name
        assert len(set(face.args + face.attrs)) == len(face.args + face.attrs), name

"""Every notebook in `notebooks/` runs from top to bottom without an error.

Each notebook is executed by nbclient in a fresh `python3` kernel. The kernel is pinned to the interpreter that
runs pytest (a kernel spec written to a temporary directory whose command is `sys.executable -m
ipykernel_launcher`), so the notebook imports the same `jax_sdm` and `jax` as the tests, whatever kernel specs
the machine has installed elsewhere. The kernel starts in a temporary directory, not in the repository.
"""
import json
import os
import sys
from pathlib import Path

import pytest

import ipykernel  # noqa: F401  (the kernel; part of the `test` extra)
import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "python3"
TIMEOUT_S = 600

# Appended to each executed copy (never to the file): reports the kernel's interpreter.
_PROBE = "import sys, json; print(json.dumps({'executable': sys.executable, 'prefix': sys.prefix}))"


def _kernel_manager(spec_root):
    """A kernel manager whose `python3` kernel is this interpreter."""
    spec_dir = spec_root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(spec_root / "kernels")], ensure_native_kernel=False)
    resolved = specs.get_kernel_spec(KERNEL_NAME)
    assert resolved.argv[0] == sys.executable, resolved.argv
    return AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.slow  # about 2 minutes for the four; the code they teach has its own tests
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    workdir = tmp_path / "run"
    workdir.mkdir()
    client = NotebookClient(
        nb,
        km=_kernel_manager(tmp_path / "jupyter"),
        kernel_name=KERNEL_NAME,
        timeout=TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(workdir)}},
    )
    # Raises CellExecutionError (with the cell's traceback) on any error. cleanup_kc: shut the kernel down when done
    # (with a kernel manager of ours, nbclient would leave it running, and its memory held, until pytest exits).
    client.execute(cleanup_kc=True)

    errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
              if out.get("output_type") == "error"]
    assert not errors, errors
    probe = [out for out in nb.cells[-1].outputs if out.get("output_type") == "stream"]
    assert probe, nb.cells[-1].outputs
    kernel = json.loads(probe[0]["text"].strip().splitlines()[-1])
    assert os.path.realpath(kernel["executable"]) == os.path.realpath(sys.executable), kernel
    assert os.path.realpath(kernel["prefix"]) == os.path.realpath(sys.prefix), kernel

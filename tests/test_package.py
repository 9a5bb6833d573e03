"""The installed package's metadata: one version number, the licence."""
import importlib.metadata
import pathlib
import re

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

"""The files a user looks for name the package's version: CITATION.cff cites it, CHANGELOG.md describes it."""
import pathlib
import re

import jax_sdm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_citation_cites_this_version():
    text = (ROOT / "CITATION.cff").read_text()
    assert re.search(r"^cff-version: 1\.2\.0$", text, re.M)
    assert re.search(r'^version: "?([^"\n]+)"?$', text, re.M).group(1) == jax_sdm.__version__
    for key in ("message", "title", "authors", "type"):
        assert re.search(rf"^{key}:", text, re.M), key


def test_changelog_describes_this_version():
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == "Unreleased" and jax_sdm.__version__ in headings, headings

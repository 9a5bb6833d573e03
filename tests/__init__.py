"""The jax_sdm test suite (a package, so that its modules share tests/helpers.py)."""

"""The README's model example runs as pasted, and its gradients agree with the token loop's."""
import contextlib
import functools
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import rel_err

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def run_model_example():
    """Execute the README's "A model's view" code as pasted; returns its names and what it printed."""
    section = README.read_text().split("## A model's view", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), scope)  # it builds its parameters and calls the mixer
    return scope, printed.getvalue()


def test_readme_model_example_runs_as_pasted():
    scope, printed = run_model_example()
    H, K, D, d_model, x = scope["H"], scope["K"], scope["D"], scope["d_model"], scope["x"]
    assert printed.strip() == f"{x.shape[:2] + (d_model,)} {(H, K, D)}"
    assert bool(jnp.all(jnp.isfinite(scope["y"]))) and float(jnp.linalg.norm(scope["dbank"])) > 0


@pytest.mark.slow  # the token loop's gradient compiles slowly; the op's gradients are checked in test_oracles.py
def test_readme_model_example_gradients_match_the_token_loop():
    """The example's mixer with the token loop in place of the default impl, at fresh random parameters and inputs
    and on a shorter sequence (the token loop's gradient keeps a bank per token)."""
    scope, _ = run_model_example()
    keys = iter(jax.random.split(jax.random.key(int(np.random.SeedSequence().entropy % 2**31)), 8))
    p = {name: jax.random.normal(next(keys), shape) / shape[0] ** 0.5 for name, shape in scope["shapes"].items()}
    bank = 0.1 * jax.random.normal(next(keys), scope["bank"].shape)
    x = jax.random.normal(next(keys), (2, 16, scope["d_model"]))
    original = scope["sdm_write_read"]

    def loss(p, bank, impl):
        scope["sdm_write_read"] = functools.partial(original, impl=impl)  # the name the example's code looks up
        return jnp.mean(scope["memory_mixer"](p, x, bank) ** 2)

    grads = jax.grad(loss, argnums=(0, 1))(p, bank, "auto")
    want = jax.grad(loss, argnums=(0, 1))(p, bank, "reference")
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert rel_err(g, w) < 1e-4


def test_readme_several_devices_example_runs_as_pasted():
    """The "Several devices" example runs as pasted; its gradient is that of the same layer on unsharded inputs."""
    pytest.importorskip("flax")
    from flax import nnx

    section = README.read_text().split("### Several devices", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    graphdef, params, rest, x = scope["graphdef"], scope["params"], scope["rest"], scope["x"]
    plain = jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(np.asarray(x))[0] ** 2))(
        jax.tree.map(np.asarray, params))
    leaves = jax.tree.leaves(scope["grads"])
    assert leaves and sum(float(jnp.linalg.norm(g)) for g in leaves) > 0
    for g, w in zip(leaves, jax.tree.leaves(plain)):
        assert rel_err(g, w) < 1e-5

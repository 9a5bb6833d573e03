"""The README's model example runs, and its gradients agree with the token loop's."""
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from .helpers import rel_err

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_model_example():
    section = README.read_text().split("## A model's view", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    H, K, D = scope["H"], scope["K"], scope["D"]
    d = 16
    keys = iter(jax.random.split(jax.random.key(int(np.random.SeedSequence().entropy % 2**31)), 8))
    p = {name: 0.1 * jax.random.normal(next(keys), (d, H * m))
         for name, m in (("write_addr", K), ("read_addr", K), ("value", D), ("strength", 1), ("decay", 1))}
    p["out"] = 0.1 * jax.random.normal(next(keys), (H * D, d))
    x = jax.random.normal(next(keys), (2, 20, d))
    bank = 0.1 * jax.random.normal(next(keys), (H, K, D))

    original = scope["sdm_write_read"]

    def loss(p, bank, impl):
        scope["sdm_write_read"] = functools.partial(original, impl=impl)  # the name the example's code looks up
        return jnp.mean(scope["memory_mixer"](p, x, bank) ** 2)

    grads = jax.grad(loss, argnums=(0, 1))(p, bank, "auto")
    want = jax.grad(loss, argnums=(0, 1))(p, bank, "reference")
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert rel_err(g, w) < 1e-4

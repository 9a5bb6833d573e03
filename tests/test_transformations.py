"""Which JAX transformations each `impl` serves (the README's table), and the errors for those it does not.

The kernel path (`impl="ffi"`, also `"auto"`) is differentiable in reverse mode only: forward mode and higher
order raise a `NotImplementedError` that names `sdm_write_read` and the impls that serve them. The pure-JAX paths
serve them; here they are checked against the token loop in float64.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import FLOAT_ARGS, rel_err


def _seed():
    return int(np.random.SeedSequence().entropy % 100_000)


def _problem(seed, dtype=np.float32):
    return random_problem(seed, B=1, T=6, H=1, K=6, D=3, W=2, R=2, distinct=False, dtype=dtype)


def _loss(impl, args, floats):
    """A scalar of all outputs, non-linear in them (so that its Hessian is not zero)."""
    y, final = sdm_write_read(**{**args, **floats}, chunk_size=4, impl=impl)
    return jnp.sum(jnp.sin(y)) + jnp.sum(final ** 2)


def _floats(args):
    return {k: jnp.asarray(args[k]) for k in FLOAT_ARGS}


FORWARD_MODE = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
    "jacfwd": lambda f, x: jax.jacfwd(f)(x),
    "jit of jvp": lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
}
HIGHER_ORDER = {
    "grad of grad": lambda f, x: jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x),
    "hessian": lambda f, x: jax.hessian(f)(x),
    "jit of jvp of grad": lambda f, x: jax.jit(lambda x: jax.jvp(jax.grad(f), (x,), (x,)))(x),
}


@pytest.mark.parametrize("impl", ["ffi", "auto"])
@pytest.mark.parametrize("how", list(FORWARD_MODE))
def test_kernel_path_refuses_forward_mode(impl, how):
    args = _problem(_seed())
    f = lambda v: _loss(impl, args, {"v": v})
    with pytest.raises(NotImplementedError, match=r"sdm_write_read.*forward-mode.*impl='xla'.*impl='reference'"):
        FORWARD_MODE[how](f, jnp.asarray(args["v"]))


@pytest.mark.parametrize("how", list(HIGHER_ORDER))
def test_kernel_path_refuses_higher_order(how):
    args = _problem(_seed())
    f = lambda v: _loss("ffi", args, {"v": v})
    with pytest.raises(NotImplementedError, match=r"sdm_write_read.*higher-order.*impl='xla'.*impl='reference'"):
        HIGHER_ORDER[how](f, jnp.asarray(args["v"]))


def test_kernel_path_serves_reverse_mode_transformations():
    """`jax.jacrev`, `jax.grad` of `jax.checkpoint`, `jax.vmap` of `jax.grad`: as the token loop."""
    seed = _seed()
    args = _problem(seed)
    floats = _floats(args)
    fy = lambda impl, v: sdm_write_read(**{**args, "v": v}, chunk_size=4, impl=impl)[0]
    assert rel_err(jax.jacrev(functools.partial(fy, "ffi"))(floats["v"]),
                   jax.jacrev(functools.partial(fy, "reference"))(floats["v"])) < 1e-5, seed

    half = {k: 0.5 * floats[k] for k in FLOAT_ARGS}
    want = jax.grad(functools.partial(_loss, "reference", args))(half)
    got = jax.grad(jax.checkpoint(functools.partial(_loss, "ffi", args)))(half)
    batched = {k: jnp.stack([floats[k], half[k]]) for k in FLOAT_ARGS}
    got_vmap = jax.vmap(jax.grad(functools.partial(_loss, "ffi", args)))(batched)
    for k in FLOAT_ARGS:
        assert rel_err(got[k], want[k]) < 1e-5, (seed, k)
        assert rel_err(got_vmap[k][1], want[k]) < 1e-5, (seed, k)


def test_xla_serves_forward_mode_and_second_order():
    """`impl="xla"`: `jax.jvp` and a Hessian-vector product (forward over reverse) agree with the token loop."""
    seed = _seed()
    with jax.enable_x64(True):
        args = _problem(seed, np.float64)
        floats = _floats(args)
        rng = np.random.default_rng(seed + 1)
        tangents = {k: jnp.asarray(rng.standard_normal(np.shape(a))) for k, a in floats.items()}

        @functools.partial(jax.jit, static_argnums=0)
        def jvp(impl):
            return jax.jvp(lambda f: sdm_write_read(**{**args, **f}, chunk_size=4, impl=impl), (floats,),
                           (tangents,))[1]

        @functools.partial(jax.jit, static_argnums=0)
        def hvp(impl):
            return jax.jvp(jax.grad(functools.partial(_loss, impl, args)), (floats,), (tangents,))[1]

        (dy, dfinal), (dy_ref, dfinal_ref) = jvp("xla"), jvp("reference")
        assert dy.dtype == jnp.float64
        assert rel_err(dy, dy_ref) < 1e-9 and rel_err(dfinal, dfinal_ref) < 1e-9, seed
        h, h_ref = hvp("xla"), hvp("reference")
        for k in FLOAT_ARGS:
            assert rel_err(h[k], h_ref[k]) < 1e-9, (seed, k, rel_err(h[k], h_ref[k]))

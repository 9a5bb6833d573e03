"""`layout.ordered_broadcast`: a broadcast whose gradient sums the copies in one fixed order (docs/MATH.md, "Determinism")."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm.layout import ordered_broadcast


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_ordered_broadcast_forward_and_gradient(axis):
    rng = np.random.default_rng(axis)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    copies = 7
    out, vjp = jax.vjp(lambda x: ordered_broadcast(x, copies, axis), jnp.asarray(a))
    np.testing.assert_array_equal(out, np.broadcast_to(np.expand_dims(a, axis), out.shape))
    assert out.shape[axis] == copies
    ct = rng.standard_normal(out.shape).astype(np.float32)
    (grad,) = vjp(jnp.asarray(ct))
    want = np.take(ct, 0, axis)
    for n in range(1, copies):  # copy 0 first, then 1, 2, ... in float32
        want = want + np.take(ct, n, axis)
    np.testing.assert_array_equal(grad, want)


def test_ordered_broadcast_bfloat16_sums_in_float32():
    rng = np.random.default_rng(3)
    copies = 64
    ct = rng.standard_normal((copies, 4, 6)).astype(np.float32)
    ct_bf16 = jnp.asarray(ct, jnp.bfloat16)
    _, vjp = jax.vjp(lambda x: ordered_broadcast(x, copies, 0), jnp.zeros((4, 6), jnp.bfloat16))
    (grad,) = vjp(ct_bf16)
    assert grad.dtype == jnp.bfloat16
    exact = np.asarray(ct_bf16, np.float64).sum(0)
    # One rounding to bfloat16 at the end: within half an ulp (2^-8 relative) of the exact sum.
    np.testing.assert_allclose(np.asarray(grad, np.float64), exact, rtol=2.0 ** -8, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 2])
def test_differentiable_ordered_broadcast_same_gradient_and_forward_mode(axis):
    """The pure-JAX paths' variant: the gradient of `ordered_broadcast` (a chain of adds too, in the order of JAX's
    transpose, which may differ between jax versions: equal up to rounding), and a JVP (forward mode)."""
    from jax_sdm.layout import differentiable_ordered_broadcast

    rng = np.random.default_rng(10 + axis)
    a = jnp.asarray(rng.standard_normal((3, 5)).astype(np.float32))
    copies = 9
    out, vjp = jax.vjp(lambda x: differentiable_ordered_broadcast(x, copies, axis), a)
    want_out, want_vjp = jax.vjp(lambda x: ordered_broadcast(x, copies, axis), a)
    np.testing.assert_array_equal(out, want_out)
    ct = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32))
    np.testing.assert_allclose(jax.jit(vjp)(ct)[0], jax.jit(want_vjp)(ct)[0], rtol=1e-6, atol=1e-6)
    t = jnp.asarray(rng.standard_normal(a.shape).astype(np.float32))
    _, tangent = jax.jvp(lambda x: differentiable_ordered_broadcast(x, copies, axis), (a,), (t,))
    np.testing.assert_array_equal(tangent, np.broadcast_to(np.expand_dims(t, axis), out.shape))

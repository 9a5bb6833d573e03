"""`sdm_step` (one token per stream, the bank updated in place) against `sdm_write_read` on the same token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jax_sdm import sdm_step, sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import assert_one_kernel_call, entry_ops_of_shape, rel_err

NAMES = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
TOKEN = ("k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
IMPLS = ("auto", "ffi", "xla", "reference")

CASES = {
    "distinct": dict(B=2, H=3, K=64, D=16, W=4, R=3),
    "repeats_per_write_gates": dict(B=2, H=2, K=8, D=8, W=6, R=5, distinct=False, repeats=True,
                                    per_write_gates=True),
    "repeats_per_token_gates": dict(B=3, H=1, K=6, D=5, W=7, R=9, distinct=False, repeats=True),
    "shared_bank": dict(B=3, H=2, K=16, D=8, W=3, R=3, distinct=False, repeats=True, shared_bank=True),
    "bfloat16": dict(B=2, H=2, K=32, D=24, W=5, R=4, distinct=False, repeats=True, dtype=jnp.bfloat16),
    "many_streams": dict(B=8, H=64, K=8, D=128, W=16, R=16, distinct=False),  # the CPU kernel's threads
}


def fresh_seed(base):
    return base + int(np.random.SeedSequence().entropy % 10_000) * 100


def sequence(seed, T, **kw):
    """A random problem of `T` tokens whose reads often hit the same token's written slots (read after write),
    with a few out-of-range ids and hard resets (`g = -inf`)."""
    p = random_problem(seed, T=T, **kw)
    rng = np.random.default_rng(seed)
    K, W, R = p["bank"].shape[-2], p["k_idx"].shape[-1], p["q_idx"].shape[-1]
    hit = rng.random(p["q_idx"].shape) < 0.5
    p["q_idx"] = np.where(hit, np.take_along_axis(p["k_idx"], rng.integers(0, W, p["q_idx"].shape), -1), p["q_idx"])
    p["k_idx"] = np.where(rng.random(p["k_idx"].shape) < 0.1, rng.choice([-1, K, K + 7], p["k_idx"].shape),
                          p["k_idx"]).astype(np.int32)
    p["q_idx"] = np.where(rng.random(p["q_idx"].shape) < 0.1, rng.choice([-3, K], p["q_idx"].shape),
                          p["q_idx"]).astype(np.int32)
    p["g"] = np.where(rng.random(p["g"].shape) < 0.1, -np.inf, p["g"]).astype(np.float32)
    assert R >= 1
    return p


def token(p, t):
    """Token `t` of a problem, in `sdm_step`'s layout."""
    return {k: (v if k == "bank" else v[:, t]) for k, v in p.items()}


def tolerance(p):
    return 1e-2 if p["bank"].dtype == jnp.bfloat16 else 1e-6


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_equals_write_read_on_one_token(case):
    p = sequence(fresh_seed(sorted(CASES).index(case)), T=1, **CASES[case])
    y_ref, bank_ref = jax.jit(lambda a: sdm_write_read(**a, impl="reference"))(p)
    B, H, K, _ = bank_ref.shape
    k_idx = p["k_idx"][:, 0]
    written = np.zeros((B, H, K + 1), bool)
    np.put_along_axis(written, np.where((k_idx >= 0) & (k_idx < K), k_idx, K), True, -1)
    untouched = ~written[..., :K]
    before = np.broadcast_to(np.asarray(p["bank"], np.float32), bank_ref.shape)
    for impl in IMPLS:
        y, bank = jax.jit(lambda a: sdm_step(**a, impl=impl))(token(p, 0))
        assert y.dtype == bank.dtype == p["bank"].dtype, impl
        assert y.shape == y_ref[:, 0].shape and bank.shape == bank_ref.shape, impl
        assert np.all(np.isfinite(np.asarray(y, np.float32))), impl
        assert np.all(np.isfinite(np.asarray(bank, np.float32))), impl
        assert rel_err(y, y_ref[:, 0]) < tolerance(p), (impl, rel_err(y, y_ref[:, 0]))
        assert rel_err(bank, bank_ref) < tolerance(p), (impl, rel_err(bank, bank_ref))
        # Rows that no lane writes are the input's, bit for bit.
        np.testing.assert_array_equal(np.asarray(bank, np.float32)[untouched], before[untouched], err_msg=impl)


@pytest.mark.parametrize("impl", ("ffi", "xla"))
def test_hard_reset_forgets_the_row(impl):
    """`g = -inf` on a token that writes one slot with weight 1: the row becomes beta * v (nothing of before)."""
    p = token(random_problem(fresh_seed(7), T=1, B=2, H=2, K=8, D=6, W=1, R=1), 0)
    p["bank"] = np.full_like(p["bank"], 1e30)
    p["k_val"] = np.ones_like(p["k_val"])
    p["g"] = np.full_like(p["g"], -np.inf)
    p["q_idx"], p["q_val"] = p["k_idx"], np.ones_like(p["q_val"])
    y, bank = sdm_step(**p, impl=impl)
    expected = p["beta"][..., None] * p["v"]
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    rows = np.take_along_axis(np.asarray(bank), p["k_idx"][..., None], 2)[:, :, 0]
    np.testing.assert_allclose(rows, expected, rtol=1e-6)


@pytest.mark.parametrize("impl", ("ffi", "xla", "reference"))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_rollout_equals_the_sequence(impl, dtype):
    """Steps one token at a time (jitted, bank donated) give the readings and final bank of the whole sequence."""
    T = 12
    p = sequence(fresh_seed(11), T=T, B=2, H=2, K=16, D=8, W=4, R=3, distinct=False, repeats=True,
                 per_write_gates=True, dtype=dtype)
    y_ref, bank_ref = sdm_write_read(**p, impl="reference")
    step = jax.jit(lambda bank, tok: sdm_step(bank, **tok, impl=impl), donate_argnums=0)
    bank = jnp.array(p["bank"])
    ys = []
    for t in range(T):
        y, bank = step(bank, {k: v for k, v in token(p, t).items() if k != "bank"})
        ys.append(y)
    # bfloat16: the sequence rounds the bank once at its end, the rollout once per token.
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    assert rel_err(jnp.stack(ys, 1), y_ref) < tol, rel_err(jnp.stack(ys, 1), y_ref)
    assert rel_err(bank, bank_ref) < tol, rel_err(bank, bank_ref)


@pytest.mark.parametrize("impl, dtype", [("ffi", jnp.float32), ("ffi", jnp.bfloat16), ("xla", jnp.float32)])
def test_donated_step_does_not_copy_the_bank(impl, dtype):
    """Jitted with the bank donated, the compiled step updates the bank in place: no op copies the whole bank.
    (Not `xla` with bfloat16 on the CPU: XLA's CPU compiler converts the bank to float32 around a bfloat16
    scatter.)"""
    p = token(random_problem(fresh_seed(3), T=1, B=2, H=3, K=4096, D=8, W=4, R=3, distinct=False,
                             repeats=True, dtype=dtype), 0)
    args = [jax.device_put(p[n], jax.devices("cpu")[0]) for n in NAMES]  # compiled for the CPU
    hlo = jax.jit(lambda *a: sdm_step(*a, impl=impl), donate_argnums=0).lower(*args).compile().as_text()
    assert "input_output_alias" in hlo
    ops = entry_ops_of_shape(hlo, args[0].shape)
    assert ops.count("parameter") == 1, ops
    # Besides views of it, at most one op makes a bank-sized result: the scatter (a fusion) of `xla`; the kernel's
    # custom call returns a tuple (bank, y).
    made = [op for op in ops if op not in ("parameter", "get-tuple-element", "bitcast", "tuple")]
    assert made in ([], ["fusion"], ["scatter"]), ops
    if impl == "ffi":
        assert "custom-call(" in hlo


def test_not_differentiable():
    p = token(random_problem(fresh_seed(5), T=1, B=1, H=2, K=8, D=4, W=2, R=2), 0)
    rest = {k: v for k, v in p.items() if k != "bank"}
    f = lambda bank: sdm_step(bank, **rest)[0].sum()
    bank = jnp.asarray(p["bank"])
    for differentiate in (lambda: jax.grad(f)(bank), lambda: jax.vjp(f, bank),
                          lambda: jax.jvp(f, (bank,), (bank,))):
        with pytest.raises(TypeError, match=r"sdm_step is inference only.*sdm_write_read"):
            differentiate()
    jax.block_until_ready(f(bank))  # no derivative asked: it runs


@pytest.mark.parametrize("impl", ("ffi", "xla"))
def test_vmap(impl):
    """A vmapped step equals the step of each slice; on the kernels it is still one call."""
    problems = [token(random_problem(fresh_seed(s), T=1, B=2, H=2, K=8, D=4, W=3, R=2, distinct=False,
                                     repeats=True), 0) for s in range(3)]
    stacked = [jnp.stack([jnp.asarray(p[n]) for p in problems]) for n in NAMES]
    step = jax.jit(lambda *a: sdm_step(*a, impl=impl))
    y, bank = jax.jit(jax.vmap(step))(*stacked)
    for i in range(3):
        y1, bank1 = step(*[a[i] for a in stacked])
        np.testing.assert_array_equal(y[i], y1)
        np.testing.assert_array_equal(bank[i], bank1)
    if impl == "ffi":
        assert_one_kernel_call(jax.vmap(step), *stacked)


def test_kernel_is_deterministic():
    p = token(sequence(fresh_seed(9), T=1, B=2, H=2, K=16, D=32, W=8, R=8, distinct=False, repeats=True), 0)
    step = jax.jit(lambda a: sdm_step(**a))
    first = step(p)
    for _ in range(2):
        for a, b in zip(step(p), first):
            np.testing.assert_array_equal(a, b)


def test_check_mode():
    """`check=True` makes checkify checks, as `sdm_write_read` does: under `checkify.checkify` of the jitted step the
    error value names `sdm_step` and the problem."""
    p = token(random_problem(fresh_seed(13), T=1, B=1, H=2, K=8, D=4, W=3, R=2, distinct=False), 0)
    op = jax.jit(checkify.checkify(lambda a: sdm_step(**a, check=True)))
    err, out = op(p)
    err.throw()  # good data passes
    jax.block_until_ready(out)
    err, _ = op(dict(p, k_idx=np.full_like(p["k_idx"], 8)))
    with pytest.raises(ValueError, match=r"sdm_step\(check=True\): .*write slot ids \(k_idx\) outside \[0, K=8\)"):
        err.throw()
    err, _ = op(dict(p, v=np.full_like(p["v"], np.nan)))
    with pytest.raises(ValueError, match="non-finite values in `v`"):
        err.throw()


def test_bad_arguments():
    p = {k: jnp.asarray(v) for k, v in token(random_problem(0, T=1, B=2, H=3, K=8, D=4, W=3, R=2), 0).items()}
    with pytest.raises(ValueError, match="`impl` must be one of"):
        sdm_step(**p, impl="fast")
    with pytest.raises(ValueError, match=r"sdm_step: `k_idx` has shape \(2, 1, 3, 3\), expected \[B, H, W\]"):
        sdm_step(**dict(p, k_idx=p["k_idx"][:, None]))
    with pytest.raises(ValueError,
                       match=r"sdm_step: `q_idx` has shape \(2, 2, 2\), expected \[B, H, R\] = \[2, 3, R\]"):
        sdm_step(**dict(p, q_idx=p["q_idx"][:, :2]))
    with pytest.raises(ValueError, match=r"sdm_step: `v` has shape \(2, 3, 5\), expected \[2, 3, 4\]"):
        sdm_step(**dict(p, v=jnp.zeros((2, 3, 5))))
    with pytest.raises(ValueError, match=r"sdm_step: `g` has shape \(2, 3, 2\), expected \[B, H\] = \[2, 3\] "
                                         r"\(per token\) or \[B, H, W\] = \[2, 3, 3\] \(per write\)"):
        sdm_step(**dict(p, g=jnp.zeros((2, 3, 2))))
    with pytest.raises(ValueError, match=r"sdm_step: `beta` has shape \(2,\), expected \[2, 3\]"):
        sdm_step(**dict(p, beta=jnp.zeros(2)))
    with pytest.raises(TypeError, match="sdm_step: `bank` has dtype int32"):
        sdm_step(**dict(p, bank=p["bank"].astype(jnp.int32)))
    with pytest.raises(TypeError, match="sdm_step: `k_val` has dtype bfloat16, expected the bank's dtype float32"):
        sdm_step(**dict(p, k_val=p["k_val"].astype(jnp.bfloat16)))


def test_auto_without_a_kernel_takes_pure_jax(monkeypatch):
    """On a backend without the decode kernel (a TPU), impl="ffi" says so and impl="auto" runs the pure-JAX step:
    the same numbers as impl="xla"."""
    from jax_sdm import step as step_module

    registered = step_module.lowering.is_registered
    monkeypatch.setattr(step_module.lowering, "is_registered",
                        lambda name, platform="cpu": name != step_module.TARGET and registered(name, platform))
    p = token(sequence(fresh_seed(7), 1, **CASES["distinct"]), 0)
    with pytest.raises(NotImplementedError, match=r"sdm_step: impl='ffi' has no .* kernel.*impl='xla'"):
        sdm_step(**p, impl="ffi")
    for a, b in zip(sdm_step(**p, impl="auto"), sdm_step(**p, impl="xla")):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

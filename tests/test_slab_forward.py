"""The no-grad forward's memory and its slabs: off the CPU the chunked kernels run in slabs of chunks
(`kernel_path._forward_in_slabs`), each slab laid out for the kernels on its own, with the bits of the forward that
keeps residuals; on the CPU the token recurrence reads the op's arguments as they are. Either way, the public op's
and the layer's no-grad calls have temporaries that do not grow with T."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import kernel_path, layout, sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import kernel_layout

pytestmark = pytest.mark.skipif(not kernel_path.kernels_available(), reason="no kernels for this backend")

NAMES = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
TOKEN_FIELDS = ("k_idx", "k_val", "g", "v", "beta", "q_idx", "q_val")  # the order of `kernel_path.Inputs`


def _args(seed, T, C, dtype, per_write_gates, shared=False):
    p = random_problem(seed, B=2, T=T, H=2, K=32, D=8, W=3, R=2, dtype=dtype, per_write_gates=per_write_gates,
                       distinct=False, repeats=True)
    args = [jnp.asarray(p[n]) for n in NAMES]
    if shared:
        args[0] = args[0][0]
    return args, layout.validate(*args, chunk_size=C)


SLABS = [(40, 4, 8), (37, 4, 12), (64, 8, 16), (30, 5, 5), (33, 8, 64), (33, 8, 3)]


@pytest.mark.parametrize("T, C, slab_tokens", SLABS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_chunked_slabs_equal_the_differentiable_forward(T, C, slab_tokens, dtype):
    """The chunked kernels in slabs (the no-grad forward off the CPU) give the bits of the forward that keeps
    residuals, however the chunks divide into slabs."""
    args, dims = _args(T + 2 * C, T, C, dtype, per_write_gates=(T + 1) % 2, shared=T % 3 == 0)
    inputs = kernel_layout(*args, dims)
    y1, final1, rep1 = jax.jit(lambda i: kernel_path._sdm_kernels_fwd(i, dims.K, save=True)[0])(inputs)
    tokens = kernel_path.Inputs(None, *(args[NAMES.index(n)] for n in TOKEN_FIELDS), None)
    y2, final2, rep2 = jax.jit(lambda b, t: kernel_path._forward_in_slabs(b, t, dims, slab_tokens))(inputs.bank,
                                                                                                 tokens)
    np.testing.assert_array_equal(np.asarray(layout.from_units(y1.astype(inputs.bank.dtype), dims)), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(final1), np.asarray(final2))
    np.testing.assert_array_equal(np.asarray(jnp.sum(rep1, axis=0)), np.asarray(rep2))
    y, final = sdm_write_read(*args, chunk_size=C, impl="reference")
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(y2, np.float32), np.asarray(y, np.float32), atol=tol, rtol=tol)


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="the CPU's no-grad forward does not run in slabs")
@pytest.mark.parametrize("T, C, slab_tokens", SLABS[:3])
def test_public_no_grad_in_slabs_equals_one_slab(T, C, slab_tokens):
    args, dims = _args(T, T, C, jnp.bfloat16, per_write_gates=T % 2)
    run = lambda slab: jax.jit(lambda *a: kernel_path.sdm_ffi(*a, dims, slab_tokens=slab))(*args)
    for a, b in zip(run(T + 1), run(slab_tokens)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _abstract_args(T, dtype, B=2, H=2, K=64, D=32, W=4, R=4):
    S = jax.ShapeDtypeStruct
    return (S((B, H, K, D), dtype), S((B, T, H, W), jnp.int32), S((B, T, H, W), dtype), S((B, T, H, D), dtype),
            S((B, T, H), jnp.float32), S((B, T, H), jnp.float32), S((B, T, H, R), jnp.int32), S((B, T, H, R), dtype))


def _temp_bytes(fn, args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_public_no_grad_memory_flat_in_T(dtype):
    """XLA's temporaries of the public no-grad call (slabs of 64 tokens) do not grow with T; the inputs and the
    outputs do."""
    def temp(T):
        args = _abstract_args(T, dtype)
        dims = layout.validate(*args, chunk_size=8)
        return _temp_bytes(lambda *a: kernel_path.sdm_ffi(*a, dims, slab_tokens=64), args)

    small, large = temp(256), temp(8192)
    assert large <= 1.3 * small + 4096, (small, large)


def test_chunked_slabs_memory_flat_in_T():
    """The chunked kernels in slabs (what the GPU runs), lowered here: their temporaries are a slab's whatever T is,
    while the forward that keeps residuals grows with T (the check can fail)."""
    def temp(T, slabs):
        args = _abstract_args(T, jnp.float32)
        dims = layout.validate(*args, chunk_size=8)
        bank_of = lambda a: a[0].reshape(dims.P, dims.K, dims.D)
        tokens_of = lambda a: kernel_path.Inputs(None, *(a[NAMES.index(n)] for n in TOKEN_FIELDS), None)
        if slabs:
            return _temp_bytes(lambda *a: kernel_path._forward_in_slabs(bank_of(a), tokens_of(a), dims, 64), args)
        return _temp_bytes(lambda *a: kernel_path._sdm_kernels_fwd(kernel_layout(*a, dims), dims.K, save=False)[0],
                           args)

    small, large = temp(256, True), temp(8192, True)
    assert large <= 1.3 * small + 4096, (small, large)
    assert temp(8192, False) > 4 * temp(256, False)


def _platform_targets(traced, platform):
    hlo = traced.lower(lowering_platforms=(platform,)).as_text()
    return set(re.findall(r"stablehlo.custom_call @(\w+)\(", hlo)), "stablehlo.while" in hlo


def test_public_op_and_layer_prefill_take_the_no_grad_forward():
    """A no-grad call longer than a slab, through the public op and through the layer's prefill (a call with a
    state): lowered for the GPU it runs the chunked kernels in a loop of slabs, for the CPU the token recurrence
    alone; a differentiated call runs in one piece."""
    from flax import nnx

    from jax_sdm.nn import SparseDeltaMemory

    T = 2 * kernel_path.NOGRAD_SLAB_TOKENS + 64
    args, _ = _args(5, T, 64, np.float32, per_write_gates=False)
    traced = jax.jit(lambda *a: sdm_write_read(*a, chunk_size=64, impl="ffi")).trace(*args)
    assert _platform_targets(traced, "cuda") == ({"sdm_phase1", "sdm_solve", "sdm_forward_slab"}, True)
    assert _platform_targets(traced, "cpu") == ({"sdm_token_recurrence"}, False)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(sdm_write_read(*args[:3], v, *args[4:], chunk_size=64,
                                                             impl="ffi")[0]))).trace(args[3])
    assert not _platform_targets(grad, "cuda")[1]

    layer = SparseDeltaMemory(16, num_heads=2, slots_per_head=64, num_writes=2, num_reads=2, head_dim=8,
                              impl="ffi", chunk_size=64, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    prefill = jax.jit(lambda p, x, state: nnx.merge(graphdef, p)(x, state=state))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, T, 16)), jnp.float32)
    state = layer.init_state(1)
    cuda_targets, cuda_loop = _platform_targets(prefill.trace(params, x, state), "cuda")
    assert cuda_loop and "sdm_forward_slab" in cuda_targets
    assert "sdm_token_recurrence" in _platform_targets(prefill.trace(params, x, state), "cpu")[0]


def test_slab_refuses_a_carry_not_updated_in_place(monkeypatch):
    """A later slab's carry (the bank and the first steps the earlier slabs left) must arrive aliased to its
    results: a call that would update copies of them is refused with a clear error."""
    from jax_sdm import ffi_ops

    args, dims = _args(int(np.random.SeedSequence().entropy % 2**31), 16, 4, np.float32, per_write_gates=False)
    bank, k_idx, k_val, x, v, beta, q_idx, q_val, _ = kernel_layout(*args, dims)
    p1 = ffi_ops.phase1_ffi(k_idx, k_val, x, q_idx, q_val, dims.K)
    minv = ffi_ops.solve_ffi(p1.A, beta)
    steps = (bank, k_idx, q_idx, v, beta, p1, minv, False)
    first = ffi_ops.forward_ffi(*steps, slab=ffi_ops.ForwardSlab(None, None, False))
    call = ffi_ops._call
    monkeypatch.setattr(ffi_ops, "_call", lambda target, results, aliases=None, **ops: call(target, results, **ops))
    with pytest.raises(Exception, match="carry and first must alias"):
        jax.block_until_ready(ffi_ops.forward_ffi(*steps, slab=ffi_ops.ForwardSlab(first.bank, first.first, True)).y)


def _donated_temp_bytes(fn, args):
    """XLA's temporaries of `fn` jitted with its first argument (the bank) donated."""
    return jax.jit(fn, donate_argnums=0).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("T, C, slab_tokens", SLABS[:4])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_chunked_slabs_in_place_equal_the_fresh_bank(T, C, slab_tokens, dtype):
    """The chunked kernels' no-grad forward in slabs updating the bank in place (`in_place`: the bank aliased to
    every slab's result, a shared bank broadcast first) gives the bits of the fresh final bank's; with the bank
    donated, it needs no bank-sized temporary, which the fresh final bank does."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    args, dims = _args(seed, T, C, dtype, per_write_gates=seed % 2, shared=seed % 3 == 0)
    tokens = kernel_path.Inputs(None, *(args[NAMES.index(n)] for n in TOKEN_FIELDS), None)
    bank = kernel_layout(*args, dims).bank if dims.shared_bank else args[0].reshape(dims.P, dims.K, dims.D)
    run = lambda in_place: lambda b, t: kernel_path._forward_in_slabs(b, t, dims, slab_tokens, in_place)
    fresh = jax.jit(run(False))(bank, tokens)
    in_place = jax.jit(run(True), donate_argnums=0)(jnp.array(bank, copy=True), tokens)
    for a, b in zip(fresh, in_place):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if not dims.shared_bank:
        temp = lambda in_place: _donated_temp_bytes(run(in_place), (bank, tokens))
        assert temp(True) + bank.nbytes <= temp(False), (temp(True), temp(False))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_public_in_place_equals_the_default(dtype):
    """`sdm_write_read(..., in_place=True)`: the same readings and final bank as the default, the donated bank
    updated where it is (no bank-sized temporary, which the default's donated bank needs); not donated, XLA
    copies it and the caller's bank stays as it was."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    T = 3 * 64 + 24
    args, _ = _args(seed, T, 64, dtype, per_write_gates=seed % 2)
    call = lambda in_place: lambda *a: sdm_write_read(*a, chunk_size=16, impl="ffi", in_place=in_place)
    want = jax.jit(call(False))(*args)
    before = np.asarray(args[0]).copy()
    kept = jax.jit(call(True))(*args)
    np.testing.assert_array_equal(np.asarray(args[0]), before)
    donated = jax.jit(call(True), donate_argnums=0)(jnp.array(args[0], copy=True), *args[1:])
    for got in (kept, donated):
        for a, b in zip(want, got):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    temp = lambda in_place: _donated_temp_bytes(call(in_place), args)
    assert temp(True) + args[0].nbytes <= temp(False), (temp(True), temp(False))


def test_in_place_is_ignored_by_a_differentiated_call():
    """A differentiated call keeps the bank for the backward: `in_place` changes none of its results or gradients."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    args, _ = _args(seed, 40, 8, np.float32, per_write_gates=False)

    def loss(in_place):
        def f(bank, v):
            y, final = sdm_write_read(bank, *args[1:3], v, *args[4:], chunk_size=8, impl="ffi", in_place=in_place)
            return jnp.sum(y * y) + jnp.sum(final * final)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    want, got = loss(False)(args[0], args[3]), loss(True)(args[0], args[3])
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_in_place_must_be_a_bool():
    args, _ = _args(0, 8, 8, np.float32, per_write_gates=False)
    with pytest.raises(TypeError, match="`in_place` must be a bool"):
        sdm_write_read(*args, chunk_size=8, in_place="yes")


def test_layer_prefill_in_place_equals_the_default():
    """The layer's prefill with `in_place=True`: the outputs and the new state of the default call, bit for bit;
    with the state donated, no state-sized temporary, which the default call needs (a state larger than all the
    addressing's temporaries together)."""
    from flax import nnx

    from jax_sdm.nn import SparseDeltaMemory

    seed = int(np.random.SeedSequence().entropy % 2**31)
    layer = SparseDeltaMemory(16, num_heads=2, slots_per_head=16384, num_writes=2, num_reads=2, head_dim=8,
                              impl="ffi", chunk_size=16, bank_init_std=0.1, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(layer)
    rng = np.random.default_rng(seed)
    state = jnp.asarray(rng.standard_normal((2, 2, 16384, 8)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3 * 16 + 5, 16)), jnp.float32)
    prefill = lambda in_place: lambda s, p, x: nnx.merge(graphdef, p)(x, state=s, in_place=in_place)
    want = jax.jit(prefill(False))(state, params, x)
    got = jax.jit(prefill(True), donate_argnums=0)(jnp.array(state, copy=True), params, x)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    temp = lambda in_place: _donated_temp_bytes(prefill(in_place), (state, params, x))
    assert temp(True) < state.nbytes <= temp(False), (temp(True), state.nbytes, temp(False))
    with pytest.raises(TypeError, match="`in_place` must be a bool"):
        layer(x, state=state, in_place=1)

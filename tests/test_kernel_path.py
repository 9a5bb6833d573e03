"""The kernel path, impl="ffi" (the default): the whole op on the default backend's kernels (C++ on the CPU, CUDA on a
GPU), against the golden files and the token loop."""
import functools
import hashlib
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import default_chunk_size, sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import (FLOAT_ARGS, TESTS, check_against_reference, cotangents, entry_ops_of_shape, ffi_calls,
                      outputs_and_grads, rel_err)

ffi_op = functools.partial(sdm_write_read, impl="ffi")


@pytest.mark.parametrize("chunk_size", [1, 16, 64, 256])
def test_ffi_chunk_sizes(chunk_size):
    seed = chunk_size + int(np.random.SeedSequence().entropy % 10_000) * 1000
    args = random_problem(seed, B=1, T=300, H=2, K=24, D=8, W=4, R=3, distinct=False, repeats=True)
    check_against_reference(ffi_op, args, chunk_size, 1e-5, seed)


@pytest.mark.parametrize("impl", ["auto", pytest.param("xla", marks=pytest.mark.slow)])
def test_default_chunk_size_is_the_platforms(impl):
    """chunk_size=None runs the chunk size default_chunk_size picks: 128 where the CUDA kernels run, else 64."""
    assert default_chunk_size() == (128 if jax.default_backend() == "gpu" else 64)
    assert default_chunk_size("xla") == default_chunk_size("reference") == 64
    # Bitwise equality needs a reproducible path: the kernels everywhere, the pure-JAX form on the CPU only.
    if impl == "xla" and jax.default_backend() != "cpu":
        pytest.skip("XLA's GPU scatter-add sums in no fixed order")
    seed = int(np.random.SeedSequence().entropy % 10_000)
    args = random_problem(seed, B=1, T=300, H=2, K=24, D=8, W=4, R=3, distinct=False, repeats=True)
    # The forward of a VJP: the CPU's no-grad forward runs token by token, whatever the chunk size.
    def run(**kw):
        return jax.vjp(lambda bank: sdm_write_read(**dict(args, bank=bank), **kw), args["bank"])[0]

    default = run(impl=impl)
    chosen = run(chunk_size=default_chunk_size(impl), impl=impl)
    other = run(chunk_size=16, impl=impl)
    for a, b in zip(default, chosen):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=impl)
    # another chunk size rounds differently: the equality above picked out the chunk size
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(default, other)), impl


@pytest.mark.parametrize("W,R", [(256, 1), (1, 256), (256, 256)])
def test_ffi_lane_limits(W, R):
    args = random_problem(W + 7 * R, B=1, T=9, H=1, K=300, D=4, W=W, R=R, distinct=False, repeats=True)
    check_against_reference(ffi_op, args, 4, 1e-5, W)


def test_ffi_bfloat16_bank():
    args = random_problem(21, T=48, K=32, D=16, W=4, R=4, distinct=False, dtype=jnp.bfloat16)
    check_against_reference(ffi_op, args, 16, 2e-2, 21)
    # and the same rounding as the pure-JAX chunked form, which rounds rows at the same points
    y, final = ffi_op(**args, chunk_size=16)
    y_x, final_x = sdm_write_read(**args, chunk_size=16, impl="xla")
    assert rel_err(y, y_x) < 1e-2 and rel_err(final, final_x) < 1e-2


def test_ffi_is_the_default_on_cpu():
    args = random_problem(1, T=5, K=8, W=2, R=2)
    jaxpr = str(jax.make_jaxpr(lambda a: sdm_write_read(**a))(args))
    assert "sdm_forward" in jaxpr and "sdm_phase1" in jaxpr


def test_no_grad_forward_saves_nothing():
    args = random_problem(2, T=40, K=16, W=3, R=2)
    plain = jax.make_jaxpr(lambda a: ffi_op(**a, chunk_size=8))(args).jaxpr
    (fwd,) = ffi_calls(plain, "sdm_forward")
    residual_sizes = [int(np.prod(v.aval.shape)) for v in fwd.outvars[2:5]]  # delta, G, snapshot
    assert residual_sizes == [0, 0, 0]
    # ... while the forward of a VJP keeps delta, G and the snapshot.
    trained = jax.make_jaxpr(lambda a: jax.vjp(lambda b: ffi_op(**dict(a, bank=b), chunk_size=8), a["bank"]))(args)
    (fwd,) = ffi_calls(trained.jaxpr, "sdm_forward")
    assert all(int(np.prod(v.aval.shape)) > 0 for v in fwd.outvars[2:5])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_backward_keeps_no_float32_array_of_the_values(dtype):
    """The backward's results hold no float32 `[NC, P, C, D]` array beside the gradient bank: the adjoint `du` lives
    in a chunk's scratch of the workspace and `dv` leaves in the bank's dtype (the values' in the op), the same
    gradient as the token loop's."""
    args = random_problem(3, B=2, T=40, H=2, K=16, D=12, W=3, R=2, dtype=dtype)
    loss = lambda v: jnp.sum(ffi_op(**dict(args, v=v), chunk_size=8)[0].astype(jnp.float32) ** 2)
    grad = jax.make_jaxpr(jax.grad(loss))(args["v"])
    (bwd,) = ffi_calls(grad.jaxpr, "sdm_backward")
    tokens = [v.aval for v in bwd.outvars if v.aval.shape[-1:] == (12,) and v.aval.ndim == 4]
    assert [(a.shape, a.dtype) for a in tokens] == [((5, 4, 8, 12), jnp.dtype(dtype))]  # dv only
    check_against_reference(ffi_op, args, 8, 1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_makes_no_copy_of_a_kept_bank(dtype):
    """The final bank is a result of its own: with the bank not donated (the caller keeps it), the compiled forward
    copies no whole bank before the kernels (the kernels read each row from the initial bank until its first
    write), and the initial bank is left as it was."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    args = random_problem(seed, B=2, T=20, H=2, K=512, D=8, W=3, R=2, dtype=dtype)
    bank = jnp.asarray(args["bank"])
    kept = np.asarray(bank, np.float32).copy()
    op = jax.jit(lambda bank, a: ffi_op(bank=bank, **a, chunk_size=8))
    rest = {k: v for k, v in args.items() if k != "bank"}
    hlo = op.lower(bank, rest).compile().as_text()
    B, H, K, D = bank.shape
    # Of the bank's shape, and of the kernels' [B*H, K, D]: views only (a copy may also come as a fusion).
    ops = entry_ops_of_shape(hlo, bank.shape) + entry_ops_of_shape(hlo, (B * H, K, D))
    assert set(ops) <= {"parameter", "bitcast", "get-tuple-element"}, ops
    y, final = op(bank, rest)
    np.testing.assert_array_equal(np.asarray(bank, np.float32), kept)
    y_ref, final_ref = sdm_write_read(**args, impl="reference")
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(y, y_ref) < tol and rel_err(final, final_ref) < tol


def test_grad_makes_no_copy_of_the_bank_or_its_cotangent():
    """With a loss on the final bank too (its cotangent an array XLA must keep), the compiled forward + backward
    copies neither the bank nor the cotangent: the backward's gradient bank is a result of its own, read from the
    cotangent until each row's first write, and the gradients match the token loop's."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    args = random_problem(seed, B=2, T=20, H=2, K=512, D=8, W=3, R=2, distinct=False, repeats=True)
    names = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
    rng = np.random.default_rng(seed)
    dy = jnp.asarray(rng.standard_normal(args["v"].shape), jnp.float32)
    dbank = jnp.asarray(rng.standard_normal(args["bank"].shape), jnp.float32)

    def loss(impl, bank, v, dy, dbank):
        a = dict(args, bank=bank, v=v)
        y, final = sdm_write_read(*(a[n] for n in names), chunk_size=8, impl=impl)
        return jnp.sum(y * dy) + (0.0 if dbank is None else jnp.sum(final * dbank))

    grad = jax.jit(jax.grad(functools.partial(loss, "ffi"), argnums=(0, 1)))
    hlo = grad.lower(args["bank"], args["v"], dy, dbank).compile().as_text()
    B, H, K, D = args["bank"].shape
    ops = entry_ops_of_shape(hlo, (B, H, K, D)) + entry_ops_of_shape(hlo, (B * H, K, D))
    assert set(ops) <= {"parameter", "bitcast", "get-tuple-element"}, ops
    got = grad(args["bank"], args["v"], dy, dbank)
    want = jax.grad(functools.partial(loss, "reference"), argnums=(0, 1))(args["bank"], args["v"], dy, dbank)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5, rel_err(g, w)
    # A loss of the readings only: the final bank's cotangent is a symbolic zero, which the backward reads as zero
    # rows: no bank-sized buffer of zeros is made (nor copied), and the gradients still match.
    grad = jax.jit(jax.grad(lambda bank, v, dy: loss("ffi", bank, v, dy, None), argnums=(0, 1)))
    hlo = grad.lower(args["bank"], args["v"], dy).compile().as_text()
    ops = entry_ops_of_shape(hlo, (B, H, K, D)) + entry_ops_of_shape(hlo, (B * H, K, D))
    assert set(ops) <= {"parameter", "bitcast", "get-tuple-element"}, ops
    got = grad(args["bank"], args["v"], dy)
    reference = jax.grad(lambda bank, v, dy: loss("reference", bank, v, dy, None), argnums=(0, 1))
    want = reference(args["bank"], args["v"], dy)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5, rel_err(g, w)



def _shared_bank_problem(seed, dtype):
    return random_problem(seed, B=3, T=40, H=2, K=64, D=16, W=4, R=3, dtype=dtype, shared_bank=True, distinct=False,
                          repeats=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shared_bank_goes_to_the_kernels_unbroadcast(dtype):
    """A bank shared by the batch, `[H, K, D]`, reaches the forward kernel as it is: the compiled training step
    materialises no `[B, H, K, D]` or `[B*H, K, D]` copy of it before the kernels (the kernels read stream
    `b*H + h`'s rows from head `h`'s block), and the readings, final bank and every gradient are bitwise those of
    the same bank broadcast over the batch first (its gradient the ordered sum of the streams' gradients)."""
    from jax_sdm import layout

    seed = int(np.random.SeedSequence().entropy % 2**31)
    args = _shared_bank_problem(seed, dtype)
    names = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
    rng = np.random.default_rng(seed)
    dy = jnp.asarray(rng.standard_normal(args["v"].shape), jnp.float32)
    H, K, D = args["bank"].shape
    B = args["k_idx"].shape[0]
    dfinal = jnp.asarray(rng.standard_normal((B, H, K, D)), jnp.float32)

    def loss(broadcast, bank, k_val, v, dy, dfinal):
        a = dict(args, bank=layout.ordered_broadcast(bank, B, 0) if broadcast else bank, k_val=k_val, v=v)
        y, final = ffi_op(*(a[n] for n in names), chunk_size=8)
        bank_term = 0.0 if dfinal is None else jnp.sum(final.astype(jnp.float32) * dfinal)
        return jnp.sum(y.astype(jnp.float32) * dy) + bank_term, y

    grad = jax.jit(jax.grad(functools.partial(loss, False), argnums=(0, 1, 2), has_aux=True))
    primals = (jnp.asarray(args["bank"]), jnp.asarray(args["k_val"]), jnp.asarray(args["v"]), dy, dfinal)
    # A loss of the readings: no bank-sized cotangent either (its dtype conversion would be a fusion of that shape).
    hlo = grad.lower(*primals[:4], None).compile().as_text()
    bank_shaped = entry_ops_of_shape(hlo, (B * H, K, D)) + entry_ops_of_shape(hlo, (B, H, K, D))
    # the forward kernel's final bank, the backward's two banks, views of them: no broadcast or copy (a broadcast
    # bank shows a fusion of this shape here)
    assert set(bank_shaped) <= {"custom-call", "get-tuple-element", "bitcast", "parameter"}, bank_shaped
    forward = [line for line in hlo.splitlines() if 'custom_call_target="sdm_forward"' in line]
    assert len(forward) == 1 and re.search(rf"\[{H},{K},{D}\]", forward[0].split("custom-call(")[1]), forward
    (got, got_aux) = grad(*primals)
    (want, want_aux) = jax.jit(jax.grad(functools.partial(loss, True), argnums=(0, 1, 2), has_aux=True))(*primals)
    assert got[0].shape == (H, K, D)
    for a, b in zip(jax.tree_util.tree_leaves((got, got_aux)), jax.tree_util.tree_leaves((want, want_aux))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    if dtype == jnp.float32:  # and the token loop's gradients
        def reference(bank, k_val, v):
            a = dict(args, bank=bank, k_val=k_val, v=v)
            y, final = sdm_write_read(*(a[n] for n in names), impl="reference")
            return jnp.sum(y * dy) + jnp.sum(final * dfinal)

        for g, w in zip(got, jax.grad(reference, argnums=(0, 1, 2))(*primals[:3])):
            assert rel_err(g, w) < 1e-4, rel_err(g, w)


@pytest.mark.parametrize("mapped", [False, True])
def test_shared_bank_under_vmap(mapped):
    """Under `vmap` a shared bank that is not mapped stays shared by every batch element of every mapped problem;
    a mapped one (a bank per problem) serves that problem's batch: both equal the broadcast bank's results,
    forward and backward."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    args = _shared_bank_problem(seed, jnp.float32)
    B = args["k_idx"].shape[0]
    stack = lambda a: jnp.stack([jnp.asarray(a), 0.5 * jnp.asarray(a)])
    banks = stack(args["bank"]) if mapped else jnp.asarray(args["bank"])
    v = stack(args["v"])

    def loss(broadcast, bank, v):
        b = jnp.broadcast_to(bank[None], (B,) + bank.shape) if broadcast else bank
        y, final = ffi_op(**dict(args, bank=b, v=v), chunk_size=8)
        return jnp.sum(y * y) + jnp.sum(jnp.sin(final)), (y, final)

    in_axes = (0 if mapped else None, 0)
    run = lambda broadcast: jax.jit(jax.vmap(jax.grad(functools.partial(loss, broadcast), argnums=(0, 1),
                                                      has_aux=True), in_axes=in_axes))(banks, v)
    got, want = run(False), run(True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.shape == b.shape
        assert rel_err(a, b) < 1e-6, rel_err(a, b)


def test_forward_kernel_rejects_a_bank_that_does_not_divide_the_streams():
    """The forward kernel's input bank is per stream, or `[P_in, K, D]` with `P_in` dividing the streams: another
    shape is refused with a clear error."""
    from jax_sdm import ffi_ops

    seed = int(np.random.SeedSequence().entropy % 2**31)
    args = random_problem(seed, B=2, T=16, H=2, K=32, D=8, W=3, R=2)
    k_idx = jnp.asarray(args["k_idx"]).reshape(1, 8, 2, 4, 3)  # kernel layout [V 1, NC 8, P 2, C 4, W 3]
    with pytest.raises(Exception, match="P_in dividing P"):
        nc = ffi_ops.phase1_ffi(k_idx, jnp.ones(k_idx.shape), -jnp.ones(k_idx.shape), k_idx[..., :2],
                                jnp.ones(k_idx.shape[:-1] + (2,)), 32)
        minv = ffi_ops.solve_ffi(nc.A, jnp.ones(k_idx.shape[:-1]))
        bank = jnp.zeros((3, 32, 8), jnp.float32)  # 3 blocks for 2 streams
        out = ffi_ops.forward_ffi(bank, k_idx, k_idx[..., :2], jnp.ones(k_idx.shape[:-1] + (8,)),
                                  jnp.ones(k_idx.shape[:-1]), nc, minv, False)
        jax.block_until_ready(out.y)


def _ffi_eqns(jaxpr, target):
    """The ffi_call equations of `target` anywhere in a closed jaxpr (nested jaxprs included)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.params.get("target_name") == target:
            found.append(eqn)
        for value in eqn.params.values():  # nested jaxprs (pjit, custom_vjp_call, ...), open or closed
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _ffi_eqns(sub, target)
    return found


def test_readings_cotangent_goes_to_the_kernels_in_the_bank_dtype(monkeypatch):
    """The readings leave the op in the bank's dtype, so their cotangent is exact there: the backward's kernels
    take it as it comes (half the bytes of float32 for a bfloat16 bank, which counts at the training peak), the
    gradients still match the token loop's, and the handler refuses a dy of another dtype with a clear error."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    args = random_problem(seed, B=2, T=40, H=2, K=64, D=16, W=4, R=3, distinct=False, dtype=jnp.bfloat16)
    dy = jnp.asarray(np.random.default_rng(seed).standard_normal(args["v"].shape), jnp.bfloat16)

    def loss(impl, bank, v):
        y, _ = sdm_write_read(**dict(args, bank=bank, v=v), chunk_size=16, impl=impl)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    grad = jax.grad(functools.partial(loss, "ffi"), argnums=(0, 1))
    (call,) = _ffi_eqns(jax.make_jaxpr(grad)(args["bank"], args["v"]).jaxpr, "sdm_backward")
    assert call.invars[2].aval.dtype == jnp.bfloat16, call.invars[2].aval
    got = jax.jit(grad)(args["bank"], args["v"])
    want = jax.grad(functools.partial(loss, "reference"), argnums=(0, 1))(args["bank"], args["v"])
    for g, w in zip(got, want):
        assert rel_err(g, w) < 2e-2, rel_err(g, w)

    real_ffi_call = jax.ffi.ffi_call

    def float32_dy(target, *a, **kw):  # the backward's call, handed dy as float32
        call = real_ffi_call(target, *a, **kw)
        if target != "sdm_backward":
            return call
        return lambda *ops, **attrs: call(*ops[:2], ops[2].astype(jnp.float32), *ops[3:], **attrs)

    monkeypatch.setattr(jax.ffi, "ffi_call", float32_dy)
    with pytest.raises(Exception, match="dy must have the bank's dtype"):  # a new function: traced anew
        jax.block_until_ready(jax.jit(lambda *a: grad(*a))(args["bank"], args["v"]))

def _digest(*trees):
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(trees):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def test_ffi_bitwise_repeatable():
    args = random_problem(31, T=70, K=12, W=5, R=4, distinct=False, repeats=True, per_write_gates=True)
    dy, dbank = cotangents(31, args)
    first = outputs_and_grads(ffi_op, args, dy, dbank, chunk_size=16)
    jax.clear_caches()  # recompile too
    second = outputs_and_grads(ffi_op, args, dy, dbank, chunk_size=16)
    assert _digest(*first) == _digest(*second)


_PROCESS_SCRIPT = textwrap.dedent("""
    import functools, hashlib, jax, numpy as np
    from jax_sdm import sdm_write_read
    from jax_sdm.testing import random_problem
    from helpers import cotangents, outputs_and_grads
    args = random_problem(41, T=50, K=10, W=4, R=3, distinct=False, repeats=True)
    dy, dbank = cotangents(41, args)
    out = outputs_and_grads(functools.partial(sdm_write_read, impl="ffi"), args, dy, dbank, chunk_size=16)
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(out):
        h.update(np.asarray(leaf).tobytes())
    print(h.hexdigest())
""")


def test_ffi_bitwise_across_processes():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    run = lambda: subprocess.run([sys.executable, "-c", _PROCESS_SCRIPT], capture_output=True, text=True, check=True,
                                 env=env).stdout.strip().splitlines()[-1]
    args = random_problem(41, T=50, K=10, W=4, R=3, distinct=False, repeats=True)
    dy, dbank = cotangents(41, args)
    here = _digest(*outputs_and_grads(ffi_op, args, dy, dbank, chunk_size=16))
    assert run() == run() == here


def test_ffi_under_vmap_folds_into_streams():
    args = random_problem(13, B=1, T=20, K=16, W=3, R=2, distinct=False)
    stacked = {k: np.stack([v, v[..., ::-1] if k.endswith("idx") else 0.5 * v]) for k, v in args.items()}
    f = jax.vmap(lambda a: ffi_op(**a, chunk_size=8))
    ys, finals = f(stacked)
    for i in range(2):
        y, final = ffi_op(**{k: v[i] for k, v in stacked.items()}, chunk_size=8)
        np.testing.assert_array_equal(ys[i], y)
        np.testing.assert_array_equal(finals[i], final)
    jaxpr = jax.make_jaxpr(f)(stacked).jaxpr
    assert len(ffi_calls(jaxpr, "sdm_forward")) == 1
    assert "while" not in str(jaxpr)


def test_ffi_grad_under_vmap():
    args = random_problem(14, B=1, T=20, K=16, W=3, R=2, distinct=False)
    stacked = {k: np.stack([v, v[..., ::-1] if k.endswith("idx") else 0.5 * v]) for k, v in args.items()}
    loss = lambda a: jnp.sum(ffi_op(**a, chunk_size=8)[0] ** 2)
    floats = lambda a: {k: a[k] for k in FLOAT_ARGS}
    rest = lambda a: {k: a[k] for k in a if k not in FLOAT_ARGS}
    batched = jax.vmap(lambda a: jax.grad(lambda f: loss(dict(rest(a), **f)))(floats(a)))(stacked)
    for i in range(2):
        one = {k: v[i] for k, v in stacked.items()}
        g = jax.grad(lambda f: loss(dict(rest(one), **f)))(floats(one))
        for k in FLOAT_ARGS:
            np.testing.assert_allclose(batched[k][i], g[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["ffi", pytest.param("xla", marks=pytest.mark.slow), "reference"])
def test_repeats_are_counted(impl):
    args = random_problem(9, T=30, K=6, W=5, R=2, distinct=False, repeats=True)
    k = args["k_idx"]
    expected = sum(int(k[b, t, h, n] in k[b, t, h, :n]) for b, t, h, n in np.ndindex(k.shape))
    assert expected > 0
    _, _, repeats = jax.jit(lambda a: sdm_write_read(**a, chunk_size=8, impl=impl, return_repeats=True))(args)
    assert int(repeats) == expected


@pytest.mark.parametrize("impl", ["ffi", pytest.param("xla", marks=pytest.mark.slow), "reference"])
def test_check_mode_reports_bad_data_through_checkify(impl):
    """`check=True`: under `checkify.checkify` of a jitted function an error value with the message (and
    `err.throw()` a `ValueError`); eagerly a `ValueError` at once; jitted without `checkify`, no compiled program."""
    from jax.experimental import checkify

    args = random_problem(10, T=12, K=8, W=3, R=2, distinct=False)
    f = lambda a: sdm_write_read(**a, chunk_size=4, impl=impl, check=True)
    checked = jax.jit(checkify.checkify(f))
    err, (y, _) = checked(args)
    assert err.get() is None  # good data passes
    y_plain = jax.jit(lambda a: sdm_write_read(**a, chunk_size=4, impl=impl))(args)[0]
    if impl == "ffi":  # the same kernels either way
        np.testing.assert_array_equal(y, y_plain)
    else:  # two XLA programs: the compiler may fuse (and round) them differently on a GPU
        np.testing.assert_allclose(y, y_plain, rtol=1e-5, atol=1e-6)
    lanes = np.arange(3) == 1
    cases = {
        r"sdm_write_read\(check=True\): 48 write slot ids \(k_idx\) outside \[0, K=8\)":
            dict(args, k_idx=np.where(lanes, 8, args["k_idx"]).astype(np.int32)),
        r"sdm_write_read\(check=True\): 96 read slot ids \(q_idx\) outside \[0, K=8\)":
            dict(args, q_idx=np.full_like(args["q_idx"], -1)),
        r"sdm_write_read\(check=True\): 48 non-finite values in `v`":
            dict(args, v=np.where(np.arange(16) == 3, np.nan, args["v"]).astype(np.float32)),
    }
    for message, bad in cases.items():
        err, _ = checked(bad)
        assert err.get() is not None and re.search(message, err.get()), err.get()
        with pytest.raises(ValueError, match=message):
            err.throw()
    message, bad = next(iter(cases.items()))
    with pytest.raises(ValueError, match=message):  # eagerly
        f(bad)
    with pytest.raises(ValueError, match="checkify"):  # jitted without checkify: refused before it runs
        jax.jit(f)(args)


def test_ffi_rejects_float64_bank():
    with jax.enable_x64(True):
        args = random_problem(1, T=5, K=8, W=2, R=2, dtype=np.float64)
        with pytest.raises(TypeError, match="`bank` has dtype float64, expected float32 or bfloat16"):
            ffi_op(**args)


def test_ffi_large_bank():
    """2^20 + 3 slots per stream (docs/MATH.md "Limits"): row offsets past 2^22 elements, ids at
    the top of the range."""
    K = 2**20 + 3
    args = random_problem(17, B=1, T=40, H=2, K=K, D=4, W=3, R=2, distinct=False)
    args["k_idx"][:, ::5, :, 0] = K - 1
    args["q_idx"][:, 1::5, :, 1] = K - 1
    args["k_idx"][:, 2::7, :, 1] = K - 2
    check_against_reference(ffi_op, args, 16, 1e-5, 17)

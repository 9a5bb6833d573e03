"""The CUDA chunk steps against the CPU ones on identical inputs (GPU only; skipped elsewhere).

Phase 1 and the solve run on the CPU; their outputs go to both devices, so these tests isolate the step kernels.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import ffi_ops, layout
from jax_sdm.testing import random_problem

from .helpers import kernel_layout, rel_err, stored_groups


def poison_allocator(device, nbytes=1 << 28):
    """Fill and free a large buffer with NaN so that fresh result buffers are unlikely to start at zero."""
    jax.block_until_ready(jax.device_put(jnp.full(nbytes // 4, jnp.nan, jnp.float32), device)).delete()


def kernel_inputs(seed, chunk, **kw):
    names = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
    with jax.default_device(jax.devices("cpu")[0]):
        args = {k: jnp.asarray(v) for k, v in random_problem(seed, **kw).items()}
        dims = layout.validate(*[args[k] for k in names], chunk)
        bank, k_idx, k_val, x, v, beta, q_idx, q_val, _ = kernel_layout(*[args[k] for k in names], dims)
        p1 = ffi_ops.phase1_ffi(k_idx, k_val, x, q_idx, q_val, dims.K)
        minv = ffi_ops.solve_ffi(p1.A, beta)
    return bank, k_idx, q_idx, v, beta, p1, minv


def run_steps(device, bank, k_idx, q_idx, v, beta, p1, minv, dy, dbank):
    put = lambda t: jax.device_put(t, device)
    kept, kept_dbank = np.asarray(bank), np.asarray(dbank)
    bank, k_idx, q_idx, v, beta, p1, minv, dy, dbank = map(put, (bank, k_idx, q_idx, v, beta, p1, minv, dy, dbank))
    poison_allocator(device)
    fwd = jax.jit(lambda *a: ffi_ops.forward_ffi(*a, save=True))
    out = fwd(bank, k_idx, q_idx, v, beta, p1, minv)
    no_grad = jax.jit(lambda *a: ffi_ops.forward_ffi(*a, save=False))(bank, k_idx, q_idx, v, beta, p1, minv)
    # The final bank is a buffer of its own (rows read from the initial bank until their first write): the
    # initial bank stays as it was.
    np.testing.assert_array_equal(np.asarray(bank, np.float32), np.asarray(kept, np.float32))
    poison_allocator(device)
    bwd = jax.jit(ffi_ops.backward_ffi)(bank, dbank, dy, k_idx, q_idx, beta, p1, minv, out.delta, out.vg,
                                        out.snapshot, None, out.link_k, out.link_q)
    # The backward only reads the input bank, and its gradient bank is a buffer of its own: the cotangent stays as
    # it was too.
    np.testing.assert_array_equal(np.asarray(bank, np.float32), np.asarray(kept, np.float32))
    np.testing.assert_array_equal(np.asarray(dbank), np.asarray(kept_dbank))
    return (out.bank, out.y, out.delta, out.vg, out.snapshot, out.link_k, out.link_q), no_grad[:2], bwd[:-1]


def written_snapshot_rows(fwd, inputs):
    """The forward's outputs with the snapshot's unwritten rows zeroed (`stored_groups`)."""
    used = stored_groups(inputs[5].w_group)[..., None]
    return fwd[:4] + (np.where(used, np.asarray(fwd[4], np.float32), 0),) + fwd[5:]


CASES = [
    dict(T=40, K=64, D=16, W=4, R=3),
    dict(T=37, K=8, D=5, W=5, R=4, distinct=False, repeats=True, per_write_gates=True),
    dict(B=2, H=3, T=70, K=16, D=40, W=3, R=2, distinct=False),
    dict(T=33, K=40, D=130, W=9, R=7, distinct=False, repeats=True, dtype=jnp.bfloat16),
    # most rows written by no chunk (copied from the initial bank), the others first written in every chunk
    dict(B=2, H=2, T=150, K=2048, D=64, W=4, R=4, dtype=jnp.bfloat16),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("chunk", [16, 64, 128])
def test_gpu_steps_match_cpu(case, chunk):
    seed = case * 100 + chunk + int(np.random.SeedSequence().entropy % 1000) * 1000
    inputs = kernel_inputs(seed, chunk, **CASES[case])
    bank = inputs[0]
    rng = np.random.default_rng(seed)
    NC, P, C = inputs[1].shape[:3]
    dy = jnp.asarray(rng.standard_normal((NC, P, C, bank.shape[-1])), jnp.float32)
    dbank = jnp.asarray(rng.standard_normal(bank.shape), jnp.float32)
    cpu_fwd, cpu_plain, cpu_bwd = run_steps(jax.devices("cpu")[0], *inputs, dy, dbank)
    gpu_fwd, gpu_plain, gpu_bwd = run_steps(jax.devices()[0], *inputs, dy, dbank)
    tol = 1e-5 if bank.dtype == jnp.float32 else 1e-2
    gpu_fwd, cpu_fwd = written_snapshot_rows(gpu_fwd, inputs), written_snapshot_rows(cpu_fwd, inputs)
    names = ["final", "y", "delta", "vg", "snapshot"]
    for name, a, b in zip(names, gpu_fwd, cpu_fwd):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    for name, a, b in zip(["link_k", "link_q"], gpu_fwd[5:], cpu_fwd[5:]):  # the links are exact
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    for name, a, b in zip(["final (no grad)", "y (no grad)"], gpu_plain, gpu_fwd[:2]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    names = ["dbank", "dk_eff", "dw", "dcpe", "dq_w", "dA", "dQK", "dbeta", "dv"]
    for name, a, b in zip(names, gpu_bwd, cpu_bwd):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))


def test_gpu_steps_bitwise_repeatable():
    inputs = kernel_inputs(5, 16, T=50, K=12, D=24, W=5, R=4, distinct=False, repeats=True)
    rng = np.random.default_rng(5)
    NC, P, C = inputs[1].shape[:3]
    dy = jnp.asarray(rng.standard_normal((NC, P, C, 24)), jnp.float32)
    dbank = jnp.asarray(rng.standard_normal(inputs[0].shape), jnp.float32)
    runs = []
    for _ in range(2):
        fwd, plain, bwd = run_steps(jax.devices()[0], *inputs, dy, dbank)
        runs.append((written_snapshot_rows(fwd, inputs), plain, bwd))
    names = ["final", "y", "delta", "vg", "snapshot", "link_k", "link_q", "final (no grad)", "y (no grad)", "dbank",
             "dk_eff", "dw", "dcpe", "dq_w", "dA", "dQK", "dbeta", "dv"]
    leaves = [jax.tree_util.tree_leaves(run) for run in runs]
    assert len(leaves[0]) == len(names)
    for name, a, b in zip(names, *leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)

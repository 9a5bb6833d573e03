"""The CUDA decode step (`sdm_step` on the GPU) against the token loop and the CPU kernel, and the layer's decode
step (`sdm_layer_decode_step`) against the CPU kernel (GPU only; skipped elsewhere)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdm import sdm_step, sdm_write_read
from jax_sdm.testing import random_problem

from .helpers import entry_ops_of_shape, rel_err

NAMES = ("bank", "k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")

CASES = [
    dict(B=4, H=4, K=4096, D=128, W=16, R=16),  # the decode benchmark's shape
    dict(B=2, H=3, K=16, D=40, W=6, R=5, distinct=False, repeats=True, per_write_gates=True),
    dict(B=1, H=2, K=64, D=300, W=9, R=7, distinct=False, repeats=True),  # several column tiles, a partial one
    dict(B=2, H=2, K=512, D=5, W=256, R=256, distinct=False, repeats=True),  # the most lanes: one warp per block
    dict(B=3, H=2, K=32, D=64, W=4, R=4, distinct=False, shared_bank=True),
    dict(B=2, H=2, K=256, D=136, W=8, R=8, distinct=False, repeats=True, dtype=jnp.bfloat16),
]


def one_token(seed, **kw):
    """A random token whose reads often hit its written slots, with out-of-range ids and a hard reset."""
    p = random_problem(seed, T=1, **kw)
    rng = np.random.default_rng(seed)
    K, W = p["bank"].shape[-2], p["k_idx"].shape[-1]
    hit = rng.random(p["q_idx"].shape) < 0.5
    p["q_idx"] = np.where(hit, np.take_along_axis(p["k_idx"], rng.integers(0, W, p["q_idx"].shape), -1), p["q_idx"])
    p["k_idx"] = np.where(rng.random(p["k_idx"].shape) < 0.05, K, p["k_idx"]).astype(np.int32)
    p["q_idx"] = np.where(rng.random(p["q_idx"].shape) < 0.05, -1, p["q_idx"]).astype(np.int32)
    p["g"] = np.where(rng.random(p["g"].shape) < 0.05, -np.inf, p["g"]).astype(np.float32)
    return p


def run(device, p, impl="ffi"):
    args = [jax.device_put(jnp.asarray(p[n] if n == "bank" else p[n][:, 0]), device) for n in NAMES]
    return jax.jit(lambda *a: sdm_step(*a, impl=impl), donate_argnums=0)(*args)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gpu_step_matches_reference_and_cpu(case):
    p = one_token(case * 1000 + int(np.random.SeedSequence().entropy % 1000), **CASES[case])
    y_ref, bank_ref = sdm_write_read(**p, impl="reference")
    gpu = run(jax.devices()[0], p)
    cpu = run(jax.devices("cpu")[0], p)
    tol = 1e-2 if p["bank"].dtype == jnp.bfloat16 else 1e-6
    for name, a, b in (("y", gpu[0], y_ref[:, 0]), ("bank", gpu[1], bank_ref)):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    # The CPU kernel does the same arithmetic in the same order (only exp may round differently).
    for name, a, b in (("y", gpu[0], cpu[0]), ("bank", gpu[1], cpu[1])):
        assert rel_err(a, b) < (1e-2 if p["bank"].dtype == jnp.bfloat16 else 1e-6), (name, rel_err(a, b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_step_is_bitwise_deterministic(dtype):
    p = one_token(7, B=4, H=4, K=1024, D=128, W=16, R=16, distinct=False, repeats=True, dtype=dtype)
    first = run(jax.devices()[0], p)
    for _ in range(3):
        again = run(jax.devices()[0], p)
        for a, b in zip(again, first):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_gpu_step_large_bank():
    """K = 2^20 slots: a donated rollout touches only the written rows; its readings and final bank match the
    token loop on the same sequence."""
    T, K = 4, 1 << 20
    p = random_problem(3, B=2, T=T, H=2, K=K, D=64, W=16, R=16)
    p["q_idx"][:, 1:] = p["k_idx"][:, :-1, :, :16]  # read what the previous token wrote
    p["k_idx"][:, :, :, 0] = K - 1  # the last slot
    y_ref, bank_ref = sdm_write_read(**p, impl="reference")
    step = jax.jit(lambda bank, *tok: sdm_step(bank, *tok), donate_argnums=0)
    bank = jax.device_put(jnp.asarray(p["bank"]), jax.devices()[0])
    ys = []
    for t in range(T):
        y, bank = step(bank, *[jnp.asarray(p[n][:, t]) for n in NAMES[1:]])
        ys.append(y)
    assert rel_err(jnp.stack(ys, 1), y_ref) < 1e-5
    assert rel_err(bank, bank_ref) < 1e-5


def test_gpu_step_updates_in_place():
    """Compiled for the GPU with the bank donated: no op materialises a copy of the bank."""
    p = random_problem(1, B=4, T=1, H=4, K=1 << 16, D=128, W=16, R=16, dtype=jnp.bfloat16)
    args = [jnp.asarray(p[n] if n == "bank" else p[n][:, 0]) for n in NAMES]
    hlo = jax.jit(lambda *a: sdm_step(*a), donate_argnums=0).lower(*args).compile().as_text()
    ops = entry_ops_of_shape(hlo, args[0].shape)
    assert ops and not {"copy", "copy-start"} & set(ops), ops


LAYER_CASES = [
    dict(),  # softmax, RMS norm, output gate
    dict(head_dim=300, num_writes=9, num_reads=7, readout_norm="layer", gate="write"),  # columns in three batches
    dict(num_writes=64, num_reads=40, write_activation="l2_normalize", read_activation="gelu", output_gate=False,
         readout_norm=None),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", range(len(LAYER_CASES)))
def test_gpu_layer_decode_step_matches_cpu_kernel(case, dtype):
    """The layer's decode step (`sdm_layer_decode_step`) on the GPU against the same call on the CPU kernel, the
    bank updated in place, and bitwise the same on a second call."""
    nnx = pytest.importorskip("flax.nnx")
    from jax_sdm.nn import SparseDeltaMemory
    seed = int(np.random.SeedSequence().entropy % 2**31)
    kw = dict(num_heads=4, slots_per_head=4096, num_writes=16, num_reads=16, head_dim=128)
    kw.update(LAYER_CASES[case])
    layer = SparseDeltaMemory(256, **kw, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
    layer.eval()
    assert layer.fused_decode()
    graphdef, params = nnx.split(layer)
    B, H, K, D = 3, kw["num_heads"], kw["slots_per_head"], kw["head_dim"]
    rng = np.random.default_rng(seed)
    # Host arrays in the layer's dtype: each device_put makes a buffer of its own to donate.
    x = np.asarray(rng.standard_normal((B, 256)), jnp.dtype(dtype))
    state = np.asarray(0.3 * rng.standard_normal((B, H, K, D)), jnp.dtype(dtype))
    step = jax.jit(lambda p, x, s: nnx.merge(graphdef, p).decode(x, s), donate_argnums=2)
    out = {}
    gpu = jax.devices()[0]
    # float32 matmuls at full precision: by default the GPU's projections round through TF32 (about 5e-4).
    with jax.default_matmul_precision("highest"):
        for device in (gpu, jax.devices("cpu")[0]):
            put = lambda a: jax.device_put(a, device)
            out[device.platform] = step(jax.tree.map(put, params), put(x), put(state))
        again = step(jax.tree.map(lambda a: jax.device_put(a, gpu), params), jax.device_put(x, gpu),
                     jax.device_put(state, gpu))
    tol = 1e-2 if dtype == "bfloat16" else 1e-5
    for name, a, b in zip(("y", "bank"), out["gpu"], out["cpu"]):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    for a, b in zip(again, out["gpu"]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    hlo = step.lower(params, x, state).compile().as_text()
    ops = entry_ops_of_shape(hlo, (B, H, K, D))
    assert not {"copy", "copy-start"} & set(ops), ops

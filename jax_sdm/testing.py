"""Random problems of `sdm_write_read` for benchmarks, examples and tests: the benchmarks' input recipe, plus
harder variants."""
import numpy as np


def random_problem(seed, B=2, T=50, H=2, K=64, D=16, W=4, R=3, *, dtype=np.float32, per_write_gates=False,
                   shared_bank=False, distinct=True, repeats=False):
    """A dict of `sdm_write_read` arguments as NumPy arrays.

    `distinct=True` is the benchmarks' recipe: the slots of a token are `a + n*b mod K` with random `a` and odd `b`
    (distinct within the token when `K` is a power of two and the lanes are at most `K`). Otherwise slots are
    drawn uniformly (collisions across tokens; with `repeats=True` also repeats within a token).
    Weights are l2-normalised random, `v` standard normal, `beta = sigmoid(randn)`,
    `g = -0.5 * softplus(randn)`, bank `0.1 * randn`.
    """
    rng = np.random.default_rng(seed)

    def slots(n):
        if distinct:
            a = rng.integers(0, K, size=(B, T, H, 1))
            b = 2 * rng.integers(0, max(K // 2, 1), size=(B, T, H, 1)) + 1
            return ((a + np.arange(n) * b) % K).astype(np.int32)
        idx = rng.integers(0, K, size=(B, T, H, n)).astype(np.int32)
        if repeats and n > 1:  # copy a random earlier lane into some lanes
            src = rng.integers(0, n - 1, size=(B, T, H, 1))
            mask = rng.random((B, T, H, n)) < 0.3
            mask[..., 0] = False
            idx = np.where(mask & (np.arange(n) > src), np.take_along_axis(idx, src, -1), idx)
        return idx

    def unit_rows(n):
        x = rng.standard_normal((B, T, H, n))
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    def softplus(x):
        return np.logaddexp(0, x)

    gshape = (B, T, H, W) if per_write_gates else (B, T, H)
    bank_shape = (H, K, D) if shared_bank else (B, H, K, D)
    out = dict(
        bank=0.1 * rng.standard_normal(bank_shape),
        k_idx=slots(W),
        k_val=unit_rows(W),
        v=rng.standard_normal((B, T, H, D)),
        beta=1 / (1 + np.exp(-rng.standard_normal((B, T, H)))),
        g=-0.5 * softplus(rng.standard_normal(gshape)),
        q_idx=slots(R),
        q_val=unit_rows(R),
    )
    for name in ("bank", "k_val", "v", "q_val"):
        out[name] = out[name].astype(dtype)
    for name in ("beta", "g"):
        out[name] = out[name].astype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    return out

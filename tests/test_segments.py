"""`segment_ids`: packed sequences in one row equal the separate runs; padding does nothing."""
import numpy as np
import pytest

from jax_sdm import sdm_write_read
from jax_sdm.testing import FLOAT_ARGS, outputs_and_grads, random_problem, rel_err

TOKEN_ARGS = ("k_idx", "k_val", "v", "beta", "g", "q_idx", "q_val")
TOL = 2e-5


def fresh_seed(base):
    return base + int(np.random.SeedSequence().entropy % 10_000) * 100


def runs(ids):
    """The segments of one row: `[(start, end)]` of its non-padding runs of equal ids."""
    out, start = [], None
    for t, i in enumerate(list(ids) + [None]):
        if start is not None and (i is None or i != ids[start]):
            out.append((start, t))
            start = None
        if start is None and i is not None and i >= 0:
            start = t
    return out


def separate_runs(p, segment_ids, dy, dbank):
    """The expected outputs and gradients: each segment of each row on its own (the token loop), the cotangent of
    the final bank on each row's last segment. Padding tokens read zeros and get zero gradients."""
    y = np.zeros(p["v"].shape, np.float64)
    final = np.broadcast_to(np.asarray(p["bank"], np.float64), (p["v"].shape[0],) + p["bank"].shape[-3:]).copy()
    grads = {k: np.zeros(np.shape(p[k]), np.float64) for k in FLOAT_ARGS}
    for b, ids in enumerate(segment_ids):
        segs = runs(list(ids))
        for n, (t0, t1) in enumerate(segs):
            row = lambda a: a[b:b + 1, t0:t1]
            part = {k: row(p[k]) for k in TOKEN_ARGS}
            part["bank"] = p["bank"][b:b + 1] if p["bank"].ndim == 4 else p["bank"]
            last = n == len(segs) - 1
            y_s, final_s, g_s = outputs_and_grads(
                sdm_write_read, part, row(dy), dbank[b:b + 1] if last else np.zeros_like(dbank[b:b + 1]),
                impl="reference")
            y[b, t0:t1] = np.asarray(y_s[0])
            if last:
                final[b] = np.asarray(final_s[0])
            for k in TOKEN_ARGS:
                if k in grads:
                    grads[k][b, t0:t1] = np.asarray(g_s[k][0])
            if p["bank"].ndim == 4:
                grads["bank"][b] += np.asarray(g_s["bank"][0])
            else:
                grads["bank"] += np.asarray(g_s["bank"])
        if not segs:  # padding only: the final bank is the initial one
            if p["bank"].ndim == 4:
                grads["bank"][b] += dbank[b]
            else:
                grads["bank"] += dbank[b]
    return y, final, grads


IMPLS = [("reference", 1), ("xla", 4)]  # (impl, chunk_size): chunks of 4 hold several segments


def check(p, segment_ids, seed):
    """Every impl's outputs and gradients with `segment_ids` against the separate runs."""
    rng = np.random.default_rng(seed)
    dy = rng.standard_normal(p["v"].shape)
    B, H = p["k_idx"].shape[0], p["k_idx"].shape[2]
    dbank = rng.standard_normal((B, H) + p["bank"].shape[-2:])
    y_ref, final_ref, grads_ref = separate_runs(p, segment_ids, dy, dbank)
    for impl, chunk_size in IMPLS:
        y, final, grads = outputs_and_grads(sdm_write_read, p, dy, dbank, impl=impl, chunk_size=chunk_size,
                                            segment_ids=segment_ids)
        assert rel_err(y, y_ref) < TOL, (impl, chunk_size, rel_err(y, y_ref))
        assert rel_err(final, final_ref) < TOL, (impl, chunk_size, rel_err(final, final_ref))
        for k in FLOAT_ARGS:
            assert grads[k].shape == np.shape(p[k]), k
            assert rel_err(grads[k], grads_ref[k]) < TOL, (impl, chunk_size, k, rel_err(grads[k], grads_ref[k]))


# Row 0: four sequences and right padding; row 1: an id that comes back (a new sequence), one across chunks.
PACKED = [[0] * 5 + [1] * 9 + [2] * 3 + [3] * 7 + [-1] * 4,
          [3] * 3 + [7] * 13 + [3] * 10 + [5] * 2]


@pytest.mark.parametrize("kind", ["repeats_per_write_gates", "shared_bank"])
def test_packed_rows_equal_separate_runs(kind):
    seed = fresh_seed(["repeats_per_write_gates", "shared_bank"].index(kind))
    kw = dict(repeats_per_write_gates=dict(distinct=False, repeats=True, per_write_gates=True),
              shared_bank=dict(distinct=False, shared_bank=True))[kind]
    p = random_problem(seed, B=2, T=len(PACKED[0]), H=2, K=8, D=4, W=3, R=3, **kw)
    check(p, np.array(PACKED, np.int32), seed)


def test_padded_row_equals_the_shorter_sequence():
    """Padding on both sides of one sequence (and a row of padding only, which keeps the initial bank)."""
    seed = fresh_seed(50)
    p = random_problem(seed, B=2, T=14, H=2, K=8, D=4, W=3, R=2, distinct=False, repeats=True)
    ids = np.array([[-1] * 3 + [4] * 9 + [-2] * 2, [-1] * 14], np.int32)
    check(p, ids, seed)


def test_segment_ids_errors():
    p = random_problem(0, B=2, T=6, H=1, K=8, D=4, W=2, R=2)
    good = np.zeros((2, 6), np.int32)
    with pytest.raises(ValueError, match=r"`segment_ids` has shape \(2, 5\), expected \[B, T\] = \[2, 6\]"):
        sdm_write_read(**p, impl="xla", segment_ids=good[:, :5])
    with pytest.raises(TypeError, match="`segment_ids` has dtype float32"):
        sdm_write_read(**p, impl="xla", segment_ids=good.astype(np.float32))
    for impl in ("auto", "ffi"):
        with pytest.raises(NotImplementedError, match="segment_ids.*impl='xla'"):
            sdm_write_read(**p, impl=impl, segment_ids=good)


def test_check_mode_ignores_padding_ids():
    p = random_problem(1, B=1, T=6, H=1, K=8, D=4, W=2, R=2)
    ids = np.array([[0, 0, 0, 0, -1, -1]], np.int32)
    p["k_idx"][:, 4:] = -7  # padding tokens: their ids are not used, nor checked
    y, _ = sdm_write_read(**p, impl="reference", segment_ids=ids, check=True)
    assert np.all(np.asarray(y)[:, 4:] == 0)
    p["k_idx"][:, 1] = 8
    with pytest.raises(Exception, match=r"write slot ids \(k_idx\) outside \[0, K=8\)"):
        sdm_write_read(**p, impl="reference", segment_ids=ids, check=True)

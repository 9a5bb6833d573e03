"""Check `jax_sdm.nn.load_reference_state_dict` against the PyTorch reference layer itself.

    python benchmarks/check_reference_layer.py [--device cuda] [--dtype float32,bfloat16] [--T 256]

Needs torch and the reference package (`SparseDeltaMemory`, `SparseDeltaMemoryArgs`, importable as
`lingua.sparse_delta_memory`, `sparse_delta_memory` or `sdm`); without them it prints why it skipped and exits 0.
For each configuration (the reference's defaults plus the options named in the row) it builds the reference layer,
runs its `init_weights`, feeds it a random input in eval and in training mode, loads its `state_dict` into a
`jax_sdm.nn.SparseDeltaMemory` and prints the relative L2 error of our output and final memory against its
own. Exits 1 if an error passes the tolerance (1e-4 for float32, 3e-2 for bfloat16).
"""
import argparse
import importlib
import sys

import numpy as np

CONFIGS = {
    "defaults (H 1)": dict(num_heads=1),
    "H 2, output gate, normalized readings": dict(num_heads=2, output_gate=True, normalize_readings=True),
    "query batchnorm": dict(num_heads=1, query_batchnorm=True, output_gate=True),
    "key-weighted decay, l2 reads": dict(num_heads=2, key_weighted_decay=True, read_act="l2_normalize"),
    "no learned memory, softmax scales": dict(num_heads=1, backprop_on_memory=False, read_act_scale=2.0,
                                              write_act_scale=0.5),
}
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def reference_package():
    """`(torch, module)` or the reason they cannot be imported."""
    try:
        import torch
    except ImportError as err:
        return None, f"torch is not importable ({err})"
    for name in ("lingua.sparse_delta_memory", "sparse_delta_memory", "sdm"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "SparseDeltaMemory") and hasattr(module, "SparseDeltaMemoryArgs"):
            return (torch, module), None
    return None, "the reference package (SparseDeltaMemory, SparseDeltaMemoryArgs) is not importable"


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--slots", type=int, default=1024)
    parser.add_argument("--writes", type=int, default=8)
    parser.add_argument("--reads", type=int, default=8)
    opts = parser.parse_args(argv)
    found, why = reference_package()
    if found is None:
        print(f"skipped: {why}")
        return 0
    torch, ref = found
    import jax.numpy as jnp
    from flax import nnx

    from jax_sdm.nn import load_reference_state_dict

    call = nnx.jit(lambda m, x: m(x))

    failed = False
    print("| config | dtype | mode | output rel err | final memory rel err |")
    print("|---|---|---|---|---|")
    for dtype_name in opts.dtype.split(","):
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
        for name, options in CONFIGS.items():
            torch.manual_seed(0)
            args = ref.SparseDeltaMemoryArgs(dim=opts.dim, slots_per_head=opts.slots, num_writes=opts.writes,
                                             num_reads=opts.reads, memory_block_size=64, **options)
            layer = ref.SparseDeltaMemory(args, 0).to(opts.device)
            layer.init_weights()
            layer = layer.to(torch_dtype)
            x = torch.randn(opts.B, opts.T, opts.dim, device=opts.device, dtype=torch_dtype)
            state_dict = {k: v for k, v in layer.state_dict().items()}
            ours = load_reference_state_dict(state_dict, args, dtype=getattr(jnp, dtype_name))
            x_ours = jnp.asarray(x.float().cpu().numpy(), getattr(jnp, dtype_name))
            for mode in ("eval", "train"):
                getattr(layer, mode)()
                getattr(ours, mode)()
                with torch.no_grad() if mode == "eval" else torch.enable_grad():
                    out, cache = layer(x)
                want_y = out.detach().float().cpu().numpy()
                H = args.num_heads
                want_bank = cache.memory.detach().float().cpu().numpy().reshape(
                    opts.B, H, opts.slots, opts.dim // H)
                y, bank = call(ours, x_ours)
                err_y, err_bank = rel_err(y, want_y), rel_err(bank, want_bank)
                # In training mode the reference's returned memory need not be the final one: not compared.
                bad = max(err_y, err_bank if mode == "eval" else 0.0) > TOLERANCE[dtype_name]
                failed |= bad
                bank_text = f"{err_bank:.2e}" if mode == "eval" else f"({err_bank:.2e}, not compared)"
                print(f"| {name} | {dtype_name} | {mode} | {err_y:.2e} | {bank_text} |{' FAIL' if bad else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""XLA's compile for an NVIDIA H200 on a machine without a GPU: the optimized HLO and the buffer assignment that the
GPU machine would run, to count a step's kernels or read a call's memory while no device is lent.

    python benchmarks/deviceless.py decode [--K 4096] [--unroll 1] [--hlo FILE]   # kernels a decode step launches
    python benchmarks/deviceless.py memory [memory.py's arguments]              # memory.py's table for the H200

Needs the CUDA plugin of the installed jaxlib, which installs without a GPU (`pip install jax-cuda13-plugin==V
jax-cuda13-pjrt==V`, V = jaxlib's version), and jax_sdm built with its CUDA module (`SDM_CUDA=ON`,
`-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real`): XLA compiles a custom call only where its target is registered.
The plugin's CUDA checks are skipped and the CPU stays jax's default backend; `jax_sdm` picks its GPU routes
because `jax.default_backend()` answers "gpu" here. Nothing runs on the H200 description: times need the device.
The jaxlib here may be older than the GPU machine's, whose XLA can fuse differently.
"""
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402

# The H200's description for XLA's GPU compiler (a GpuTargetConfigProto; its numbers from the device's properties).
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: 150121988096  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
runtime_version { major: 13 minor: 0 patch: 0 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""


def h200():
    """A sharding on the described H200; from here on `jax.default_backend()` answers "gpu"."""
    from jax.experimental.topologies import get_topology_desc
    device = get_topology_desc("h200", "cuda", target_config=H200, topology="1x1x1").devices[0]
    jax.default_backend = lambda: "gpu"
    from jax_sdm import lowering
    if not lowering.HAS_CUDA_MODULE:
        sys.exit("deviceless.py: jax_sdm has no CUDA module in this build (build it with SDM_CUDA=ON)")
    return jax.sharding.SingleDeviceSharding(device)


def on(sharding, tree):
    """`tree`'s arrays and shape structs as shape structs placed by `sharding`."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def computations(text):
    """{name: body text} of an HLO module's text."""
    return {m.group(1): m.group(2) for m in re.finditer(r"\n(?:ENTRY )?(%[\w.\-]+) \(.*?\{\n(.*?)\n\}", text, re.S)}


def launches(body):
    """The instructions of a computation that launch work on the GPU: (name, opcode, shape, target or kind)."""
    out = []
    for line in body.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\(", line)
        if not m or m.group(3) not in ("fusion", "custom-call", "copy", "while", "conditional", "all-reduce"):
            continue
        what = re.search(r'custom_call_target="([^"]+)"|kind=(\w+)', line)
        out.append((m.group(1), m.group(3), m.group(2)[:60], what and (what.group(1) or what.group(2))))
    return out


def decode(argv):
    ap = argparse.ArgumentParser(prog="deviceless.py decode",
                                 description="The kernels one step of the layer's decode loop launches.")
    ap.add_argument("--K", type=int, default=4096, help="slots per head (bench_layer.py --layer-decode's layer)")
    ap.add_argument("--unroll", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hlo", help="write the optimized module's text here")
    a = ap.parse_args(argv)
    sharding = h200()
    from flax import nnx

    import bench_layer
    from jax_sdm.nn.layer import _decode_loop
    layer, x = bench_layer.decode_layer(a.K, a.steps, {})
    graphdef, params = nnx.split(layer)
    state = jax.ShapeDtypeStruct((x.shape[0], layer.num_heads, a.K, layer.head_dim), layer.dtype)
    loop = jax.jit(lambda p, x, s: _decode_loop(graphdef, p, x, s, a.unroll), donate_argnums=2)
    text = loop.lower(*on(sharding, (params, x, state))).compile().as_text()
    if a.hlo:
        with open(a.hlo, "w") as f:
            f.write(text)
    bodies = computations(text)
    for body_name in re.findall(r"while\(.*?body=(%[\w.\-]+)", text):
        found = launches(bodies[body_name])
        print(f"decode loop at K {a.K}, unroll {a.unroll}: {len(found)} launches an iteration ({body_name})")
        for name, op, shape, what in found:
            print(f"  {name:40s} {op:12s} {what or '':24s} {shape}")


def memory(argv):
    sharding = h200()
    import memory as memory_tool
    memory_tool.main(argv, place=lambda tree: on(sharding, tree))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {"decode": decode, "memory": memory}
    if not argv or argv[0] not in commands:
        sys.exit(__doc__)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()

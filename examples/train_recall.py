"""Train a small model with the SDM layer on associative recall, from the command line.

    python examples/train_recall.py [--steps 300] [--impl auto] [--save DIR]

Prints the loss and accuracy as it trains, then the accuracy on fresh sequences, both for whole-sequence calls
and for prefill + token-by-token decoding. `--save DIR` writes the trained parameters with Orbax
(`examples/decode.py --checkpoint DIR` loads them). Needs the `nn` extra (`pip install "jax_sdm[nn]"`), and
orbax-checkpoint for `--save`. The task, model and training loop are `jax_sdm.nn.recall`, which
`notebooks/03_training.ipynb` uses too.
"""
import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jax_sdm.nn import recall


def parser(description=__doc__.split("\n\n")[0]):
    """The task and model options (shared with `examples/decode.py`) and the training options."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs per sequence")
    p.add_argument("--queries", type=int, default=8, help="keys asked again per sequence")
    p.add_argument("--keys", type=int, default=16, help="distinct key tokens")
    p.add_argument("--values", type=int, default=16, help="distinct value tokens")
    p.add_argument("--slots", type=int, default=64, help="memory slots per head")
    p.add_argument("--addressing", choices=("product_key", "topk"), default="product_key")
    p.add_argument("--impl", choices=("auto", "ffi", "xla", "reference"), default="auto")
    p.add_argument("--eval-batch", type=int, default=256, help="sequences per evaluation batch (4 batches)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--target", type=float, default=0.95, help="exit with status 1 below this accuracy")
    p.add_argument("--save", type=Path, help="directory to save the trained parameters in (Orbax; replaced if present)")
    return p


def task_and_model(args):
    task = recall.RecallTask(num_keys=args.keys, num_values=args.values, num_pairs=args.pairs,
                             num_queries=args.queries)
    model = recall.default_model(task, seed=args.seed, impl=args.impl, slots_per_head=args.slots,
                                 addressing=args.addressing)
    return task, model


def main(argv=None):
    args = parser().parse_args(argv)
    task, model = task_and_model(args)
    print(f"jax {jax.__version__} on {jax.default_backend()}; task: {task}; sequence length {task.seq_len}")
    print(f"memory layer: {model.memory.num_heads} heads x {model.memory.slots_per_head} slots x "
          f"{model.memory.head_dim}, {model.memory.num_writes} writes / {model.memory.num_reads} reads per token, "
          f"{model.memory.addressing} addressing, impl={args.impl}")

    def log(step, loss, accuracy, seconds):
        print(f"step {step:5d}/{args.steps}  loss {loss:.4f}  accuracy {accuracy:.3f}  {seconds:6.1f} s", flush=True)

    recall.train(model, task, steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                 seed=args.seed, log_every=args.log_every, log=log)
    accuracy = recall.evaluate(model, task, batch_size=args.eval_batch)
    tokens, _, _ = task.batch(np.random.default_rng(args.seed + 1), args.eval_batch)
    start = time.perf_counter()
    answers = recall.decode_answers(model, task, tokens)
    decode_accuracy = float(np.mean(np.asarray(answers) == tokens[:, task.prompt_len + 1::2]))
    print(f"final accuracy: {accuracy:.4f} (whole sequences), {decode_accuracy:.4f} (prefill + decode, "
          f"{time.perf_counter() - start:.1f} s)")
    if args.save is not None:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(args.save.resolve(), nnx.state(model, nnx.Param), force=True)
        checkpointer.wait_until_finished()
        print(f"saved the parameters in {args.save}")
    return 0 if min(accuracy, decode_accuracy) >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())

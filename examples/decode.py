"""Prefill a prompt, then decode one token at a time with a model built on the SDM layer.

    python examples/decode.py [--checkpoint DIR] [--steps 150] [--impl auto]

With `--checkpoint DIR` it loads the parameters saved by `examples/train_recall.py --save DIR` (pass the same
model options); otherwise it first trains a model for `--steps` steps. It then answers the queries of a few
associative-recall sequences by decoding: one call over the prompt (the key-value pairs), then one call per token
with `T = 1` and the carried state (the memory bank and the previous token). It prints the answers, the decode
accuracy on a larger batch, and the time per decoded token.
"""
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import train_recall  # examples/train_recall.py: the shared options and model
from jax_sdm.nn import recall


def main(argv=None):
    p = train_recall.parser(__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="directory written by train_recall.py --save")
    p.add_argument("--show", type=int, default=3, help="sequences to print")
    p.set_defaults(steps=150)
    args = p.parse_args(argv)
    task, model = train_recall.task_and_model(args)
    if args.checkpoint:
        import orbax.checkpoint as ocp

        params = nnx.state(model, nnx.Param)
        nnx.update(model, ocp.StandardCheckpointer().restore(Path(args.checkpoint).resolve(), params))
        print(f"loaded the parameters from {args.checkpoint}")
    else:
        print(f"no --checkpoint: training for {args.steps} steps first")
        recall.train(model, task, steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                     seed=args.seed, log=None)

    name = lambda t: f"k{t}" if t < task.num_keys else f"v{t - task.num_keys}"
    tokens, _, _ = task.batch(np.random.default_rng(args.seed + 2), args.eval_batch)
    answers = np.asarray(recall.decode_answers(model, task, tokens))
    truth = tokens[:, task.prompt_len + 1::2]
    for b in range(min(args.show, len(tokens))):
        print("prompt: ", " ".join(name(t) for t in tokens[b, :task.prompt_len]))
        print("decoded:", "  ".join(f"{name(q)} -> {name(a)}{'' if a == t else ' (wrong)'}"
                                    for q, a, t in zip(tokens[b, task.prompt_len::2], answers[b], truth[b])))
    print(f"decode accuracy over {len(tokens)} sequences: {np.mean(answers == truth):.4f}")

    # Time per decoded token: one jitted call with T = 1 and the state, after a warm-up call.
    state = model.init_state(len(tokens))
    _, state = recall.decode_call(model, jnp.asarray(tokens[:, :task.prompt_len]), state)
    token = jnp.asarray(tokens[:, task.prompt_len:task.prompt_len + 1])
    _, state = jax.block_until_ready(recall.decode_call(model, token, state))  # compile; the state is donated
    times = []
    for _ in range(20):
        start = time.perf_counter()
        logits, state = jax.block_until_ready(recall.decode_call(model, token, state))
        times.append(time.perf_counter() - start)
    print(f"decode: {1e3 * statistics.median(times):.3f} ms per step for {len(tokens)} sequences "
          f"(median of 20 jitted calls, batch {len(tokens)}, {jax.default_backend()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

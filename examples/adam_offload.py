"""Train a wide embedding model with AdamOffload: Adam's state lives in host memory.

A bag-of-words classifier whose embedding table holds nearly all the parameters,
so Adam's two moments (twice the parameters) are most of the training memory.
``tf_msopt.AdamOffload`` keeps them on the host (``host_device``, the CPU by
default) and computes each update there; on a GPU machine only the weights and
``w += delta`` stay in accelerator memory. The train step must not be
XLA-compiled, hence ``jit_compile=False``.

    python examples/adam_offload.py [--epochs 3] [--steps 40] [--vocab 50000] [--width 256]
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_msopt as mso  # noqa: E402

CLASSES = 8
TOKENS_PER_EXAMPLE = 16


def make_data(examples, vocab, seed=0):
    """Random token bags; the label is the most frequent hidden topic of a bag's tokens."""
    rng = np.random.default_rng(seed)
    topic_of_token = rng.integers(0, CLASSES, size=vocab)
    tokens = rng.integers(0, vocab, size=(examples, TOKENS_PER_EXAMPLE))
    counts = np.stack([(topic_of_token[tokens] == c).sum(axis=1) for c in range(CLASSES)], 1)
    return tokens.astype("int32"), counts.argmax(axis=1).astype("int32")


def make_model(vocab, width):
    return keras.Sequential([
        keras.Input((TOKENS_PER_EXAMPLE,), dtype="int32"),
        keras.layers.Embedding(vocab, width, name="embedding"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(64, activation="relu", name="hidden"),
        keras.layers.Dense(CLASSES, name="logits"),
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--host-device", default="/CPU:0")
    parser.add_argument("--json", action="store_true", help="print a JSON summary last")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    x, y = make_data(args.steps * args.batch, args.vocab)
    model = make_model(args.vocab, args.width)
    optimizer = mso.AdamOffload(
        learning_rate=1e-2, weight_decay=1e-6, host_device=args.host_device,
        # MindSpore-style groups: no decay for the dense layers' biases.
        groups=[{"params": ["bias"], "weight_decay": 0.0}])
    model.compile(optimizer=optimizer, jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    parameters = model.count_params()
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False,
                        verbose=0)
    seconds = time.perf_counter() - start
    state = [v for v in optimizer.variables
             if v is not optimizer.iterations and v is not optimizer._learning_rate]
    state_bytes = sum(v.numpy().nbytes for v in state)
    steps = int(optimizer.iterations.numpy())

    print(f"{parameters:,} parameters ({model.get_layer('embedding').count_params():,} in the "
          f"embedding); Adam state {state_bytes / 2**20:.1f} MiB on "
          f"{state[0].value.device}; {mso.ops.custom_ops_status()}")
    for epoch, (loss, accuracy) in enumerate(zip(history.history["loss"],
                                                 history.history["accuracy"]), start=1):
        print(f"epoch {epoch}: loss {loss:.4f} accuracy {accuracy:.3f}")
    print(f"{steps} steps in {seconds:.1f} s ({seconds / steps * 1e3:.0f} ms/step)")
    if args.json:
        print(json.dumps({"parameters": parameters, "steps": steps,
                          "loss": [float(v) for v in history.history["loss"]],
                          "optimizer_state_bytes": state_bytes,
                          "optimizer_state_on": state[0].value.device,
                          "seconds": round(seconds, 2)}))


if __name__ == "__main__":
    main()

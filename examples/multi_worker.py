"""Multi-worker training with a custom loop, checkpointed so a killed run resumes.

Keras 3.15's `model.fit` fails under `MultiWorkerMirroredStrategy` with more than
one worker, so multi-worker training uses a custom loop (docs/distributed.md).
This is the loop to copy: any optimizer of the package, optionally inside
`mso.LossScaleOptimizer`, with a `tf.train.CheckpointManager` that saves every
`--save-every` steps and restores the latest checkpoint on start.

Launch one process per worker, each with its own TF_CONFIG, for example on one
machine:

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
                "task": {"type": "worker", "index": 0}}' python examples/multi_worker.py &
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
                "task": {"type": "worker", "index": 1}}' python examples/multi_worker.py

Without TF_CONFIG it trains as a single worker. Run: python examples/multi_worker.py
[--optimizer thor] [--loss-scale] [--steps 60] [--checkpoint-dir /tmp/ckpt]
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402

GLOBAL_BATCH = 16

OPTIMIZERS = {
    "addsign": lambda model: mso.AddSign(learning_rate=0.01),
    "powersign": lambda model: mso.PowerSign(learning_rate=0.01, logbase=1.0),
    "lars": lambda model: mso.LARS(keras.optimizers.SGD(0.1, momentum=0.9), coefficient=0.01),
    "adam_offload": lambda model: mso.AdamOffload(learning_rate=0.01, weight_decay=1e-4),
    # Statistics are all-reduced in two buckets: layers [0, 1) and [1, 3).
    "thor": lambda model: mso.thor(model, learning_rate=0.05, damping=0.1, momentum=0.9,
                                   frequency=3, split_indices=[1]),
}


def make_data(samples=512, seed=0):
    """A fixed regression problem (inputs 6 features, targets 2)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 6)).astype("float32")
    w = rng.normal(size=(6, 2)).astype("float32")
    return x, np.tanh(x @ w).astype("float32")


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])


def make_optimizer(name, model, loss_scale=False):
    optimizer = OPTIMIZERS[name](model)
    if loss_scale:
        optimizer = mso.LossScaleOptimizer(optimizer, mso.DynamicLossScaleManager(2.0**10, 2, 4))
    return optimizer


def _checkpoint_dir(strategy, checkpoint_dir):
    """Every worker saves (the save is collective); only the chief keeps its files."""
    resolver = strategy.cluster_resolver
    if resolver is None or resolver.task_id == 0 or not resolver.cluster_spec().as_dict():
        return checkpoint_dir
    return os.path.join(checkpoint_dir, f".worker_{resolver.task_id}")


def train(strategy, optimizer_name, loss_scale=False, steps=30, checkpoint_dir=None,
          save_every=5, after_step=None):
    """Trains to ``steps`` global steps, resuming from ``checkpoint_dir`` when it has one.

    ``after_step(step)`` is called after each step (and its checkpoint) completes.
    Returns the model.
    """
    x, y = make_data()
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer(optimizer_name, model, loss_scale)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
    manager = None
    if checkpoint_dir:
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
        manager = tf.train.CheckpointManager(
            checkpoint, _checkpoint_dir(strategy, checkpoint_dir), max_to_keep=2)
        checkpoint.restore(manager.latest_checkpoint)

    # The same global batches in the same order, whatever step training resumes at.
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH)
               .skip(int(step.numpy())))
    batches = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def train_step(batch):
        def step_fn(x_batch, y_batch):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(x_batch, training=True) - y_batch),
                                             axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
                scaled = optimizer.scale_loss(loss)
            gradients = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply(gradients, model.trainable_variables)
            return loss
        return strategy.reduce("SUM", strategy.run(step_fn, args=batch), axis=None)

    loss = None
    while step.numpy() < steps:
        loss = train_step(next(batches))
        step.assign_add(1)
        if manager is not None and step.numpy() % save_every == 0:
            manager.save(checkpoint_number=int(step.numpy()))
        if after_step is not None:
            after_step(int(step.numpy()))
    if loss is not None:
        print(f"step {int(step.numpy())}: loss {float(loss):.5f}")
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="thor")
    parser.add_argument("--loss-scale", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--save-every", type=int, default=5)
    args = parser.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    model = train(strategy, args.optimizer, args.loss_scale, args.steps, args.checkpoint_dir,
                  args.save_every)
    print(json.dumps({"replicas": strategy.num_replicas_in_sync,
                      "first_weight": float(model.get_weights()[0][0, 0])}))


if __name__ == "__main__":
    main()

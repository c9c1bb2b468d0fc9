"""The torch baseline's stages built as torchtitan builds a Llama/Qwen model for TP and PP.

torchtitan (``parallelize_llama``: ``apply_tp``, ``apply_compile``, ``maybe_enable_async_tp``)
applies, per pipeline stage:

- tensor parallelism with sequence parallelism: the embedding row-parallel over the
  vocabulary with its output reduce-scattered over the sequence (``Shard(1)``); every norm
  ``SequenceParallel``; one all-gather of the normed activations before each group of
  column-parallel linears (Q/K/V, gate/up); the out- and down-projections row-parallel with
  their outputs reduce-scattered over the sequence; the final norm sequence-parallel and the
  LM head column-parallel from the sequence-sharded input, its logits left vocabulary-sharded
  for ``loss_parallel``. Between pipeline stages travels the rank's sequence shard (b, s/t, h).
- ``torch.compile(fullgraph=True)`` on every decoder layer, after TP.
- async TP: Inductor's micro-pipeline pass (``_micro_pipeline_tp``), with symmetric memory
  enabled for the TP group, fuses each all-gather with the matmul after it and each matmul
  with the reduce-scatter after it into overlapped kernels. It needs compile and CUDA.

torchtitan's block has ``attention``/``feed_forward`` submodules and puts the all-gather in
a ``PrepareModuleInput`` on them; braid's layer is flat (norms and projections side by side),
so the same all-gather sits in a ``PrepareModuleOutput`` on each norm: one all-gather forward
and one reduce-scatter backward per column-parallel group, as in torchtitan.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

from torch import nn


def check_shards(layer: nn.Module, t: int) -> None:
    """``ValueError`` unless the layer's heads, KV heads and FFN width divide by ``t``."""
    ffn = (getattr(layer, "gate_proj", None) or layer.fc1).out_features  # SwiGLU, or a ViT's fc1/fc2 MLP
    for what, n in (("heads", layer.heads), ("KV heads", layer.kv_heads), ("ffn", ffn)):
        if n % t:
            raise ValueError(f"{what} ({n}) not divisible by tp={t}")


def titan_tensor_parallel(stage: nn.Module, mesh: Any) -> nn.Module:
    """Shard a :class:`braid.baselines.torch_pp.StageModule` in place over the 1-D ``mesh`` the way torchtitan's
    ``apply_tp`` does (sequence parallelism; see the module doc). Decoder LMs only."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if stage.visual is not None:
        raise ValueError("torch mode titan runs decoder LMs (its sequence-sharded stages carry no vision tower or "
                         "M-RoPE positions); use the eager mode for a VLM")
    t = mesh.size()
    for layer in stage.layers:
        check_shards(layer, t)
        layer.heads, layer.kv_heads = layer.heads // t, layer.kv_heads // t  # the views use the local head counts
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            **{n: ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")},
            **{n: RowwiseParallel(output_layouts=Shard(1)) for n in ("o_proj", "down_proj")},
        })
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            # (b, s/t, h) -> (b, s, h), kept a DTensor so the column-parallel linears after it
            # share one all-gather forward and one reduce-scatter of their input gradients backward.
            parallelize_module(norm, mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                                               use_local_output=False))
    if stage.embed is not None:
        parallelize_module(stage.embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
    if stage.head is not None:
        parallelize_module(stage.norm, mesh, SequenceParallel())
        parallelize_module(stage.head, mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                             use_local_output=False))
    return stage


def compile_layers(stage: nn.Module, backend: str = "inductor") -> None:
    """``torch.compile`` every decoder layer of the stage in place (torchtitan's ``apply_compile``).

    The embedding's output enters the first compiled layer as a copy: under TP it is a view of
    a DTensor's local shard (``to_local``), and a compiled graph handed such a view returned its
    gradient as a plain tensor to the DTensor redistribution behind it (torch 2.13, gloo:
    "'Tensor' object has no attribute '_local_tensor'"). One (b, s/t, h) copy per micro-batch.
    """
    if stage.embed is not None:
        stage.embed.register_forward_hook(lambda mod, args, out: out.clone())
    for layer in stage.layers:
        layer.compile(backend=backend, fullgraph=True)


def enable_symmetric_memory(group: Any) -> None:
    """Register the TP group for symmetric memory, which Inductor's async-TP kernels allocate from
    (torchtitan does this before turning the pass on; newer torch registers groups itself)."""
    from torch.distributed import _symmetric_memory as symm

    enable = getattr(symm, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)


@contextlib.contextmanager
def compile_settings(async_tp: bool, compiled: bool) -> Iterator[None]:
    """The process-wide compiler flags a baseline's layers compile and run under, set only around its
    steps (braid's own compiled units must not see them):

    - ``async_tp``: Inductor's micro-pipeline TP pass (``_micro_pipeline_tp``).
    - ``compiled``: AOTAutograd's donated buffers off. ZB-V and DualPipeV run the input
      gradient first and the weight gradient later from the same graph (``retain_graph=True``),
      which a compiled backward that donates its saved tensors refuses; every schedule runs
      the layers compiled once (same code, same mesh), so the flag is off for all of them.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with contextlib.ExitStack() as stack:
        if async_tp:
            stack.enter_context(inductor_config.patch(_micro_pipeline_tp=True))
        if compiled:
            stack.enter_context(functorch_config.patch(donated_buffer=False))
        yield


def check_sequence(seq: int, t: int) -> None:
    """``ValueError`` unless the sequence splits evenly over the ``t`` TP ranks (sequence parallelism)."""
    if seq % t:
        raise ValueError(f"torch mode titan shards the sequence over tp={t}: seq {seq} is not divisible by it")


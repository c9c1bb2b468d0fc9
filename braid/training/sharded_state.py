"""Model and optimizer state keyed by the single-device model's parameter names, for ``torch.distributed.checkpoint``.

A rank holds pieces of the model (pipeline chunks, TP blocks of their weights). For a
checkpoint that any other layout can resume, each rank presents its pieces under their
*global* names (:class:`~braid.models.global_names.ShardSpec`), built with
``torch.distributed.checkpoint.state_dict``'s helpers over a :class:`GlobalView` -- a module
tree whose parameters are this rank's parameters under their global names:

* ``get_model_state_dict(view)`` gives ``{global name: local tensor}``; a TP block becomes a
  ``DTensor`` sharded over the TP group (``Shard(dim)``), so the checkpoint records it as
  a block of the global tensor and a reader at another tp reads exactly the elements it
  needs (DCP reshards); whole tensors are plain (DCP keeps one copy of each);
* ``get_optimizer_state_dict(view, opt)`` with ``flatten_optimizer_state_dict`` gives
  ``state.{global name}.{exp_avg,...}`` and ``param_groups.{global name}.{lr,...}`` (the
  per-parameter form that lets another pipeline split pick its own parameters); state
  tensors shaped like their TP block are sharded as the parameter is.

:class:`ModelState` and :class:`OptimizerState` are ``Stateful``: ``dcp.save`` calls
their ``state_dict()``, ``dcp.load`` fills it in place and hands it to
``load_state_dict()``. An optimizer with its own sharded state (e.g. over data-parallel
ranks) plugs in as any other ``Stateful`` whose keys are global names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from braid.models.global_names import ShardSpec


def _options() -> Any:
    """Per-parameter optimizer keys (``state.{name}.{key}``), so another pipeline split finds its parameters' state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


class GlobalView(nn.Module):
    """A module whose parameters are given ones under dotted global names (no copies)."""

    def __init__(self, named: dict[str, nn.Parameter]) -> None:
        super().__init__()
        for name, p in named.items():
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, nn.Module())
                mod = mod._modules[part]
            mod.register_parameter(leaf, p)


class ShardedParams:
    """This rank's parameters with their :class:`ShardSpec`, the view, and the device meshes their blocks
    are split over (``tp_group``'s; ``ep_group``'s for experts sharded over expert-parallel ranks)."""

    def __init__(self, shards: dict[nn.Parameter, ShardSpec], tp_group: Any = None, ep_group: Any = None) -> None:
        self.shards = shards
        self.by_name = {s.name: (p, s) for p, s in shards.items()}
        self.view = GlobalView({s.name: p for p, s in shards.items()})
        self.meshes: dict[str, Any] = {}
        for over, group in (("tp", tp_group), ("ep", ep_group)):
            if any(s.dim is not None and s.over == over for s in shards.values()):
                from torch.distributed.device_mesh import DeviceMesh

                self.meshes[over] = DeviceMesh.from_group(group, next(iter(shards)).device.type)

    def to_global(self, name: str, t: Any) -> Any:
        """``t`` (a local tensor of parameter ``name``'s shape) as a block of the global tensor."""
        entry = self.by_name.get(name)
        if entry is None or not isinstance(t, torch.Tensor):
            return t
        p, spec = entry
        if spec.dim is None or t.shape != p.shape:
            return t
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(t, self.meshes[spec.over], [Shard(spec.dim)], run_check=False)


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ModelState:
    """``Stateful`` model weights under global names."""

    def __init__(self, params: ShardedParams) -> None:
        self.params = params

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.params.view)
        return {k: self.params.to_global(k, v) for k, v in sd.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.params.view, {k: _local(v) for k, v in sd.items()})


class OptimizerState:
    """``Stateful`` state of a ``torch.optim`` optimizer over the view's parameters, under global names."""

    def __init__(self, params: ShardedParams, optimizer: torch.optim.Optimizer) -> None:
        self.params, self.optimizer = params, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        sd = get_optimizer_state_dict(self.params.view, self.optimizer, options=_options())
        return {k: self.params.to_global(_param_of(k), v) for k, v in sd.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.params.view, self.optimizer, {k: _local(v) for k, v in sd.items()}, options=_options())


def _param_of(key: str) -> str:
    """``state.layers.0.q_proj.weight.exp_avg`` -> ``layers.0.q_proj.weight``; other keys -> ``""``."""
    if not key.startswith("state."):
        return ""
    return key[len("state."):].rsplit(".", 1)[0]

"""Model families by name, like the schedule registry (:mod:`braid.schedules.registry`).

A family is one module that implements the model seam (:mod:`braid.models.seam`) and calls
:func:`register` at import with a :class:`Family`: its model class, how its configuration
reads from and writes to a Hugging Face ``config.json``, and how its parameter names map to
checkpoint tensor names. :mod:`braid.hf` dispatches on ``config["model_type"]`` through
:func:`family_for_hf`. Adding a family is its module plus one line in ``_MODULES``.

Most families store each parameter as one checkpoint tensor of the same shape (``hf_key``
is all they give). A family whose checkpoint fuses or reshapes tensors (Qwen2-VL's fused
vision ``qkv``, its ``Conv3d`` patch embedding) also gives ``hf_weights``: an
:class:`HFWeights` per configuration and checkpoint.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Protocol

if TYPE_CHECKING:
    import torch

# One line per family module; importing it registers the family.
_MODULES: tuple[str, ...] = (
    "braid.models.qwen2",
    "braid.models.llama",
    "braid.models.qwen3",
    "braid.models.qwen3_moe",
    "braid.models.hf_qwen2_vl",
    "braid.models.mcore",  # megatron-core's GPT model (imports megatron-core only when one is built)
)


class HFWeights(Protocol):
    """How a family's parameters (single-device model names) sit in one checkpoint layout."""

    def key(self, name: str) -> str:
        """The checkpoint tensor parameter ``name`` is read from (the first, where it is read from several)."""
        ...

    def keys(self, name: str) -> tuple[str, ...]:
        """Every checkpoint tensor parameter ``name`` is read from (one, or a stack's parts)."""
        ...

    def read(self, name: str, tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Parameter ``name``'s values, given ``tensor(key)`` that reads one checkpoint tensor."""
        ...

    def write(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors of ``state`` (parameter name -> tensor; a part of the model is fine
        as long as tensors stored together are all in it)."""
        ...


@dataclass(frozen=True, slots=True)
class OneToOne:
    """Each parameter is one checkpoint tensor of the same shape, named by ``hf_key``."""

    hf_key: Callable[[str], str]

    def key(self, name: str) -> str:
        return self.hf_key(name)

    def keys(self, name: str) -> tuple[str, ...]:
        return (self.hf_key(name),)

    def read(self, name: str, tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return tensor(self.hf_key(name))

    def write(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.hf_key(n): t for n, t in state.items()}


@dataclass(frozen=True, slots=True)
class Family:
    """What the runtime and :mod:`braid.hf` need to know about a model family.

    ``model_cls(cfg)`` builds the single-device model (it implements
    :class:`braid.models.seam.StageModel` for LMs); ``hf_model_types``: the
    ``config.json`` ``model_type`` values it reads; ``from_hf(config_dict)`` -> braid
    config (``ValueError`` naming what is unsupported); ``to_hf(cfg)`` -> ``config.json``
    dict (``architectures`` and ``model_type`` included); ``hf_key(name)``: a braid
    parameter name -> the checkpoint tensor name; ``hf_weights(cfg, keys)`` (optional): the
    :class:`HFWeights` of a checkpoint holding tensors ``keys`` (None: the layout written).
    """

    name: str
    model_cls: type
    config_cls: type
    hf_model_types: tuple[str, ...]
    from_hf: Callable[[dict[str, Any]], Any]
    to_hf: Callable[[Any], dict[str, Any]]
    hf_key: Callable[[str], str]
    description: str = ""
    hf_weights: Callable[[Any, Collection[str] | None], HFWeights] | None = None

    def weights(self, cfg: Any, keys: Collection[str] | None = None) -> HFWeights:
        """The checkpoint layout of ``cfg``'s model (read: the one ``keys`` show; None: the one written)."""
        return OneToOne(self.hf_key) if self.hf_weights is None else self.hf_weights(cfg, keys)


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` (its name and its HF model types must be new)."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} registered twice")
    taken = {t: f.name for f in _FAMILIES.values() for t in f.hf_model_types}
    for t in family.hf_model_types:
        if t in taken:
            raise ValueError(f"HF model_type {t!r} of {family.name!r} already read by {taken[t]!r}")
    _FAMILIES[family.name] = family
    return family


def _load() -> None:
    for mod in _MODULES:
        importlib.import_module(mod)


def names() -> list[str]:
    _load()
    return list(_FAMILIES)


def get_family(name: str) -> Family:
    _load()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; valid names: {', '.join(_FAMILIES)}") from None


def family_for_hf(model_type: str) -> Family:
    """The family that reads a ``config.json`` of ``model_type``."""
    _load()
    for f in _FAMILIES.values():
        if model_type in f.hf_model_types:
            return f
    known = sorted(t for f in _FAMILIES.values() for t in f.hf_model_types)
    raise ValueError(f"unsupported HF model_type {model_type!r}; braid reads: {', '.join(known)}")


def _most_derived(obj: object, kind: str) -> Family:
    """The family whose ``kind`` class (``model_cls`` or ``config_cls``) ``obj`` is an instance of, the most
    derived match first (a Llama model or config is also a Qwen2 one)."""
    _load()
    for f in sorted(_FAMILIES.values(), key=lambda f: -len(getattr(f, kind).__mro__)):
        if isinstance(obj, getattr(f, kind)):
            return f
    what = "model" if kind == "model_cls" else "config"
    raise ValueError(f"{type(obj).__name__} is the {what} of no registered model family ({', '.join(_FAMILIES)})")


def family_of(model: object) -> Family:
    """The family whose model class ``model`` is (the most derived match)."""
    return _most_derived(model, "model_cls")


def family_of_config(cfg: object) -> Family:
    """The family whose config class ``cfg`` is (the most derived match)."""
    return _most_derived(cfg, "config_cls")


def config_from_fields(fields_: dict[str, Any]) -> Any:
    """A family's config rebuilt from its fields (``dataclasses.asdict`` of it, as a ``--json``
    summary stores ``config.model``): the family whose config class has exactly these fields,
    the most derived first; ``ValueError`` if none has."""
    import dataclasses

    _load()
    for f in sorted(_FAMILIES.values(), key=lambda f: -len(f.config_cls.__mro__)):
        cls = f.config_cls
        if dataclasses.is_dataclass(cls) and {x.name for x in dataclasses.fields(cls) if x.init} == set(fields_):
            return cls(**fields_)
    raise ValueError(f"no registered model family's config has the fields {', '.join(sorted(fields_))}")

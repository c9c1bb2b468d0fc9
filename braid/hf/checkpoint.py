"""Hugging Face checkpoints (``config.json`` + ``*.safetensors``) in and out of braid's models.

:func:`load` reads a local directory into the single-device model of the family that
``config.json``'s ``model_type`` names (:func:`braid.models.registry.family_for_hf`);
:func:`load_meta` returns the same model on the meta device, whose chunks
(:func:`braid.models.build.build_rank_chunks`) read only their own tensors from the files,
one ``safe_open`` per tensor; :func:`save` writes a directory ``transformers``'
``from_pretrained`` loads. Needs the ``safetensors`` package (extra ``hf``), and
``huggingface_hub`` for :func:`save`'s sharding.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from braid.hf.config import read_family_config
from braid.io.files import atomic_write_text
from braid.io.inputs import InputFileError, read_json, safetensors_keys
from braid.models.build import materialize, on_meta
from braid.models.registry import Family, HFWeights, family_of


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _safetensors() -> Any:
    try:
        import safetensors  # noqa: F401
        from safetensors import safe_open
    except ImportError:
        raise ImportError("braid.hf needs the safetensors package: pip install 'braid-pipeline[hf]' (or pip install safetensors)") from None
    return safe_open


class CheckpointReader:
    """Tensor names of a checkpoint and where each lives; reads one tensor at a time.

    Sharded checkpoints are read through their ``model.safetensors.index.json``.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._safe_open = _safetensors()
        if (self.path / INDEX).is_file():
            self.files = _index_files(self.path)
        elif (self.path / SINGLE).is_file():
            self.files = {k: self.path / SINGLE for k in safetensors_keys(self.path / SINGLE)}
        else:
            raise ValueError(f"{str(path)!r}: neither {SINGLE} nor {INDEX} (only safetensors checkpoints are read)")

    def keys(self) -> set[str]:
        return set(self.files)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, read from the files' headers (no data; each file opened once)."""
        by_file: dict[Path, list[str]] = {}
        for k, f in self.files.items():
            by_file.setdefault(f, []).append(k)
        out = {}
        for f, keys in by_file.items():
            with self._safe_open(f, framework="pt", device="cpu") as h:
                out.update({k: tuple(h.get_slice(k).get_shape()) for k in keys})
        return out

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key`` on the CPU, as stored."""
        if key not in self.files:
            raise KeyError(f"{self.path}: checkpoint has no tensor {key!r}")
        try:
            with self._safe_open(self.files[key], framework="pt", device="cpu") as f:
                return f.get_tensor(key)
        except Exception as err:  # noqa: BLE001 - the Rust reader's errors name no file
            raise ValueError(f"{self.files[key]}: cannot read tensor {key!r} ({str(err).splitlines()[0]})") from None


def _index_files(path: Path) -> dict[str, Path]:
    """Tensor name -> shard of a sharded checkpoint, every shard opened and checked against the index."""
    index = path / INDEX
    d = read_json(index, "safetensors index")
    wm = d.get("weight_map")
    if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise InputFileError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file name")
    shards: dict[str, set[str]] = {}
    for shard in sorted(set(wm.values())):
        if Path(shard).name != shard:
            raise InputFileError(f"{index}: shard {shard!r} is not a file name in the checkpoint directory")
        if not (path / shard).is_file():
            raise InputFileError(f"{index}: names shard {shard!r}, which is not in {str(path)!r}")
        shards[shard] = set(safetensors_keys(path / shard))
    for key, shard in wm.items():
        if key not in shards[shard]:
            raise InputFileError(f"{index}: maps tensor {key!r} to {shard}, which does not hold it")
    return {k: path / f for k, f in wm.items()}


@dataclass
class CheckpointSource:
    """A :class:`braid.models.build.ParamSource` reading parameters from a checkpoint by name.

    ``read`` lists the checkpoint tensors read so far (tests check that a rank reads
    only its chunks' tensors).
    """

    reader: CheckpointReader
    family: Family
    device: torch.device
    weights: HFWeights
    read: list[str] = field(default_factory=list)

    def _tensor(self, key: str) -> torch.Tensor:
        self.read.append(key)
        return self.reader.tensor(key)

    def fill(self, t: torch.Tensor, name: str) -> None:
        try:
            src = self.weights.read(name, self._tensor)
        except RuntimeError as err:  # a fused tensor that does not split or reshape to the parameter
            raise ValueError(f"{self.reader.path}: tensor {self.weights.key(name)!r} does not fit parameter {name!r} ({err})") from None
        if tuple(src.shape) != tuple(t.shape):
            raise ValueError(f"{self.reader.path}: tensor {self.weights.key(name)!r} gives shape {tuple(src.shape)} for "
                             f"{name!r}, the model expects {tuple(t.shape)}")
        t.copy_(src)


def load_meta(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> nn.Module:
    """The checkpoint's model on the meta device: chunks built from it read only their tensors.

    :func:`braid.models.build.materialize` reads all of it (as :func:`load`).
    """
    _, family, cfg = read_family_config(path)
    reader = CheckpointReader(path)
    source = CheckpointSource(reader, family, torch.device(device), family.weights(cfg, reader.keys()))
    model = on_meta(family.model_cls, cfg, source, dtype)
    missing = sorted({source.weights.key(n) for n, _ in model.named_parameters()} - reader.keys())
    if missing:  # e.g. a config.json naming more layers than the files hold: refused before a tensor is read
        raise ValueError(f"{str(path)!r}: checkpoint lacks {len(missing)} tensor(s) of the {family.name} model its "
                         f"config.json describes, e.g. {missing[:3]}")
    return model


def load(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> nn.Module:
    """The single-device braid model of a local HF checkpoint directory (``config.json`` + safetensors).

    Every checkpoint tensor must be used (a tied checkpoint may also carry ``lm_head.weight``);
    a missing or unused tensor is a ``ValueError`` naming it, and so is a file that cannot be
    used (``config.json`` without a field the family needs, an index naming a missing shard, an
    empty, truncated or garbage shard: :mod:`braid.io.inputs`). LMs have ``logits(input_ids)``, VLMs
    ``logits(input_ids, pixel_values=..., image_grid_thw=...)`` (what HF's processor gives).
    """
    model = load_meta(path, dtype, device)
    check_tensors(model)
    return materialize(model)


def check_tensors(model: nn.Module) -> None:
    """A :func:`load_meta` model's checkpoint holds every tensor the model reads, with the shape it expects,
    and no tensor it does not use (a tied checkpoint may also carry ``lm_head.weight``): a ``ValueError``
    naming the first that fails. Reads the files' headers only, so a command line checks a checkpoint
    before any process group exists."""
    source: CheckpointSource = model.braid_source
    family, keys, path = source.family, source.weights.keys, source.reader.path
    want = {k for n, _ in model.named_parameters() for k in keys(n)}
    missing = sorted(want - source.reader.keys())
    if missing:
        raise ValueError(f"{str(path)!r}: checkpoint lacks {len(missing)} tensor(s) of a {family.name} model, e.g. {missing[:3]}")
    every_use = {k for n, _ in model.named_parameters(remove_duplicate=False) for k in keys(n)}  # a tied copy may be stored too
    extra = sorted(source.reader.keys() - every_use)
    if extra:
        raise ValueError(f"{str(path)!r}: {len(extra)} checkpoint tensor(s) not used by a {family.name} model, e.g. {extra[:3]}")
    shapes = source.reader.shapes()
    for key, t in source.weights.write(dict(model.named_parameters())).items():  # meta tensors in the checkpoint's layout
        if shapes[key] != tuple(t.shape):
            raise ValueError(f"{str(path)!r}: tensor {key!r} has shape {shapes[key]}, a {family.name} model of this "
                             f"config.json expects {tuple(t.shape)}")


def save(model: nn.Module, path: str | os.PathLike, max_shard_size: str | int = "5GB") -> Path:
    """Write ``model`` as a HF checkpoint directory (``config.json`` + safetensors shards) at ``path``.

    ``path`` must not exist or be an empty directory; it appears whole or not at all.
    """
    family = family_of(model)
    _safetensors()
    try:
        from huggingface_hub import save_torch_state_dict
    except ImportError:
        raise ImportError("braid.hf.save needs huggingface_hub: pip install 'braid-pipeline[hf]'") from None
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{str(path)!r} exists and is not an empty directory; give a new directory")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{str(path)!r}: directory {str(parent)!r} does not exist")
    params = dict(model.named_parameters())  # a tied head appears once, as the embedding
    dtype = next(iter(params.values())).dtype
    config = {**family.to_hf(model.cfg), "torch_dtype": str(dtype).removeprefix("torch.")}
    state = {k: t.contiguous() for k, t in family.weights(model.cfg).write({n: p.detach().to("cpu") for n, p in params.items()}).items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    try:
        save_torch_state_dict(state, tmp, max_shard_size=max_shard_size)
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target

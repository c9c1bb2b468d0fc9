"""Write a pipelined, tensor-parallel model (LM or VLM) as one Hugging Face checkpoint, each stage from its rank.

:func:`save_chunks` is collective over the job: every rank joins its chunks' TP shards
(:func:`braid.models.build.chunk_state`), then one rank per pipeline rank (TP, data- and
context-parallel rank 0) writes its stages' tensors as one safetensors shard
(``model-0000k-of-0000p.safetensors``) and global rank 0 writes ``config.json`` and
``model.safetensors.index.json``. The directory must be reachable by every writer (one
host, or a shared file system); it appears whole (renamed from a temporary directory
once every shard is written) or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from braid.io.files import atomic_write_text, plain_mode
from braid.hf.checkpoint import INDEX, _safetensors
from braid.models.build import chunk_state
from braid.models.registry import Family


def save_chunks(chunks: dict[int, Any], cfg: Any, family: Family, path: str | os.PathLike, groups: Any,
                experts: Any = None) -> Path:
    """Save this rank's part of the model in ``chunks`` (built by ``build_rank_chunks`` or
    ``build_vlm_rank_chunks``) into one checkpoint at ``path``.

    ``cfg``: the single-device model's config; ``family``: its :class:`braid.models.registry.Family`;
    ``groups``: the job's :class:`braid.runtime.distributed.ProcessGroups`; ``experts``: an expert-parallel
    run's :class:`braid.runtime.expert_parallel.ExpertGroups` (each rank's experts are gathered first). Every rank calls it.
    """
    _safetensors()
    from safetensors.torch import save_file

    target = Path(path)
    tmp = target.parent / f".{target.name}.partial"
    rank, c, p = dist.get_rank(), groups.coords, groups.topo.pp
    ok = True
    if rank == 0:
        try:
            if target.exists() and (not target.is_dir() or any(target.iterdir())):
                raise ValueError(f"{str(path)!r} exists and is not an empty directory; give a new directory")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=False)
        except (OSError, ValueError) as err:
            ok = str(err)
    verdict = [ok]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not True:
        raise ValueError(str(verdict[0]))
    tied = bool(getattr(cfg, "tie_embeddings", False))
    state: dict[str, Any] = {}
    for ci in sorted(chunks):
        state.update(chunk_state(chunks[ci], groups.tp if groups.topo.tp > 1 else None, tied=tied))
    if experts is not None and experts.ep > 1:
        from braid.runtime.expert_parallel import gather_experts

        state.update(gather_experts(chunks, experts, groups.tp if groups.topo.tp > 1 else None))
    writer = c.tp == 0 and c.dp == 0 and c.cp == 0
    fname = f"model-{c.pp + 1:05d}-of-{p:05d}.safetensors"
    mine = None
    if writer:
        tensors = {k: t.contiguous() for k, t in family.weights(cfg).write({n: t.to("cpu") for n, t in state.items()}).items()}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        plain_mode(tmp / fname)  # safetensors writes 0600; the other files of the checkpoint are 0644
        mine = (fname, sorted(tensors), sum(t.numel() * t.element_size() for t in tensors.values()))
    listing: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(listing, mine)
    if rank == 0:
        shards = [item for item in listing if item is not None]
        weight_map = {key: f for f, keys, _ in shards for key in keys}
        index = {"metadata": {"total_size": sum(n for _, _, n in shards)}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(tmp / INDEX, json.dumps(index, indent=2) + "\n")
        dtype = next(iter(state.values())).dtype
        config = {**family.to_hf(cfg), "torch_dtype": str(dtype).removeprefix("torch.")}
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    dist.barrier()
    return target

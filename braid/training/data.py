"""Real text data: local jsonl/parquet files, a local tokenizer, packed sequences, sharded over data-parallel ranks.

:class:`PackedText` reads the files with HF ``datasets`` (no network: local files only),
tokenises the text field with a tokenizer loaded from a directory (``tokenizer.json``,
as saved by ``tokenizers`` or next to an HF checkpoint; the end-of-document token from
``tokenizer_config.json`` or ``special_tokens_map.json``), joins the documents into one
stream with the end-of-document token after each, and cuts it into samples of ``seq``
tokens, Megatron-style: sample ``j`` is stream ``[j*seq, j*seq + seq + 1)``, whose first
``seq`` tokens are the inputs and last ``seq`` the labels. Sample order is a seeded
permutation per epoch, so sample ``i`` (global index) depends only on the files, the
tokenizer, ``seq`` and the seed -- every rank of every layout sees the same data.

:class:`DataCursor` hands each data-parallel rank its micro-batches of a step and keeps
the position (the next global sample) as its state dict: a resumed run continues at the
same sample.

``datasets`` and ``tokenizers`` are the optional ``data`` extra (``pip install 'braid-pipeline[data]'``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from braid.io.inputs import InputFileError, check_json_lines, read_json, read_text
from braid.io.limits import DATA_FILE, DATA_SCAN, TOKENIZER

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """Data or tokenizer that cannot be used (one line that says what to change)."""


def _require() -> tuple[Any, Any]:
    try:
        import datasets
        import tokenizers
    except ImportError as err:
        raise DataError(f"--data needs the optional packages datasets and tokenizers ({err.name} is missing): "
                        "pip install 'braid-pipeline[data]'") from None
    return datasets, tokenizers


def data_files(path: str | Path) -> tuple[str, list[str]]:
    """The ``datasets`` builder and the sorted files of a file or a directory of one format."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path {str(p)!r} does not exist")
    files = sorted(f for f in p.iterdir() if f.suffix in FORMATS) if p.is_dir() else [p]
    if not files:
        raise DataError(f"no .jsonl, .json or .parquet files in {str(p)!r}")
    kinds = {FORMATS.get(f.suffix) for f in files}
    if None in kinds:
        raise DataError(f"{str(files[0])!r}: data files must end in .jsonl, .json or .parquet")
    if len(kinds) > 1:
        raise DataError(f"{str(p)!r} mixes json and parquet files; keep one format per directory")
    for f in files:
        if f.stat().st_size > DATA_FILE.bytes:
            raise DataError(f"{f}: {f.stat().st_size:,} bytes, more than a data file may hold ({DATA_FILE.bytes >> 30} GiB); "
                            "split it into several files of one directory")
    return kinds.pop(), [str(f) for f in files]


def load_tokenizer(directory: str | Path, eos_token: str | None = None) -> tuple[Any, int]:
    """``(tokenizers.Tokenizer, eos id)`` from a tokenizer directory (``tokenizer.json``)."""
    _, tokenizers = _require()
    d = Path(directory)
    if not (d / "tokenizer.json").is_file():
        raise DataError(f"no tokenizer.json in {str(d)!r}; give --tokenizer the directory of a fast tokenizer")
    text = read_text(d / "tokenizer.json", "tokenizer.json", TOKENIZER)
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - the Rust parser raises a bare Exception
        raise DataError(f"{d / 'tokenizer.json'}: not a tokenizers tokenizer ({str(err).splitlines()[0]})") from None
    if eos_token is None:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            f = d / name
            if f.is_file():
                got = read_json(f, name).get("eos_token")
                eos_token = got.get("content") if isinstance(got, dict) else got
                if eos_token is not None and not isinstance(eos_token, str):
                    raise DataError(f"{f}: eos_token must be a string, got {eos_token!r}")
                if eos_token:
                    break
    if not eos_token:
        raise DataError(f"{str(d)!r} names no eos_token (tokenizer_config.json or special_tokens_map.json); add one")
    eos = tok.token_to_id(eos_token)
    if eos is None:
        raise DataError(f"end-of-document token {eos_token!r} is not in the tokenizer's vocabulary")
    return tok, eos


def _one_file(files: list[str]) -> str:
    return files[0] if len(files) == 1 else f"{files[0]} (or one of {len(files)} data files)"


def _why_unreadable(builder: str, files: list[str], err: BaseException) -> str:
    """One line for data ``datasets`` could not read: for JSON lines the first line that is
    not a JSON object, else the innermost cause (``datasets`` wraps the parser's error twice)."""
    if builder == "json":
        for f in files:
            try:
                text = read_text(f, "JSON lines file", DATA_SCAN)
            except InputFileError:  # too large to read whole: the parser's own words below
                break
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except ValueError as bad:
                    return f"{f}: line {n} is not valid JSON ({bad})"
                if not isinstance(doc, dict):
                    return f"{f}: line {n} is a JSON {type(doc).__name__}, expected one object per line"
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    return f"{_one_file(files)}: cannot be read as {builder} ({(str(err).splitlines() or [type(err).__name__])[0]})"


@dataclass
class PackedText:
    """Packed next-token samples from local text files; ``source[i] -> {"tokens", "labels"}`` (both ``(seq,)`` long).

    ``vocab_size``: the model's; a tokenizer with more tokens is refused. ``cache_dir``:
    where ``datasets`` keeps its Arrow files (default: its own cache).
    """

    path: str
    tokenizer: str
    seq: int
    vocab_size: int | None = None
    seed: int = 0
    shuffle: bool = True
    text_field: str = "text"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        datasets, _ = _require()
        if self.seq < 1:
            raise DataError(f"sequence length must be >= 1, got {self.seq}")
        tok, self.eos = load_tokenizer(self.tokenizer)
        if self.vocab_size is not None and tok.get_vocab_size() > self.vocab_size:
            raise DataError(f"the tokenizer has {tok.get_vocab_size()} tokens but the model's vocabulary is {self.vocab_size}; "
                            "pick a larger model or a smaller tokenizer")
        builder, files = data_files(self.path)
        for f in files:
            if Path(f).stat().st_size == 0:
                raise DataError(f"{f}: empty data file")
            if builder == "json":  # pyarrow's reader recurses without bound (a deep line crashes it): counted first
                try:
                    check_json_lines(f, "JSON lines data file", DATA_FILE)
                except InputFileError as err:
                    raise DataError(str(err)) from None
        bars = datasets.utils.logging.is_progress_bar_enabled()
        datasets.utils.logging.disable_progress_bar()  # a bad file is one line on stderr, with no bars before it
        try:
            self._read(datasets, tok, builder, files)
        finally:
            if bars:
                datasets.utils.logging.enable_progress_bar()

    def _read(self, datasets: Any, tok: Any, builder: str, files: list[str]) -> None:
        quiet = logging.getLogger("datasets")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # datasets logs a parse error before raising it: the one line comes from here
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=self.cache_dir)
        except Exception as err:  # noqa: BLE001 - datasets wraps the parser's error in its own types
            raise DataError(_why_unreadable(builder, files, err)) from None
        finally:
            quiet.setLevel(level)
        if self.text_field not in ds.column_names:
            raise DataError(f"{str(self.path)!r} has no {self.text_field!r} field (fields: {', '.join(ds.column_names)})")
        kind = str(getattr(ds.features[self.text_field], "dtype", ds.features[self.text_field]))
        if kind not in ("string", "large_string"):
            raise DataError(f"{str(self.path)!r}: field {self.text_field!r} holds {kind}, not text")
        eos, field, where = self.eos, self.text_field, str(self.path)

        def encode(batch: dict, idx: list[int]) -> dict:
            for i, t in zip(idx, batch[field]):
                if not isinstance(t, str):
                    raise DataError(f"{where!r}: document {i} has {field!r} = {t!r}, not text")
            ids = [e.ids + [eos] for e in tok.encode_batch(batch[field])]
            return {"ids": ids, "n": [len(x) for x in ids]}

        self.docs = ds.map(encode, batched=True, with_indices=True, remove_columns=ds.column_names, desc="tokenising")
        lengths = torch.tensor(self.docs.data.column("n").to_pylist(), dtype=torch.int64)
        self.starts = torch.cumsum(lengths, 0) - lengths  # stream offset of each document
        self.total = int(lengths.sum())
        self.n = (self.total - 1) // self.seq
        if self.n < 1:
            raise DataError(f"{str(self.path)!r} holds {self.total} tokens, fewer than one sample of {self.seq} + 1")
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        """Packed samples per epoch (indices beyond it wrap into later epochs)."""
        return self.n

    def _sample_of(self, i: int) -> int:
        epoch, j = divmod(i, self.n)
        if not self.shuffle:
            return j
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = self._perms[epoch] = torch.randperm(self.n, generator=g)
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
        return int(perm[j])

    def stream(self, lo: int, hi: int) -> list[int]:
        """Tokens ``[lo, hi)`` of the packed stream."""
        doc = int(torch.searchsorted(self.starts, torch.tensor(lo), right=True)) - 1
        out: list[int] = []
        while len(out) < hi - lo:
            ids = self.docs[doc]["ids"]
            skip = lo + len(out) - int(self.starts[doc])
            out += ids[skip:skip + hi - lo - len(out)]
            doc += 1
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            raise IndexError(f"sample index {i} < 0")
        j = self._sample_of(i)
        ids = torch.tensor(self.stream(j * self.seq, j * self.seq + self.seq + 1), dtype=torch.long)
        return {"tokens": ids[:-1], "labels": ids[1:]}


@dataclass
class DataCursor:
    """Which global samples a data-parallel rank takes each step, and where the run stands.

    A step takes ``dp * mbs * micro_batch_size`` consecutive global samples from ``pos``;
    replica ``r`` takes its ``mbs`` micro-batches from ``pos + r * mbs * micro_batch_size``
    (the order the single-process reference sees them in).
    """

    source: Any
    dp: int
    dp_rank: int
    mbs: int
    micro_batch_size: int
    pos: int = 0

    @property
    def per_step(self) -> int:
        return self.dp * self.mbs * self.micro_batch_size

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next step (stacked samples); advances the position."""
        first = self.pos + self.dp_rank * self.mbs * self.micro_batch_size
        out = []
        for k in range(self.mbs):
            items = [self.source[first + k * self.micro_batch_size + s] for s in range(self.micro_batch_size)]
            out.append({key: torch.stack([it[key] for it in items]) for key in items[0]})
        self.pos += self.per_step
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"pos": next global sample}`` -- the same on every rank, as a tensor for ``torch.distributed.checkpoint``."""
        return {"pos": torch.tensor(self.pos, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved global sample (any data-parallel size: positions are global)."""
        self.pos = int(state["pos"])

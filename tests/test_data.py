"""Real-data loading: local jsonl/parquet through ``datasets``, a tokenizer built and saved here
with ``tokenizers`` (no network), packing, sharding over data-parallel ranks, resuming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets", reason="the data extra (datasets, tokenizers) is not installed")
pytest.importorskip("tokenizers", reason="the data extra (datasets, tokenizers) is not installed")

DOCS = [
    "the cat sat on the mat",
    "a dog ran to the park and sat down",
    "the bird sang",
    "cats and dogs and birds",
    "on the mat the cat slept",
    "a park a dog a cat",
    "the end",
]


def make_tokenizer(directory: Path, vocab_size: int = 30) -> Path:
    """A tiny BPE tokenizer trained on DOCS, saved as an HF checkpoint's tokenizer directory is."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"]))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return directory


def write_jsonl(path: Path, docs=DOCS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    tok = make_tokenizer(root / "tok")
    write_jsonl(root / "jsonl" / "a.jsonl", DOCS[:4])
    write_jsonl(root / "jsonl" / "b.jsonl", DOCS[4:])
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(root / "docs.parquet"))
    return root, tok


def _source(root: Path, tok: Path, path: Path, **kw):
    from braid.training.data import PackedText

    return PackedText(str(path), str(tok), kw.pop("seq", 5), cache_dir=str(root / "cache"), **kw)


def test_packing_is_the_token_stream_cut_into_overlapping_windows(corpus) -> None:
    from tokenizers import Tokenizer

    root, tok = corpus
    src = _source(root, tok, root / "jsonl", shuffle=False)
    t = Tokenizer.from_file(str(tok / "tokenizer.json"))
    eos = t.token_to_id("<eos>")
    stream = [i for d in DOCS for i in t.encode(d).ids + [eos]]  # a.jsonl then b.jsonl: the documents in order
    assert len(src) == (len(stream) - 1) // 5 > 3
    for j in range(len(src)):
        s = src[j]
        assert s["tokens"].tolist() == stream[5 * j:5 * j + 5]
        assert s["labels"].tolist() == stream[5 * j + 1:5 * j + 6]
    assert src[len(src)]["tokens"].tolist() == stream[:5], "indices past the end wrap into the next epoch"


def test_jsonl_and_parquet_give_the_same_samples(corpus) -> None:
    root, tok = corpus
    a, b = _source(root, tok, root / "jsonl", seed=3), _source(root, tok, root / "docs.parquet", seed=3)
    for i in range(2 * len(a)):
        assert torch.equal(a[i]["tokens"], b[i]["tokens"]) and torch.equal(a[i]["labels"], b[i]["labels"])


def test_shuffle_is_a_seeded_permutation_per_epoch(corpus) -> None:
    root, tok = corpus
    plain = _source(root, tok, root / "jsonl", shuffle=False)
    s1, s2 = _source(root, tok, root / "jsonl", seed=1), _source(root, tok, root / "jsonl", seed=2)
    n = len(plain)
    epoch = lambda src, e: sorted(tuple(src[e * n + k]["tokens"].tolist()) for k in range(n))  # noqa: E731
    assert epoch(s1, 0) == epoch(plain, 0) == epoch(s1, 1)
    orders = [[tuple(src[k]["tokens"].tolist()) for k in range(n)] for src in (plain, s1, s2)]
    assert len({tuple(o) for o in orders}) == 3, "different seeds must give different orders"
    again = _source(root, tok, root / "jsonl", seed=1)
    assert [again[k]["tokens"].tolist() for k in range(2 * n)] == [s1[k]["tokens"].tolist() for k in range(2 * n)]


def test_cursor_shards_over_dp_and_resumes_at_the_same_sample(corpus) -> None:
    from braid.training.data import DataCursor

    root, tok = corpus
    src = _source(root, tok, root / "jsonl", seed=5)
    one = DataCursor(src, dp=1, dp_rank=0, mbs=4, micro_batch_size=1)
    two = [DataCursor(src, dp=2, dp_rank=r, mbs=2, micro_batch_size=1) for r in range(2)]
    for _ in range(3):
        whole = [mb["tokens"] for mb in one.next_step()]
        split = [mb["tokens"] for c in two for mb in c.next_step()]
        assert all(torch.equal(a, b) for a, b in zip(whole, split)) and len(split) == 4
    state = two[0].state_dict()
    assert int(state["pos"]) == 12 == one.pos
    resumed = DataCursor(src, dp=1, dp_rank=0, mbs=2, micro_batch_size=2)
    resumed.load_state_dict(state)
    want = torch.cat([mb["tokens"] for mb in one.next_step()])
    got = torch.cat([mb["tokens"] for mb in resumed.next_step()])
    assert torch.equal(got, want)


def test_bad_inputs_are_one_clear_error(corpus, tmp_path) -> None:
    from braid.training.data import DataError

    root, tok = corpus
    with pytest.raises(DataError, match="does not exist"):
        _source(root, tok, tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="no tokenizer.json"):
        _source(root, tmp_path, root / "jsonl")
    with pytest.raises(DataError, match="model's vocabulary is 8"):
        _source(root, tok, root / "jsonl", vocab_size=8)
    with pytest.raises(DataError, match="no 'body' field"):
        _source(root, tok, root / "jsonl", text_field="body")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="must end in"):
        _source(root, tok, tmp_path / "notes.txt")
    with pytest.raises(DataError, match="fewer than one sample"):
        _source(root, tok, write_jsonl(tmp_path / "short.jsonl", ["cat"]), seq=50)


def test_missing_packages_name_the_extra(monkeypatch) -> None:
    import builtins

    from braid.training import data

    real = builtins.__import__

    def fake(name, *a, **kw):
        if name == "datasets":
            raise ImportError("no datasets", name="datasets")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(data.DataError, match=r"pip install 'braid-pipeline\[data\]'"):
        data.PackedText("x", "y", 4)


@pytest.mark.parametrize("name,content,fragment", [
    ("d.jsonl", '{"text": "a b"}\n{"text": \n', "d.jsonl: line 2 is not valid JSON"),
    ("d.jsonl", '{"text": "a b"}\n[1]\n', "d.jsonl: line 2 is a JSON list, expected one object per line"),
    ("d.jsonl", "", "d.jsonl: empty data file"),
    ("d.jsonl", '{"text": 5}\n{"text": 6}\n', "field 'text' holds int64, not text"),
    ("d.jsonl", '{"text": "the cat"}\n{"text": null}\n', "document 1 has 'text' = None, not text"),
    ("d.parquet", b"\x00garbage" * 64, "d.parquet: cannot be read as parquet"),
    ("d.jsonl", '{"text": "a"}\n{"x": ' + "[" * 10**5 + "]" * 10**5 + "}\n",  # pyarrow's reader: a segfault
     "d.jsonl: nested too deeply (100,001 levels; a JSON lines data file has at most 64)"),
])
def test_bad_data_files_are_one_line_naming_the_file(corpus, tmp_path, name, content, fragment) -> None:
    from braid.training.data import DataError

    root, tok = corpus
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError) as info:
        _source(root, tok, f)
    msg = str(info.value)
    assert fragment in msg and name in msg and "\n" not in msg, msg


@pytest.mark.parametrize("name,content,fragment", [
    ("tokenizer.json", '{"model": ', "tokenizer.json: not a tokenizers tokenizer"),
    ("tokenizer.json", b"\xff\xfe", "tokenizer.json: not a UTF-8 text file"),
    ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json: expected a JSON object, got list"),
    ("tokenizer_config.json", "{", "tokenizer_config.json: not valid JSON"),
    ("tokenizer_config.json", '{"eos_token": 3}', "tokenizer_config.json: eos_token must be a string"),
])
def test_bad_tokenizer_files_are_one_line_naming_the_file(corpus, tmp_path, name, content, fragment) -> None:
    import shutil

    from braid.training.data import load_tokenizer

    _, tok = corpus
    d = Path(shutil.copytree(tok, tmp_path / "tok"))
    (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as info:
        load_tokenizer(d)
    msg = str(info.value)
    assert fragment in msg and str(d) in msg and "\n" not in msg, msg

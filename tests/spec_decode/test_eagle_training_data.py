"""The EAGLE training data pipeline: the local corpus (``scripts/eagle_corpus.py``) and the
resumable work directory of ``scripts/train_eagle.py`` (data made once, features in shards
listed by a manifest), on a tiny random target."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str):
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train():
    return _script("train_eagle")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """28 layers: the EAGLE-3 features read the residual stream entering layer 27."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), num_hidden_layers=28)


def test_corpus_documents_are_local_text_with_a_stable_held_out_split(tmp_path):
    corpus = _script("eagle_corpus")
    docs = list(corpus.documents("pydoc", 4, seed=0))
    assert len(docs) == 4
    for doc in docs:
        assert len(doc["text"]) >= corpus.MIN_CHARS
        assert doc["sha256"] == hashlib.sha256(doc["text"].encode()).hexdigest()
        assert doc["held_out"] == corpus.held_out(doc["source"].split(":", 1)[1])
    assert [d["source"] for d in corpus.documents("pydoc", 4, seed=0)] == [d["source"] for d in docs]
    assert [d["source"] for d in corpus.documents("pydoc", 4, seed=1)] != [d["source"] for d in docs]
    sources = [f"man:{i}" for i in range(2000)]
    assert 60 < sum(map(corpus.held_out, sources)) < 140


def test_corpus_pieces_follow_the_token_budget(train, tmp_path):
    docs = [
        {"source": f"s{i}", "kind": "pydoc", "held_out": i == 0, "text": "word " * 700}
        for i in range(6)
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    seqs = train.corpus_sequences(path, 1000, 256, seed=0)
    kept = [s for s in seqs if s.kind == "pydoc"]
    held = [s for s in seqs if s.kind == "pydoc-held-out"]
    assert 1000 <= sum(len(s.ids) for s in kept) < 1000 + 256
    assert 0 < sum(len(s.ids) for s in held) < 50 + 256
    assert all(len(s.ids) <= 256 and s.scored_from == 1 for s in seqs)


def test_workdir_makes_data_once_and_resumes_at_the_missing_shard(train, target, tmp_path):
    seqs = [train.Sequence(list(range(3 + i, 40 + 3 * i)), 5, "chat") for i in range(7)]
    made = []

    def make():
        made.append(1)
        return seqs

    work = train.Workdir(tmp_path / "a")
    assert [s.ids for s in work.sequences("chat", {"n": 7}, make)] == [s.ids for s in seqs]
    work.featurize(target, seqs[:3], shard_sequences=2, batch_tokens=256)  # an interrupted run
    assert [shard["sequences"] for shard in work.manifest["shards"]] == [2, 1]

    again = train.Workdir(tmp_path / "a")  # the next run
    assert [s.ids for s in again.sequences("chat", {"n": 7}, make)] == [s.ids for s in seqs]
    assert made == [1]
    again.featurize(target, seqs, shard_sequences=2, batch_tokens=256)
    assert [shard["sequences"] for shard in again.manifest["shards"]] == [2, 1, 2, 2]
    with pytest.raises(SystemExit, match="its chat data was made with {'n': 7}"):
        again.sequences("chat", {"n": 8}, make)

    whole = train.Workdir(tmp_path / "b")
    whole.featurize(target, seqs, shard_sequences=7, batch_tokens=256)
    for method in ("eagle", "eagle3"):
        resumed, _, _ = again.load(method)
        one_run, _, _ = whole.load(method)
        assert [s.ids for s, _, _ in resumed] == [s.ids for s in seqs]
        for (_, f1, p1), (_, f2, p2) in zip(resumed, one_run):
            assert torch.equal(p1, p2)
            torch.testing.assert_close(f1, f2, atol=2e-3, rtol=2e-3)

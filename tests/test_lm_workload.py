"""The language-model workload: the standard library's source read deterministically, refused by name when there is
nothing to read, and the byte-level GPT example trained on 2 ranks under a DiLoCo preset."""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import run_ranks

from lightning_gradcomp.examples.gpt import ByteGPT, warmup_cosine
from lightning_gradcomp.examples.stdlib_corpus import (
    CorpusError,
    corpus_files,
    read_stdlib_corpus,
    windows,
)


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def test_the_corpus_is_the_sorted_source_outside_tests_and_installed_packages(tmp_path: Path) -> None:
    files = {"b.py": "b = 2\n", "a.py": "a = 1\n", "pkg/c.py": "c = 3\n", "pkg/test/t.py": "t\n", "tests/u.py": "u\n",
             "site-packages/x/y.py": "y\n", "notes.txt": "not python\n"}  # fmt: skip
    root = _write(tmp_path, files)
    assert [p.relative_to(root).as_posix() for p in corpus_files(root)] == ["a.py", "b.py", "pkg/c.py"]
    corpus = read_stdlib_corpus(root, validation_share=0.34, seed=0)
    summary = corpus.summary
    assert (summary["files"], summary["train_files"], summary["validation_files"]) == (3, 2, 1)
    assert summary["bytes"] == len("a = 1\n") + len("b = 2\n") + len("c = 3\n")
    assert summary["train_bytes"] + summary["validation_bytes"] == summary["bytes"] + 1  # one NUL between two files
    texts = {bytes(corpus.train.tolist()), bytes(corpus.validation.tolist())}
    assert b"t\n" not in b"".join(texts) and b"y\n" not in b"".join(texts)


def test_the_stdlib_corpus_is_read_the_same_every_time_and_records_what_it_is() -> None:
    first, again = read_stdlib_corpus(), read_stdlib_corpus()
    assert torch.equal(first.train, again.train) and torch.equal(first.validation, again.validation)
    assert first.summary == again.summary
    summary = first.summary
    assert summary["root"] == sysconfig.get_paths()["stdlib"] and summary["python"].count(".") == 2
    assert summary["files"] > 100 and summary["bytes"] > 1_000_000 and len(summary["sha256"]) == 64
    assert summary["validation_files"] == round(0.05 * summary["files"])
    other = read_stdlib_corpus(seed=1)  # another seed holds out other files
    assert other.summary["sha256"] == summary["sha256"] and not torch.equal(other.validation, first.validation)


def test_an_empty_or_unreadable_corpus_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=f"the corpus folder {tmp_path} holds no Python source file"):
        read_stdlib_corpus(tmp_path)
    with pytest.raises(CorpusError, match=f"the corpus folder {tmp_path / 'missing'} does not exist"):
        read_stdlib_corpus(tmp_path / "missing")
    _write(tmp_path, {"a.py": "a\n", "test/b.py": "b\n"})
    with pytest.raises(CorpusError, match="holds one source file"):
        read_stdlib_corpus(tmp_path)
    locked = _write(tmp_path, {"b.py": "b\n"}) / "b.py"
    if os.geteuid() == 0:  # root reads any file: make one that cannot be read as a file at all
        locked.unlink()
        locked.symlink_to(tmp_path / "nowhere.py")
    else:
        locked.chmod(0)
    with pytest.raises(CorpusError, match=f"the corpus file {locked} cannot be read"):
        read_stdlib_corpus(tmp_path)
    with pytest.raises(ValueError, match="validation_share"):
        read_stdlib_corpus(tmp_path, validation_share=1.0)


def test_windows_are_consecutive_and_the_model_predicts_every_next_byte() -> None:
    tokens = torch.arange(20, dtype=torch.uint8)
    cut = windows(tokens, 4)
    assert cut.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    model = ByteGPT(context=8, width=16, heads=2, layers=1)
    assert model(cut[:, :-1]).shape == (3, 4, 256)
    first = model(cut[:1, :2])
    assert torch.allclose(first, model(cut[:1, :4])[:, :2], atol=1e-6)  # causal: later bytes change nothing before
    with pytest.raises(ValueError, match="width must be a multiple of heads"):
        ByteGPT(width=10, heads=4)


def test_the_schedule_warms_up_linearly_then_decays_to_a_tenth() -> None:
    assert [warmup_cosine(s, 4, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine(12, 4, 20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(20, 4, 20) == pytest.approx(0.1) and warmup_cosine(50, 4, 20) == pytest.approx(0.1)


def _example(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_gradcomp.examples.lm_train import train

    result = train("ddp_diloco_sparseloco", world_size, steps=40, batch_size=8, sync_every=10, eval_every=20,
                   validation_windows=32, width=32, heads=2, layers=1, context=32, warmup=5)  # fmt: skip
    strategy = result["trainer"].strategy
    return {key: result[key] for key in ("before", "after", "per_step")} | {
        "anchor": {k: v.clone() for k, v in strategy.outer_sync.anchor.items()},
        "synchronisations": sum(s.synchronised for s in strategy.outer_sync.history),
    }


def test_the_language_model_example_trains_on_two_ranks() -> None:
    ranks = run_ranks(_example, 2, init=False, timeout=300)
    for rank in ranks:
        assert rank["after"] < rank["before"] - 1.0  # from about 5.5 nats per byte
        assert rank["synchronisations"] == 4
        sent, dense = rank["per_step"]
        assert 0 < sent < dense / 10 / 50  # every tenth step, far under a fiftieth of the dense gradient
        for name, value in rank["anchor"].items():
            assert torch.equal(value, ranks[0]["anchor"][name]), name  # theta_prev alike on every rank

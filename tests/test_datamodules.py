"""Example data and models: real MNIST test set (../shared/data/mnist), CIFAR-10 files, augmentation, networks."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import cifar_batch_bytes, idx_bytes, write_cifar10, write_mnist

from lightning_gradcomp.examples.cifar import (
    CIFAR10_FILES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10DataModule,
    load_cifar10,
    random_crop_flip,
    read_cifar_batch,
)
from lightning_gradcomp.examples.datafiles import CorruptDataError, MissingDataError
from lightning_gradcomp.examples.mnist import MEAN, STD, MNISTDataModule, load_mnist, read_idx
from lightning_gradcomp.examples.models import AlexNet, CifarResNet, ImageClassifier, LeNet5, ResNet18, ResNet20

# Digit counts of the 10,000 MNIST test images (t10k-labels-idx1-ubyte), 0 to 9.
T10K_LABEL_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


# ------------------------------------------------------------------------------------------------ MNIST


def test_mnist_loads_the_real_test_set(mnist_dir: Path) -> None:
    data = load_mnist(mnist_dir, "t10k")
    images, labels = data.tensors
    assert images.shape == (10_000, 1, 28, 28) and images.dtype == torch.float32
    assert torch.bincount(labels, minlength=10).tolist() == T10K_LABEL_COUNTS
    pixels = images * STD + MEAN  # back to [0, 1]
    assert pixels.min() == pytest.approx(0.0, abs=1e-6) and pixels.max() == pytest.approx(1.0, abs=1e-6)
    assert pixels.mean().item() == pytest.approx(0.1325, abs=0.001)  # the test set's mean intensity

    module = MNISTDataModule(str(mnist_dir), batch_size=32, train_split="t10k", holdout=2000)
    module.setup("fit")
    assert len(module.train_set) == 8000 and len(module.val_set) == 2000
    x, y = next(iter(module.train_dataloader()))
    assert x.shape == (32, 1, 28, 28) and y.shape == (32,)


def test_mnist_reads_gzipped_and_raw_idx_files(tmp_path: Path) -> None:
    write_mnist(tmp_path, train=12, test=5)  # train gzipped, t10k raw
    module = MNISTDataModule(str(tmp_path), batch_size=4)
    module.setup("fit")
    assert len(module.train_set) == 12 and len(module.val_set) == 5
    raw = read_idx(tmp_path / "t10k-images-idx3-ubyte")
    assert raw.shape == (5, 28, 28) and raw.dtype == torch.uint8
    expected = (raw.float() / 255 - MEAN) / STD
    torch.testing.assert_close(module.val_set.tensors[0][:, 0], expected)


def test_mnist_accepts_the_dotted_file_names_of_some_mirrors(tmp_path: Path) -> None:
    write_mnist(tmp_path, train=4, test=3, gzip_train=False)
    for path in tmp_path.iterdir():
        path.rename(path.with_name(path.name.replace("-idx", ".idx")))
    assert len(load_mnist(tmp_path, "t10k")) == 3


def test_missing_mnist_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(MissingDataError, match=r"directory .*nowhere does not exist; expected the files train-images"):
        MNISTDataModule(str(tmp_path / "nowhere"))
    write_mnist(tmp_path, train=4, test=3)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(MissingDataError, match=r"t10k-labels-idx1-ubyte\[\.gz\] not found in") as err:
        MNISTDataModule(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "t10k-images-idx3-ubyte[.gz]" in str(err.value)
    MNISTDataModule(str(tmp_path), train_split="train", holdout=2)  # validates on train: t10k not needed


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (idx_bytes(np.zeros((3, 28, 28), np.uint8))[:-5], r"header says \[3, 28, 28\]"),
        (b"\x00\x00\x0d\x03" + bytes(12), "header 00000d03"),
        (b"", "header empty"),
    ],
    ids=["truncated", "float-magic", "empty"],
)
def test_corrupt_idx_files_are_named(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(content)
    with pytest.raises(CorruptDataError, match=problem) as err:
        read_idx(path)
    assert str(path) in str(err.value) and "expected an IDX file" in str(err.value)


def test_a_broken_gzip_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros((2, 28, 28), np.uint8)))[:40])
    with pytest.raises(CorruptDataError, match="cannot decompress") as err:
        read_idx(path)
    assert str(path) in str(err.value)


# --------------------------------------------------------------------------------------------- CIFAR-10


def test_cifar_batches_read_back_in_channel_planes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(4, 3, 32, 32), dtype=np.uint8)
    path = tmp_path / "data_batch_1"
    path.write_bytes(cifar_batch_bytes(images, [3, 1, 4, 1]))
    assert b"numpy.core.multiarray" in path.read_bytes()  # as in the files the authors distribute
    x, y = read_cifar_batch(path)
    assert x.dtype == torch.uint8 and x.shape == (4, 3, 32, 32)
    assert torch.equal(x, torch.from_numpy(images)) and y.tolist() == [3, 1, 4, 1]
    # a row of the file is the red plane, then green, then blue, each row-major
    flat = pickle.loads(path.read_bytes(), encoding="bytes")[b"data"]
    assert torch.equal(x[2, 1].reshape(-1), torch.from_numpy(flat[2, 1024:2048]))


def test_cifar_datamodule_normalises_and_augments_training_batches_only(tmp_path: Path) -> None:
    write_cifar10(tmp_path / "cifar-10-batches-py", per_file=16)
    module = CIFAR10DataModule(str(tmp_path), batch_size=8, val_batch_size=16)  # finds cifar-10-batches-py
    module.setup("fit")
    assert len(module.train_set) == 80 and len(module.val_set) == 16
    stored, _ = load_cifar10(tmp_path, "test")
    x, y = next(iter(module.val_dataloader()))
    mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(x, (stored.float() / 255 - mean) / std)
    torch.manual_seed(0)
    x, y = next(iter(module.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (8,)
    padding_value = (-mean / std).view(3)  # black padding after normalisation
    assert any(torch.isclose(x[i, :, 0, 0], padding_value).all() for i in range(8)) or any(
        torch.isclose(x[i, :, -1, -1], padding_value).all() for i in range(8)
    )


def test_random_crop_flip_returns_crops_of_the_padded_images() -> None:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(1, 256, (64, 3, 8, 8), dtype=torch.uint8, generator=generator)
    out = random_crop_flip(images, padding=2, generator=generator)
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    seen = set()
    for i in range(len(images)):
        found = [
            (dy, dx, flip)
            for dy in range(5)
            for dx in range(5)
            for flip in (False, True)
            if torch.equal(out[i], (lambda c: c.flip(-1) if flip else c)(padded[i, :, dy : dy + 8, dx : dx + 8]))
        ]
        assert found, f"image {i} is not a crop of its padded original"
        seen.update(found)
    assert {flip for _, _, flip in seen} == {False, True}
    assert len({(dy, dx) for dy, dx, _ in seen}) > 10


def test_missing_cifar_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(MissingDataError, match="none of the expected files is in") as err:
        CIFAR10DataModule(str(tmp_path))
    assert all(name in str(err.value) for name in CIFAR10_FILES)
    write_cifar10(tmp_path, per_file=2)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(MissingDataError, match=f"data_batch_3 not found in {tmp_path}"):
        CIFAR10DataModule(str(tmp_path))


def test_corrupt_cifar_files_are_named(tmp_path: Path) -> None:
    write_cifar10(tmp_path, per_file=2)
    path = tmp_path / "data_batch_2"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CorruptDataError, match="cannot unpickle") as err:
        load_cifar10(tmp_path, "train")
    assert str(path) in str(err.value) and "b'data'" in str(err.value)
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, protocol=2))
    with pytest.raises(CorruptDataError, match=r"data of uint8 and shape \(2, 100\)"):
        read_cifar_batch(path)
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, protocol=2))
    with pytest.raises(CorruptDataError, match="2 labels for 2 images"):
        read_cifar_batch(path)


class _Planted:
    """A pickle that would create a file when loaded by an unrestricted unpickler."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.target,))


def test_a_cifar_file_cannot_run_code(tmp_path: Path) -> None:
    target = tmp_path / "planted"
    path = tmp_path / "test_batch"
    path.write_bytes(pickle.dumps({b"data": _Planted(target), b"labels": []}, protocol=2))
    with pytest.raises(CorruptDataError, match=r"refusing to load .* from a dataset file"):
        read_cifar_batch(path)
    assert not target.exists()


# ----------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize(
    ("network", "shape", "parameters"),
    [
        (LeNet5(), (2, 1, 28, 28), 61_706),
        (ResNet20(), (2, 3, 32, 32), 269_722),
        (CifarResNet(depth=56), (2, 3, 32, 32), 853_018),
        (ResNet18(), (2, 3, 32, 32), 11_173_962),
        (AlexNet(), (2, 3, 32, 32), 23_272_266),
    ],
    ids=["lenet5", "resnet20", "resnet56", "resnet18", "alexnet"],
)
def test_networks_have_the_published_sizes(network: torch.nn.Module, shape: tuple, parameters: int) -> None:
    assert sum(p.numel() for p in network.parameters()) == parameters
    assert network(torch.randn(shape)).shape == (2, 10)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CifarResNet(depth=21), r"depth must be an integer 6n \+ 2 >= 8 .* got 21"),
        (lambda: AlexNet(dropout=1.0), r"dropout must be a number in \[0, 1\), got 1.0"),
        (lambda: ResNet18(num_classes=1), "num_classes must be an integer >= 2, got 1"),
        (lambda: ImageClassifier(LeNet5(), lr=0), "lr must be a finite number > 0, got 0"),
        (lambda: ImageClassifier(LeNet5(), lr=float("inf")), "lr must be a finite number > 0, got inf"),
        (lambda: ImageClassifier(LeNet5(), weight_decay=-1.0), "weight_decay must be a finite number >= 0, got -1.0"),
        (lambda: ImageClassifier(LeNet5(), lr_milestones=[5, 3]), r"lr_milestones must be increasing .* \[5, 3\]"),
        (lambda: ImageClassifier(LeNet5(), lr_gamma=2.0), r"lr_gamma must be a number in \(0, 1\], got 2.0"),
        (lambda: CIFAR10DataModule("x", batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (lambda: MNISTDataModule("x", train_split="test"), r"train_split must be one of \['t10k', 'train'\]"),
    ],
)
def test_bad_arguments_are_refused(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_learning_rate_milestones_step_per_epoch() -> None:
    module = ImageClassifier(LeNet5(), lr=0.1, lr_milestones=[2, 4], lr_gamma=0.5)
    config = module.configure_optimizers()
    scheduler = config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "epoch"
    rates = []
    for _ in range(5):
        rates.append(config["optimizer"].param_groups[0]["lr"])
        config["optimizer"].step()
        scheduler.step()
    assert rates == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])

"""Codec kernels built ahead of time (AOTInductor in a child process, loaded as packages) are their eager oracle's: the
same codes and bytes exactly, the same means and residuals bit for bit on the CPU, floats from reductions within the
rounding of another summation order. The training process never loads the compiler; a failed build warns once and runs
eagerly; the cache is private, locked while a package is built, and keyed by everything a package depends on.

The builds are real where a test says so (about 15 s each, cold, in a cache kept for the session); the cache's and the
fallback's logic is tested with a stand-in builder.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from backward_thread import train_on_a_backward_thread
from ranks import run_ranks

import lightning_gradcomp.core.ahead as ahead
import lightning_gradcomp.core.fused as fused_module
from lightning_gradcomp.core.compressors import ScaledSignCompressor, TernGradCompressor
from lightning_gradcomp.core.compressors.base import subtract_by_adding
from lightning_gradcomp.core.compressors.kernels import (
    draw_packed_codes,
    encode_signs,
    mean_of_signs_,
    mean_of_summed_fields_,
    subtract_signs_,
)
from lightning_gradcomp.core.compressors.sign import SIGN_ROW
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.randomness import CounterStream

#: Two whole planar rows of signs and a partial one: the rows run as a package, the rest eagerly.
NUMEL = 2 * SIGN_ROW + 32 * 99 + 5
EPS32 = torch.finfo(torch.float32).eps / 2


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cold cache for the session's real builds (the machine's own cache is left alone)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def built(kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """Kernels run as packages from the session's cache; the suite's mode is restored afterwards."""
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(kernel_cache))
    monkeypatch.setattr(fused_module, "_broken", {})
    yield set_codec_mode
    fused_module._mode = None


def _gradient(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3


def test_terngrads_codes_and_mean_are_the_eager_ones_byte_for_byte(built: object) -> None:
    compressor = TernGradCompressor(clip_sigma=0)  # max|g|: exact in any order
    xs = [_gradient(seed) for seed in (1, 2)]
    calls = draw_packed_codes.ahead_calls, mean_of_summed_fields_.ahead_calls
    shared = torch.maximum(*[compressor.local_scale(x) for x in xs])  # one scaler: the codes sum as integers
    results = {}
    for mode in ("ahead", "eager"):
        built(mode)
        payloads = [compressor.compress(x, CounterStream(7 + i), scale=shared) for i, x in enumerate(xs)]
        mean = compressor.average_all(payloads, torch.full((NUMEL,), 9.0), 2)
        results[mode] = [p.to_bytes() for p in payloads], mean
    assert all(torch.equal(a, b) for a, b in zip(results["ahead"][0], results["eager"][0], strict=True))
    assert torch.equal(results["ahead"][1], results["eager"][1])
    assert draw_packed_codes.ahead_calls == calls[0] + 2 and mean_of_summed_fields_.ahead_calls == calls[1] + 1


def test_signs_residual_and_mean_are_the_eager_ones_and_the_scale_within_summation_rounding(built: object) -> None:
    compressor = ScaledSignCompressor()
    x = _gradient(3)
    built("eager")
    eager = compressor.compress(x, None)
    built("ahead")
    calls = encode_signs.ahead_calls, subtract_signs_.ahead_calls, mean_of_signs_.ahead_calls
    packaged = compressor.compress(x, None)
    assert torch.equal(packaged.bits, eager.bits)
    # a sum of d magnitudes in another order is within 2 (d - 1) u of the eager one; the mean adds a rounding or two
    scale = float(eager.scale)
    assert abs(float(packaged.scale) - scale) <= (2 * (NUMEL - 1) * EPS32 + 4 * EPS32) * scale
    # given the same payload, the residual and the mean of two are the eager passes' roundings exactly
    residual = packaged.entries().subtract_from(x, torch.empty(NUMEL))
    other = compressor.compress(_gradient(4), None)
    mean = compressor.average_all([packaged, other], torch.empty(NUMEL), 2)
    built("eager")
    assert torch.equal(residual, subtract_by_adding(packaged.entries(), x, torch.empty(NUMEL)))
    assert torch.equal(mean, compressor.average_all([packaged, other], torch.empty(NUMEL), 2))
    assert (encode_signs.ahead_calls, subtract_signs_.ahead_calls, mean_of_signs_.ahead_calls) == (
        calls[0] + 2,
        calls[1] + 1,
        calls[2] + 1,
    )


_CHILD = """
import json, sys, torch
from lightning_gradcomp.core.compressors import ScaledSignCompressor
from lightning_gradcomp.core.compressors.kernels import encode_signs
x = torch.randn({numel}, generator=torch.Generator().manual_seed(3)) * 1e-3
bits = ScaledSignCompressor().compress(x, None).bits
calls, modules = encode_signs.ahead_calls, sorted(sys.modules)
print(json.dumps({{"ahead_calls": calls, "bits": bits.tolist()[:64], "modules": modules}}))
"""


def _child(codecs: str, cache: Path) -> dict:
    env = dict(os.environ, GRADCOMP_CODECS=codecs, GRADCOMP_KERNEL_CACHE=str(cache), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(numel=NUMEL)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_process_running_packages_imports_nothing_of_torch_that_the_eager_codecs_do_not(
    built: object, kernel_cache: Path
) -> None:
    packaged, eager = _child("ahead", kernel_cache), _child("eager", kernel_cache)
    assert packaged["ahead_calls"] == 1 and eager["ahead_calls"] == 0
    assert packaged["bits"] == eager["bits"]
    extra = sorted(set(packaged["modules"]) - set(eager["modules"]))
    assert not [m for m in extra if m.startswith(("torch", "sympy", "networkx"))], extra
    assert "torch._inductor.codegen.cpp" not in packaged["modules"]  # inductor's code generator never loads


def test_the_compilers_precompiled_headers_are_built_inside_the_private_cache(
    built: object, kernel_cache: Path
) -> None:
    """The headers inductor precompiles (code that goes into every package) live in the temporary directory's
    ``torchinductor_<user>``, not in its cache directory: the builder's temporary directory is the cache's own (a real
    build; where the builder's directories point is tested with a stand-in below)."""
    from torch._inductor import config

    built("ahead")
    ScaledSignCompressor().compress(_gradient(5), None)  # built or loaded: the builder ran in this cache
    temporary = kernel_cache / "tmp"
    assert temporary.is_dir() and temporary.stat().st_mode & 0o777 == 0o700
    if getattr(config.aot_inductor, "precompile_headers", False):
        headers = list(temporary.glob("torchinductor_*/precompiled_headers/*.gch"))
        assert headers, sorted(str(p.relative_to(kernel_cache)) for p in temporary.rglob("*"))[:20]


def _packaged_and_eager(rank: int, world_size: int, cache: str) -> dict:
    import torch.distributed as dist

    os.environ["GRADCOMP_KERNEL_CACHE"] = cache
    group = dist.new_group(backend="gloo")
    train = train_on_a_backward_thread
    return {"ahead": train(group, "ahead", "ahead", 3), "eager": train(group, "eager", "ahead", 3)}


def test_a_comm_hook_on_a_backward_thread_runs_the_packages_and_trains_as_eager(kernel_cache: Path) -> None:
    (result,) = run_ranks(_packaged_and_eager, 1, str(kernel_cache), timeout=900)
    packaged, eager = result["ahead"], result["eager"]
    assert packaged["calls"] >= 3 and eager["calls"] == 0  # every step's unit, from a package
    assert packaged["callers"] == [f"backward-{step}" for step in range(3)]
    for a, b in zip(packaged["weights"], eager["weights"], strict=True):
        assert torch.equal(a, b)


def test_without_a_compiler_a_build_warns_once_and_the_kernels_run_eagerly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(tmp_path / "cold"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # the child compiles with it
    monkeypatch.setattr(fused_module, "_broken", {})
    monkeypatch.setattr(ahead, "_builder", ahead._Builder())  # a child started under this environment
    monkeypatch.setattr(encode_signs, "_packages", {})  # none loaded by an earlier test
    x = _gradient(5)
    try:
        set_codec_mode("auto")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = encode_signs(x, False), encode_signs(x, False)
        ours = [w for w in caught if "cannot build codec kernels" in str(w.message)]
        assert len(ours) == 1 and "AOTInductor" in str(ours[0].message) and "BuildFailed" in str(ours[0].message)
        expected = encode_signs.function(x, False)
        for result in (first, second):
            assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))
        set_codec_mode("ahead")  # the setting that wants to know: the failure is raised
        monkeypatch.setattr(fused_module, "_broken", {})
        with pytest.raises(ahead.BuildFailed, match="encode_signs"):
            encode_signs(x, True)
    finally:
        fused_module._mode = None
        ahead._builder.close()


class _StandIn:
    """A builder that writes what it is told to (``content``), slowly, and counts its builds in a file (across
    processes)."""

    def __init__(self, tally: Path, content: bytes = b"not a package", seconds: float = 0.0) -> None:
        self.tally, self.content, self.seconds = tally, content, seconds

    @property
    def builds(self) -> int:
        return len(self.tally.read_text()) if self.tally.exists() else 0

    def build(self, request: dict, directory: Path) -> None:
        with open(self.tally, "a") as tally:
            tally.write("b")
        time.sleep(self.seconds)
        Path(request["path"]).write_bytes(self.content)


def _load_in_a_process(layout: object, loaded: object) -> None:
    path = ahead.load(encode_signs.function, layout)
    loaded.put(str(path))


def test_ranks_sharing_a_cache_build_a_package_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(tmp_path / "cache"))
    builder = _StandIn(tmp_path / "tally", seconds=0.5)
    monkeypatch.setattr(ahead, "_builder", builder)
    monkeypatch.setattr(ahead, "Package", lambda path: path)  # what would be loaded
    layout, _ = ahead.describe((torch.zeros(8), 3))
    context = multiprocessing.get_context("fork")  # three processes, the stand-ins inherited
    loaded = context.Queue()
    processes = [context.Process(target=_load_in_a_process, args=(layout, loaded)) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0, 0]
    paths = [loaded.get(timeout=5) for _ in processes]  # every process loaded the package
    assert builder.builds == 1 and len(paths) == 3  # the lock held the others until the first had built it


def test_a_package_that_does_not_load_is_built_once_more_then_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(tmp_path / "cache"))
    builder = _StandIn(tmp_path / "tally")
    monkeypatch.setattr(ahead, "_builder", builder)
    layout, _ = ahead.describe((torch.zeros(8),))
    with pytest.raises(ahead.BuildFailed, match=r"loading the package of .*encode_signs"):
        ahead.load(encode_signs.function, layout)
    assert builder.builds == 2 and not list((tmp_path / "cache").glob("*.pt2"))  # the unloadable files are removed


def test_a_package_file_that_is_not_this_users_alone_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(cache))
    builder = _StandIn(tmp_path / "tally")
    monkeypatch.setattr(ahead, "_builder", builder)
    monkeypatch.setattr(ahead, "Package", lambda path: path)
    layout, _ = ahead.describe((torch.zeros(8),))
    path = ahead.load(encode_signs.function, layout)
    assert builder.builds == 1 and ahead.load(encode_signs.function, layout) == path and builder.builds == 1
    elsewhere = tmp_path / "planted"
    elsewhere.write_bytes(b"someone else's code")
    for plant in (lambda: os.link(path, tmp_path / "second-name"), lambda: path.chmod(0o666)):
        plant()
        ahead.load(encode_signs.function, layout)  # refused as it was, built again
    path.unlink()
    path.symlink_to(elsewhere)
    ahead.load(encode_signs.function, layout)
    assert builder.builds == 4 and not path.is_symlink() and elsewhere.read_bytes() == b"someone else's code"


def test_a_cache_others_may_write_to_is_refused_and_ones_own_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ahead, "_builder", _StandIn(tmp_path / "tally"))
    layout, _ = ahead.describe((torch.zeros(8),))
    opened = tmp_path / "open"
    below = opened / "below"
    below.mkdir(parents=True)
    opened.chmod(0o777)  # anyone may rename what it holds
    cases = [(below, opened), (opened / "new", opened)]
    if os.geteuid() == 0:  # a directory of another user's (only root can make one here)
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        cases.append((theirs, theirs))
    for cache, culprit in cases:
        monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(cache))
        with pytest.raises(ValueError, match=rf"GRADCOMP_KERNEL_CACHE: .* is not private .*{culprit.name}'.*owner"):
            ahead.load(encode_signs.function, layout)
    assert not list(below.iterdir()) and not (opened / "new").exists()  # nothing was built or loaded there
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o777)
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(mine))
    assert ahead._private_dir() == mine.resolve() and oct(mine.stat().st_mode & 0o777) == "0o700"
    private = tmp_path / "private"
    (tmp_path / "link").symlink_to(private)
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(tmp_path / "link" / "kernels"))
    assert ahead._private_dir() == private.resolve() / "kernels"  # made, each level 0700, through the link
    assert [oct(p.stat().st_mode & 0o777) for p in (private, private / "kernels")] == ["0o700", "0o700"]


def test_a_package_is_keyed_by_layout_threads_torch_machine_settings_and_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = torch.zeros(4, 6)
    variants = [
        (base, 3),
        (torch.zeros(4, 7), 3),
        (base.t(), 3),
        (base.double(), 3),
        (base, 4),
        (base, 3.0),
        ([base], 3),
        ((base,), 3),
    ]
    keys = [ahead.package_key("m:k", ahead.describe(v)[0], 1) for v in variants]
    assert ahead.package_key("m:k", ahead.describe((torch.ones(4, 6), 3))[0], 1) == keys[0]  # values do not matter
    layout = ahead.describe(variants[0])[0]
    keys += [ahead.package_key("m:other", layout, 1), ahead.package_key("m:k", layout, 2)]
    for target, name, value in [
        (torch, "__version__", "0.0.0"),
        (ahead, "sources_digest", lambda: "edited"),
        (ahead, "cpu_identity", lambda: "another cpu"),
    ]:
        with monkeypatch.context() as patched:
            patched.setattr(target, name, value)
            keys.append(ahead.package_key("m:k", layout, 1))
    with monkeypatch.context() as patched:
        patched.setenv("TORCHINDUCTOR_CPP_SIMDLEN", "8")
        keys.append(ahead.package_key("m:k", layout, 1))
    assert len(set(keys)) == len(keys) == 14


def test_arguments_that_overlap_in_memory_or_are_not_tensors_or_constants_are_not_packaged() -> None:
    wire = torch.zeros(100)
    layout, tensors = ahead.describe((wire[:10], wire[10:50], [wire[50:]], None, 2, True))
    assert len(tensors) == 3 and layout[3:] == (("constant", None), ("constant", 2), ("constant", True))
    assert json.loads(json.dumps(layout))[3] == ["constant", None]  # what the child is sent
    for overlapping in [
        (wire[:10], wire[9:20]),
        (wire, wire[50:]),
        (wire.view(10, 10)[:, 0], wire[5:6]),
        (wire[:1].expand(10),),  # elements of one tensor in one place
    ]:
        with pytest.raises(ahead.AheadUnsupported, match="overlap"):
            ahead.describe(overlapping)
    apart = wire.view(10, 10)
    ahead.describe((apart[0], apart[1]))  # rows side by side do not overlap
    with pytest.raises(ahead.AheadUnsupported, match="dict"):
        ahead.describe(({"a": wire},))
    rebuilt = ahead.rebuild(["list", [["tensor"], ["constant", 5]]], iter([wire]))
    assert rebuilt[0] is wire and rebuilt[1] == 5


def test_layouts_past_the_limit_run_eagerly_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_module, "RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(fused_module, "_broken", {})
    packaged: list[int] = []

    def stand_in(function: object, layout: object) -> object:
        return lambda tensors: packaged.append(tensors[0].numel()) or encode_signs.function(tensors[0], False)

    monkeypatch.setattr(ahead, "load", stand_in)
    kernel = encode_signs
    monkeypatch.setattr(kernel, "_packages", {})
    try:
        set_codec_mode("ahead")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in (32 * 8, 32 * 9, 32 * 10, 32 * 8):
                x = _gradient(n, n)
                result, expected = kernel(x, False), encode_signs.function(x, False)
                assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))
        ours = [w for w in caught if "more than 2 tensor sizes" in str(w.message)]
        assert len(ours) == 1 and packaged == [32 * 8, 32 * 9, 32 * 8]  # the third size ran eagerly
    finally:
        fused_module._mode = None


@pytest.mark.parametrize(
    ("child", "timeout", "message"),
    [
        (
            "import sys, json\nfor line in sys.stdin: print(json.dumps(dict(ok=True, ticket=-1)), flush=True)",
            "60",
            "answered out of turn",
        ),
        (
            "import sys\nfor line in sys.stdin: print('compiler chatter', flush=True)",
            "60",
            "answered 'compiler chatter",
        ),
        ("import sys; sys.exit(3)", "60", "exited while building"),
        ("import sys, time\nfor line in sys.stdin: time.sleep(60)", "1", "took more than 1 s"),
    ],
    ids=["out-of-turn", "not-json", "exits", "past-the-timeout"],
)
def test_a_builder_that_misbehaves_is_stopped_and_the_build_fails(
    child: str, timeout: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ahead, "_CHILD", child)
    monkeypatch.setenv("GRADCOMP_KERNEL_BUILD_TIMEOUT", timeout)
    builder = ahead._Builder()
    request = {"kernel": "lightning_gradcomp.core.compressors.kernels:encode_signs", "path": str(tmp_path / "p.pt2")}
    with pytest.raises(ahead.BuildFailed, match=message):
        builder.build(request, tmp_path)
    assert builder._process is None  # stopped: no later request reads this one's reply


#: A stand-in builder that answers each request with the directories it compiles in, read from its environment (a
#: template, as the builder's own command: braces doubled).
_ENVIRONMENT_CHILD = """
import json, os, sys
for line in sys.stdin:
    request = json.loads(line)
    if request.get("quit"):
        break
    where = {{"tmp": os.environ["TMPDIR"], "inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"], "pid": os.getpid()}}
    print(json.dumps({{"ok": True, "ticket": request["ticket"], **where}}), flush=True)
"""


def test_the_builder_compiles_in_the_cache_it_builds_for_and_is_restarted_for_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its temporary directory (where inductor precompiles the headers every package includes) and its compiler cache
    are inside the private cache a package is built for; a build for another cache gets a child of its own."""
    monkeypatch.setattr(ahead, "_CHILD", _ENVIRONMENT_CHILD)
    builder = ahead._Builder()
    answers = []
    monkeypatch.setattr(builder, "_exchange", lambda *a: answers.append(ahead._Builder._exchange(*a)) or answers[-1])
    request = {"kernel": "k", "path": "p"}
    first, second = tmp_path / "first", tmp_path / "second"
    for directory in (first, first, second):
        directory.mkdir(mode=0o700, exist_ok=True)
        builder.build(request, directory)
    builder.close()
    assert [(a["tmp"], a["inductor"]) for a in answers] == [
        (str(d / "tmp"), str(d / "inductor")) for d in (first, first, second)
    ]
    assert answers[0]["pid"] == answers[1]["pid"] != answers[2]["pid"]
    assert all((d / "tmp").stat().st_mode & 0o777 == 0o700 for d in (first, second))


def test_the_build_timeout_is_validated_where_it_enters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("0", "-5", "soon"):
        monkeypatch.setenv("GRADCOMP_KERNEL_BUILD_TIMEOUT", value)
        with pytest.raises(ValueError, match=rf"GRADCOMP_KERNEL_BUILD_TIMEOUT must be a positive .*got '{value}'"):
            ahead._Builder().build({"kernel": "k"}, tmp_path)


def _builder_state(states: object) -> None:
    states.put([ahead._builder._process is None, ahead._builder._lock.locked(), ahead._builder._owner == os.getpid()])


def test_a_forked_process_starts_with_a_builder_of_its_own() -> None:
    context = multiprocessing.get_context("fork")
    states = context.Queue()
    with ahead._builder._lock:  # a build in progress in this process when it forks
        process = context.Process(target=_builder_state, args=(states,))
        process.start()
        process.join(30)
    assert process.exitcode == 0 and states.get(timeout=5) == [True, False, True]

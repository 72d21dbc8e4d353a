"""The project's own documents: a CHANGELOG that names what main offers, and no reference outside the repository."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

import lightning_gradcomp
import lightning_gradcomp.callbacks
from lightning_gradcomp.core.comm import AGGREGATORS

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
KEEP_A_CHANGELOG_SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def _features() -> list[str]:
    return [
        "ddp_gradcomp",
        *lightning_gradcomp.NAMED_STRATEGIES,
        *lightning_gradcomp.COMPRESSORS,
        *AGGREGATORS,
        *lightning_gradcomp.MEMORIES,
        *lightning_gradcomp.callbacks.__all__,
        "GradCompStrategy",
        "GradCompFabricStrategy",
        "make_hook",
        "GradCompHSDPStrategy",
        "GradCompHSDPFabricStrategy",
        "ReplicaExchange",
        *lightning_gradcomp.HSDP_PRESETS,
    ]


@pytest.mark.parametrize("name", _features())
def test_the_changelog_names_every_strategy_compressor_aggregator_memory_and_callback(name: str) -> None:
    assert f"`{name}`" in CHANGELOG


def test_the_changelog_has_keep_a_changelog_form_and_no_fragments() -> None:
    assert CHANGELOG.startswith("# Changelog\n")
    assert "## [Unreleased]" in CHANGELOG
    sections = re.findall(r"^### (.+)$", CHANGELOG, flags=re.MULTILINE)
    assert sections and set(sections) <= KEEP_A_CHANGELOG_SECTIONS
    body = CHANGELOG[CHANGELOG.index("## [Unreleased]") :]
    for number, line in enumerate(body.splitlines()):
        if line and not line.startswith(("#", "- ", "  ")):
            raise AssertionError(f"line {number} of the Unreleased part is neither a heading nor an entry: {line!r}")
        if line.startswith("  "):
            assert not line.lstrip().startswith((",", ")", ";")), f"a fragment: {line!r}"


@pytest.mark.parametrize("folder", ["lightning_gradcomp", "recipes"])
def test_no_file_of_the_package_or_the_recipes_refers_to_a_document_outside_the_repository(folder: str) -> None:
    outside = re.compile(r"ALGORITHMS\.md|DESIGN\.md|\.\./shared")
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in {".py", ".yaml", ".md"} and outside.search(path.read_text())
    ]
    assert offenders == []


def test_the_package_exports_every_compressor_aggregator_memory_callback_and_entry_point() -> None:
    classes = {*lightning_gradcomp.COMPRESSORS.values(), *AGGREGATORS.values(), *lightning_gradcomp.MEMORIES.values()}
    callbacks = {name for name in lightning_gradcomp.callbacks.__all__ if name[0].isupper() and "Error" not in name}
    expected = {c.__name__ for c in classes} | {n for n in callbacks if n not in ("LayerBounds", "RankSummary")}
    expected |= {"GradCompStrategy", "GradCompFabricStrategy", "make_hook", "gradcomp_comm_hook", "StepStats"}
    assert expected <= set(lightning_gradcomp.__all__)
    assert all(hasattr(lightning_gradcomp, name) for name in lightning_gradcomp.__all__)


DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()


def test_every_public_name_is_in_the_api_reference() -> None:
    reference = " ".join(page.read_text() for page in (DOCS / "reference").glob("*.md"))
    documented = set(re.findall(r"^::: lightning_gradcomp\.(\w+)$", reference, flags=re.MULTILINE))
    missing = sorted(set(lightning_gradcomp.__all__) - documented)
    assert not missing, f"public names without an entry in docs/reference/: {missing}"


def test_the_readme_fits_a_screen_and_a_half_and_its_links_lead_somewhere() -> None:
    assert len(README.splitlines()) < 200
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README) + re.findall(r"^\[\w+\]: (\S+?)(?:#\S*)?$", README,
                                                                            flags=re.MULTILINE)  # fmt: skip
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local and all((ROOT / t).exists() for t in local), [t for t in local if not (ROOT / t).exists()]


RESULTS = ROOT / "benchmarks" / "results"
#: A page cites a result file as ``benchmarks/results/<name>`` (the commands, the README), ``results/<name>`` (the
#: prose, and the site's copy of the plots, see docs/hooks.py) or ``../results/<name>`` (an image one folder down).
#: A path after a colon is a commit's, not the tree's: ``git show <sha>:benchmarks/results/<name>`` on the history
#: page. A glob or an elided name (``results/tta_*``) cites the name up to the wildcard, which is no file: spell it out.
RESULT_CITATION = re.compile(r"(?<![\w:./-])(?:\.\./)*(?:benchmarks/)?results/([\w.-]*\w)")
#: What a reader of the docs has never seen: an issue number, and a result file named after one or its round.
INTERNAL_NUMBERING = re.compile(r"\bissue[ _-]?[0-9]+|(?:tta|network|overhead)[0-9]{2}[a-z]?_", flags=re.IGNORECASE)


def _pages() -> dict[str, str]:
    """Every page of the site and the README, by their path from the repository root."""
    pages = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(DOCS.rglob("*.md")) if "browser" not in p.parts}
    return {**pages, "README.md": README}


def _cited_results() -> dict[str, set[str]]:
    """Each result file a page cites, with the pages that cite it."""
    cited: dict[str, set[str]] = defaultdict(set)
    for page, text in _pages().items():
        for name in RESULT_CITATION.findall(text):
            cited[name].add(page)
    return cited


def test_the_site_is_configured_over_every_page_and_shows_only_committed_plots() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "browser" not in p.parts}
    in_nav = set(re.findall(r":\s+(\S+\.md)$", config, flags=re.MULTILINE))
    assert pages == in_nav, (sorted(pages - in_nav), sorted(in_nav - pages))
    plots = {name for name in _cited_results() if name.endswith(".png")}
    assert plots and all((RESULTS / name).is_file() for name in plots)


def test_every_result_a_page_cites_is_in_the_tree_and_every_result_in_the_tree_is_cited() -> None:
    cited = _cited_results()
    assert cited
    missing = sorted(f"{name} (cited by {', '.join(sorted(pages))})" for name, pages in cited.items()
                     if not (RESULTS / name).is_file())  # fmt: skip
    assert not missing, f"pages cite results that benchmarks/results/ does not hold: {missing}"
    uncited = sorted(path.name for path in RESULTS.iterdir() if path.is_file() and path.name not in cited)
    assert not uncited, f"files in benchmarks/results/ that no page cites (cite them or git rm them): {uncited}"


def test_no_page_or_readme_names_an_issue_number_or_a_file_named_after_one() -> None:
    files = [path for path in sorted(DOCS.rglob("*")) if path.is_file() and "node_modules" not in path.parts]
    texts = {str(path.relative_to(ROOT)): path.read_text(errors="replace") for path in files if path.suffix != ".pyc"}
    offenders = [f"{name}:{number}: {line.strip()}" for name, text in {**texts, "README.md": README}.items()
                 for number, line in enumerate(text.splitlines(), 1) if INTERNAL_NUMBERING.search(line)]  # fmt: skip
    assert not offenders, offenders


def _anchors(page: Path) -> set[str]:
    """The ids the site gives the headings of a page (``toc``'s slugs: backticks and punctuation dropped)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower()) for heading in headings}


def test_the_readmes_links_into_the_docs_name_headings_that_exist() -> None:
    links = re.findall(r"\]\((docs/[^)#\s]+\.md)#([^)\s]+)\)", README)
    links += re.findall(r"^\[\w+\]: (docs/\S+\.md)#(\S+)$", README, flags=re.MULTILINE)
    assert links
    broken = [f"{path}#{anchor}" for path, anchor in links if anchor not in _anchors(ROOT / path)]
    assert not broken, f"the README links to headings its pages do not have: {broken}"

"""docs/ and the README, checked against the code: links resolve inside the repository, every
`cadence-fx` command in a code block parses, the generated references are what the generator
writes, the examples print what they show, and the contract reference names every field."""

import dataclasses
import doctest
import re
import shlex
from pathlib import Path

import pytest

from cadence_fx import contract as contract_module
from cadence_fx.cli import build_parser
from cadence_fx.docs import DOCS, generated

ROOT = DOCS.parent
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]  # docs/families/ too
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)|\b(?:src|href)=\"([^\"]+)\"")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", prose(page.read_text()), re.M)}


def links() -> list[tuple[Path, str]]:
    return [(page, a or b) for page in PAGES for a, b in LINK.findall(prose(page.read_text()))]


def test_the_docs_are_linked_from_the_readme():
    assert (ROOT / "README.md", "docs/README.md") in links()
    assert "shared/" not in (ROOT / "README.md").read_text()


def test_every_link_stays_in_the_repository_and_resolves():
    found = links()
    assert len(found) > 30
    for page, target in found:
        path, _, anchor = target.partition("#")
        assert "://" not in target and not target.startswith("mailto:"), f"{page.name} links out: {target}"
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{page.name}: {target} does not resolve"
        if anchor:
            assert resolved.suffix == ".md" and anchor in anchors(resolved), f"{page.name}: no heading #{anchor}"


def commands() -> list[tuple[Path, list[str]]]:
    """Every `cadence-fx ...` command in the code blocks, as argv (comments and continuations
    joined, environment assignments dropped)."""
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                for part in re.split(r"&&|;|\|", line):
                    if not re.match(r"\s*(?:[A-Z_]+=\S*\s+)*cadence-fx\b", part):
                        continue
                    words = shlex.split(part, comments=True)
                    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                        words = words[1:]
                    if words[:1] == ["cadence-fx"]:
                        found.append((page, words[1:]))
    return found


def test_every_cadence_fx_command_in_the_docs_parses():
    found = commands()
    assert len(found) > 20
    assert {argv[0] for _, argv in found} == {"catalog", "diff", "demo", "bench", "serve", "client", "prompt"}
    parser = build_parser()
    for page, argv in found:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page.name}: `cadence-fx {shlex.join(argv)}` does not parse")


def test_a_command_that_does_not_parse_is_caught():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["diff", "token2wav", "--chunks", "-1"])


def test_the_generated_references_are_what_the_generator_writes():
    written = generated()
    assert sorted(p.name for p in written) == ["cli.md", "service.md"]
    for path, text in written.items():
        assert path.read_text() == text, f"{path.name} is stale: run `python -m cadence_fx.docs`"


@pytest.mark.parametrize("page", ["method.md", "contract.md"])
def test_the_examples_print_what_they_show(page):
    result = doctest.testfile(str(DOCS / page), module_relative=False, verbose=False)
    assert result.attempted > 5 and result.failed == 0


def test_the_contract_reference_names_every_field_of_every_contract_class():
    text = (DOCS / "contract.md").read_text()
    sections = dict(re.findall(r"^### ([^\n]+)\n(.*?)(?=^##)", text, re.S | re.M))
    rows = {title: re.findall(r"^\| `(\w+)` \|(?: `(\w+)` \|)?", body, re.M) for title, body in sections.items()}
    for cls in (
        contract_module.Contract,
        contract_module.Clock,
        contract_module.Rate,
        contract_module.Region,
        contract_module.Admission,
        contract_module.Operator,
        contract_module.DeviceConstant,
        contract_module.Interactivity,
    ):
        assert [name for name, _ in rows[f"`{cls.__name__}`"]] == [f.name for f in dataclasses.fields(cls)], cls
    # Every registered policy, in the order of their names (not of their import); one with no field
    # has one row, its field column "(none)".
    assert rows["Retention policies"] == [
        (name, f.name) if dataclasses.fields(cls) else (name, "")
        for name, cls in sorted(contract_module.RETENTION_POLICIES.items())
        for f in (dataclasses.fields(cls) or (None,))
    ]
    assert "## Binding reference" in text


def test_the_binding_reference_names_every_field_of_every_binding_class():
    import cadence_fx.binding as binding_module

    text = (DOCS / "contract.md").read_text()
    section = text[text.index("## Binding reference") : text.index("## The rules")]
    named = re.findall(r"^\| `(\w+)\.(\w+)` \|", section, re.M)
    expected = [
        (cls.__name__, f.name)
        for cls in (binding_module.Binding, binding_module.RegionBinding, binding_module.OperatorBinding)
        for f in dataclasses.fields(cls)
    ]
    assert sorted(named) == sorted(expected)

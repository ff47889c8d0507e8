"""Reading a report page back (cadence_fx.diff_page.render_html) for exact assertions."""

from __future__ import annotations

from dataclasses import dataclass
from html.parser import HTMLParser

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass(frozen=True)
class Node:
    marks: frozenset[str]
    href: str | None


class Page(HTMLParser):
    """Every element with its attributes, the drawn graph nodes per SVG, and nesting errors."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.text = text
        self.elements: list[tuple[str, dict]] = []
        self.errors: list[str] = []
        self.svgs: dict[str, dict[str, Node]] = {}
        self._open: list[str] = []
        self._svg: str | None = None
        self._node: tuple[str, frozenset[str]] | None = None
        self.feed(self.text)
        self.close()
        self.errors += [f"<{tag}> never closed" for tag in self._open]

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if tag == "svg":
            self._svg = attrs["id"]
            self.svgs[self._svg] = {}
        if tag == "g" and "data-node" in attrs:
            self._node = (attrs["data-node"], frozenset(attrs["class"].split()) - {"node"})
            self.svgs[self._svg][self._node[0]] = Node(self._node[1], None)
        if tag == "a" and self._node is not None:
            self.svgs[self._svg][self._node[0]] = Node(self._node[1], attrs["href"])
        if tag not in _VOID:
            self._open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if not self._open or self._open[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self._open[-1] if self._open else 'nothing'}>")
            return
        self._open.pop()
        if tag == "g":
            self._node = None
        if tag == "svg":
            self._svg = None

    def values(self, attribute: str) -> list[str]:
        """Every value of `attribute` on the page, in order."""
        return [attrs[attribute] for _, attrs in self.elements if attribute in attrs]

    def marked(self, svg: str, mark: str) -> set[str]:
        return {name for name, node in self.svgs[svg].items() if mark in node.marks}

    def links(self, svg: str) -> dict[str, str]:
        return {name: node.href for name, node in self.svgs[svg].items() if node.href}

    def external(self) -> list[str]:
        """src and href values that leave the page."""
        return [v for _, attrs in self.elements for k, v in attrs.items() if k in ("src", "href") and not v.startswith("#")]

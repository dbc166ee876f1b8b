"""The README is the front door: short, with the two set-up commands the Makefile really
has and a first request; every relative link in it, in docs/ and in bench/README.md leads
to a file (and heading) that exists, and none leads outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

LINK = re.compile(r"\]\(([^)\s]+)\)")                 # [text](target)
URL = re.compile(r"https?://([^/\s`'\")>:]+)")
LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0"}


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lowercased, punctuation but - and _ dropped, spaces to -,
    a repeated id numbered -1, -2, ...; headings inside code blocks do not count."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not (m := re.match(r"#{1,6} (.*)", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_short_and_has_the_set_up_commands():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    for command in ("make serve", "make test", "curl -s localhost:30000/generate"):
        assert command in text, command
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
    for target in re.findall(r"make ([\w-]+)", text):
        assert target in targets, f"README runs `make {target}`, which the Makefile lacks"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(page):
    text = page.read_text()
    for host in URL.findall(text):
        assert host in LOCAL_HOSTS or re.fullmatch(r"10(\.\d+){3}", host), \
            f"{page.name} links outside the repository: {host}"
    for target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        assert dest.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page.name}: no heading #{anchor} in {path}"

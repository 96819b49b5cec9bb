"""Every link into the docs lands: a relative Markdown link's file exists and its `#anchor` is one of that file's
headings (GitHub's slugs), and so is every `docs/PAGE.md#anchor` the code's help texts and messages name."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]*)(#[^)\s]+)?\)")
CODE_LINK = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")
PACKAGES = ("pipeline", "decode", "distill", "monitor", "benchmarks", "configs")


def slugs(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted(p for p in ROOT.glob("*/README.md") if p.parent.name in PACKAGES)]


def test_every_markdown_link_names_a_file_and_heading_that_exist():
    broken = []
    for page in pages():
        for target, anchor in MARKDOWN_LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            linked = (page.parent / target).resolve() if target else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor and linked.suffix == ".md" and anchor[1:] not in slugs(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}{anchor} names no heading")
    assert not broken, "\n".join(broken)


def test_every_docs_anchor_the_code_names_exists():
    broken = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")) + sorted((ROOT / package).rglob("*.yaml")):
            for page, anchor in CODE_LINK.findall(path.read_text()):
                if not (ROOT / "docs" / page).exists() or anchor not in slugs(ROOT / "docs" / page):
                    broken.append(f"{path.relative_to(ROOT)}: docs/{page}#{anchor}")
    assert not broken, "\n".join(broken)

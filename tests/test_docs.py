"""The user's manual keeps up with the code: README.md names every flag of `safeserve serve`
(the fields of `ServerArgs`), every metric of `safeserve/server/metrics.py` and every HTTP and
admin route; and every relative link in README.md and docs/*.md resolves (files, and the
headings that `#anchor`s name)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from prometheus_client import Counter

from safeserve.config import ServerArgs
from safeserve.server.metrics import METRICS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_names_every_flag() -> None:
    text = README.read_text()
    flags = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(ServerArgs)]
    missing = [f for f in flags if f"`{f}`" not in text]
    assert not missing, f"README.md's flags table lacks {missing}"


def test_readme_names_every_metric() -> None:
    text = README.read_text()
    names = [
        m.name if m.kind is not Counter or m.name.endswith("_total") else m.name + "_total"
        for m in METRICS
    ]
    missing = [n for n in names if not re.search(rf"`{n}`", text)]
    assert not missing, f"README.md's Metrics section lacks {missing}"


def routes() -> list[str]:
    found = []
    for path in (ROOT / "safeserve" / "server").glob("*.py"):
        found += re.findall(r'@app\.(?:get|post|delete)\(\s*"([^"]+)"', path.read_text())
    assert len(found) > 10
    return sorted(set(found))


def test_readme_names_every_route() -> None:
    text = README.read_text()
    # a route's fixed part: `/v1/models/{model_id:path}` is documented as `/v1/models/{id}`
    missing = [r for r in routes() if r.split("{")[0].rstrip("/") not in text]
    assert not missing, f"README.md's endpoint tables lack {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)

"""mkdocs build hook: publish the repository's README.md as the site page `readme.md`.

The pages in docs/ link to the README as `../README.md` (the path that works in
a checkout and on a code host); in the built site those links are pointed at
the README's page instead.
"""

from __future__ import annotations

import pathlib
import posixpath
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGE = "readme.md"
_LINK = re.compile(r"\]\((?P<target>(?:\.\./)+README\.md)(?P<anchor>#[^)\s]*)?\)")


def on_files(files, config):
    files.append(File.generated(config, PAGE, abs_src_path=str(README)))
    return files


def on_page_markdown(markdown, page, config, files):
    here = posixpath.dirname(page.file.src_uri)
    docs = pathlib.Path(config["docs_dir"]).resolve()

    def repoint(m: re.Match) -> str:
        target = (docs / here / m.group("target")).resolve()
        if target != README:
            return m.group(0)
        rel = posixpath.relpath(PAGE, here or ".")
        return f"]({rel}{m.group('anchor') or ''})"

    return _LINK.sub(repoint, markdown)

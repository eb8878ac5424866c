#!/usr/bin/env bash
# The unit tests against the compiled build: a copy of the checkout (tracked and new files) in a scratch
# directory, setup.py's modules compiled there in place with mypyc, then `pytest tests/unit` in it with
# DOCKD_EXPECT_COMPILED=1 (tests/unit/test_compiled.py: every listed module is its extension, and its .py
# still imports as plain Python). The checkout itself is never compiled.
#   scripts/test_compiled.sh [PYTHON] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute, the venv's link kept
shift || true
work=$(mktemp -d "${TMPDIR:-/tmp}/dockd-compiled.XXXXXX")
trap 'rm -rf "$work"' EXIT
git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
	| tar --null -T - -cf - | tar -xf - -C "$work"
cd "$work"
"$PY" -c "import mypyc" 2>/dev/null || { echo "test_compiled: mypyc (mypy, the dev extra) is missing" >&2; exit 1; }
"$PY" setup.py -q build_ext --inplace  # (setup.py falls back to pure Python; the check below does not)
ls dockd/controller/core.*.so >/dev/null
DOCKD_EXPECT_COMPILED=1 "$PY" -m pytest tests/unit -m "not slow" -q -p no:cacheprovider "$@"

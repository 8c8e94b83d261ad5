#!/usr/bin/env bash
# Creates .venv with the pinned test requirements (again only when tests/requirements.txt changes), then runs
# the given command inside it:   bash tools/venv.sh python -m pytest
#
# Each tests/requirements-transformers-<ver>.txt adds an older transformers for the tests that need it: its lines are
# installed with --no-deps into .venv/extra/transformers-<ver> (so a file lists transformers plus exactly the deps
# whose pins differ from .venv's), and tools/test.sh runs the tests marked for that version with that folder first
# on PYTHONPATH. Each folder is reinstalled only when its file, tests/requirements.txt or the venv's Python changes.
#
# TORCH_INDEX_URL (optional) is the index torch alone is taken from, e.g. https://download.pytorch.org/whl/cpu for
# the CPU-only build (about 190 MB) where pip's default index would take a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
want=$(cat tests/requirements.txt | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.requirements.sha" 2>/dev/null)" != "$want" ]; then
  python3 -m venv "$venv"
  # torch alone and first, exactly pinned: anything that lets pip choose pulls a multi-GB CUDA build.
  "$venv/bin/pip" install -q --disable-pip-version-check ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    "$(grep -m1 '^torch==' tests/requirements.txt)"
  "$venv/bin/pip" install -q --disable-pip-version-check -r tests/requirements.txt
  echo "$want" > "$venv/.requirements.sha"
fi
for req in tests/requirements-transformers-*.txt; do
  [ -e "$req" ] || continue
  extra="$venv/extra/$(basename "$req" .txt | sed 's/^requirements-//')"
  want_extra=$( { cat tests/requirements.txt "$req"; "$venv/bin/python" -V; } | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$extra/.requirements.sha" 2>/dev/null)" != "$want_extra" ]; then
    rm -rf "$extra"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-compile --target "$extra" -r "$req"
    echo "$want_extra" > "$extra/.requirements.sha"
  fi
done
PATH="$PWD/$venv/bin:$PATH" exec "$@"

#!/usr/bin/env bash
# Creates .venv with the pinned test requirements (again only when tests/requirements.txt changes), then runs
# the given command inside it:   bash tools/venv.sh python -m pytest
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
want=$(cat tests/requirements.txt | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.requirements.sha" 2>/dev/null)" != "$want" ]; then
  python3 -m venv "$venv"
  # torch alone and first, exactly pinned: anything that lets pip choose pulls a multi-GB CUDA build.
  "$venv/bin/pip" install -q --disable-pip-version-check "$(grep -m1 '^torch==' tests/requirements.txt)"
  "$venv/bin/pip" install -q --disable-pip-version-check -r tests/requirements.txt
  echo "$want" > "$venv/.requirements.sha"
fi
PATH="$PWD/$venv/bin:$PATH" exec "$@"

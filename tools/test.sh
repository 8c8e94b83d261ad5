#!/usr/bin/env bash
# The README's test command (CI runs it too):   bash tools/test.sh [pytest arguments]
#
# Lints the tree as ComfyUI's own CI does (`ruff check .`, rules in pyproject.toml), then runs the test suite twice:
#   1. "without ComfyUI": in .venv, the pack's pinned test environment (tools/venv.sh), COMFYUI_PATH unset;
#   2. "with ComfyUI": in .venv-comfyui, built from that ComfyUI's own requirements.txt (plus the torch/torchvision
#      pair below and tests/requirements-comfyui.txt), with COMFYUI_PATH at
#        - $COMFYUI_PATH when set (used in place), else
#        - a temporary copy of ../shared/comfyui/0.33.0 beside the checkout, when it exists.
#      The simulated newer cores (tests/simulated_cores.py) run inside this run.
# Where no ComfyUI is found, only run 1 happens; the summary says how many tests skipped and why.
# Exits non-zero when any run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
shared_comfyui="$root/../shared/comfyui/0.33.0"
# ComfyUI's requirements.txt leaves torch unpinned; this pair lies on this project's build machines, and a PyPI
# torchvision beside another torch fails at import (torchvision::nms). No torchaudio matches torch 2.14: 2.11.x
# imports and runs ComfyUI's basic audio ops, installed without its torch pin.
comfy_torch="torch==2.14.1 torchvision==0.29.1"
# Installed without their dependencies: this torchaudio pins an older torch, and the official templates the swap-tool
# tests read are newer than the templates package of ComfyUI's requirements pins.
comfy_no_deps="torchaudio==2.11.* $(grep -m1 '^comfyui-workflow-templates-json==' tests/requirements.txt)"

logs=$(mktemp -d)
temp_comfyui=""
cleanup() { rm -rf "$logs" ${temp_comfyui:+"$temp_comfyui"}; }
trap cleanup EXIT

summary() {  # the last line pytest printed, e.g. "312 passed, 4 skipped in 61.2s"
  grep -E '(passed|failed|error|skipped|no tests ran)' "$1" | tail -n 1 | sed 's/^=* *//; s/ *=*$//'
}

comfyui_env() {  # build (or reuse) .venv-comfyui for the ComfyUI at $1
  local comfy=$1 venv=.venv-comfyui want
  want=$( { grep -vE '^(torch|torchvision|torchaudio)([^a-z_-]|$)' "$comfy/requirements.txt"; \
            cat tests/requirements-comfyui.txt; echo "$comfy_torch $comfy_no_deps"; python3 -V; } \
          | sha256sum | cut -d' ' -f1)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.requirements.sha" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  echo "== building $venv from $comfy/requirements.txt (first run: a few minutes, about 6 GB)"
  rm -rf "$venv"
  python3 -m venv "$venv" || return 1
  local pip=("$venv/bin/pip" install -q --disable-pip-version-check)
  "${pip[@]}" $comfy_torch || return 1
  "${pip[@]}" -r <(grep -vE '^(torch|torchvision|torchaudio)([^a-z_-]|$)' "$comfy/requirements.txt") \
    -r tests/requirements-comfyui.txt || return 1
  "${pip[@]}" --no-deps $comfy_no_deps || return 1
  echo "$want" > "$venv/.requirements.sha"
}

status=0

echo "== lint: ruff check ."
bash tools/venv.sh ruff check . 2>&1 | tee "$logs/lint.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== run 1: without ComfyUI (.venv)"
env -u COMFYUI_PATH bash tools/venv.sh python -m pytest -rs "$@" 2>&1 | tee "$logs/without.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

comfy=""
if [ -n "${COMFYUI_PATH:-}" ]; then
  comfy=$COMFYUI_PATH
  if [ ! -f "$comfy/main.py" ] || [ ! -d "$comfy/comfy" ]; then
    echo "COMFYUI_PATH=$comfy is not a ComfyUI checkout (no main.py and comfy/ there)" >&2
    exit 2
  fi
elif [ -d "$shared_comfyui" ]; then
  temp_comfyui=$(mktemp -d)
  comfy="$temp_comfyui/ComfyUI"
  cp -r "$shared_comfyui" "$comfy" && chmod -R u+w "$comfy"
fi

if [ -n "$comfy" ]; then
  echo "== run 2: with ComfyUI at $comfy (.venv-comfyui)"
  if comfyui_env "$comfy"; then
    COMFYUI_PATH=$comfy .venv-comfyui/bin/python -m pytest -rs "$@" 2>&1 | tee "$logs/with.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  else
    echo "could not build .venv-comfyui from $comfy/requirements.txt" | tee "$logs/with.txt"
    status=1
  fi
fi

echo
echo "== summary"
echo "lint:            $(tail -n 1 "$logs/lint.txt")"
echo "without ComfyUI: $(summary "$logs/without.txt")"
if [ -n "$comfy" ]; then
  echo "with ComfyUI:    $(summary "$logs/with.txt")"
else
  echo "with ComfyUI:    not run: set COMFYUI_PATH to a ComfyUI checkout (or place ComfyUI 0.33.0 at ../shared/comfyui/0.33.0)"
  echo "skipped in run 1, by reason:"
  grep -E '^SKIPPED' "$logs/without.txt" | sed 's/^SKIPPED \[\([0-9]*\)\] [^:]*:[0-9]*: /\1\t/' \
    | awk -F'\t' '{n[$2]+=$1} END {for (r in n) printf "  %4d  %s\n", n[r], r}' | sort -rn
fi
exit $status

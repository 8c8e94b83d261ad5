#!/usr/bin/env bash
# The README's test command (CI runs it too):   bash tools/test.sh [--fast] [pytest arguments]
#
# Lints the tree as ComfyUI's own CI does (`ruff check .`, rules in pyproject.toml), then runs the tiers
# (docs/testing.md, "Tiers"; the markers are declared in pyproject.toml):
#   1. "without ComfyUI": in .venv, the pack's pinned test environment (tools/venv.sh), COMFYUI_PATH unset; then
#      once per tests/requirements-transformers-<version>.txt with that transformers first on the path
#      (`pytest --transformers <version>`: the tests marked for it);
#   2. "with ComfyUI": in .venv-comfyui, built from that ComfyUI's own requirements.txt (plus the torch/torchvision
#      pair below and tests/requirements-comfyui.txt), as two pytest processes at once (the e2e tests, the rest),
#      with COMFYUI_PATH at
#        - $COMFYUI_PATH when set (used in place), else
#        - a temporary copy of ../shared/comfyui/0.33.0 beside the checkout, when it exists;
#   3. "simulated cores": each core of tests/hotfix_testing/simulated_cores.py built from ../shared/comfyui and run in its own
#      process with `pytest --core NAME`: the tests marked for it and their switched-off red controls.
# --fast runs the lint and run 1 only (everyday work: a few minutes). Where no ComfyUI is found, only run 1 happens;
# the summary says how many tests skipped and why, and how long each run took. Exits non-zero when any run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
shared_comfyui="$root/../shared/comfyui/0.33.0"
# ComfyUI's requirements.txt leaves torch unpinned; this pair lies on this project's build machines, and a PyPI
# torchvision beside another torch fails at import (torchvision::nms). No torchaudio matches torch 2.14: 2.11.x
# imports and runs ComfyUI's basic audio ops, installed without its torch pin.
comfy_torch="torch==2.14.1 torchvision==0.29.1"
# Installed without their dependencies: this torchaudio pins an older torch, the official templates the swap-tool
# tests read are newer than the templates package of ComfyUI's requirements pins, and raylight's parallel attention
# (tests/test_raylight_usp.py) needs only xfuser's distributed and attention files and yunchang, not xfuser's
# pipelines (diffusers and more); 0.4.5 is the xfuser raylight 1.9.0's minimal loader fits.
comfy_no_deps="torchaudio==2.11.* $(grep -m1 '^comfyui-workflow-templates-json==' tests/requirements.txt) xfuser==0.4.5 yunchang==0.6.4"
# A newer comfy-kitchen beside ComfyUI's pinned one, for the tests that read a fix on it (its folder first on the
# path): 0.2.36 is the first that answers flash_attention_decode_is_available for a non-CUDA device itself.
comfy_kitchen_overlay="comfy-kitchen==0.2.36"
# The newest frontend beside the one ComfyUI pins, for the browser tests (ComfyUI serves it with --front-end-root).
comfy_frontend_overlay="comfyui-frontend-package==1.58.1"

fast=0
if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi

logs=$(mktemp -d)
temp_comfyui=""
cleanup() { rm -rf "$logs" ${temp_comfyui:+"$temp_comfyui"}; }
trap cleanup EXIT

summary() {  # the last line pytest printed, e.g. "312 passed, 4 skipped in 61.2s"
  grep -E '(passed|failed|error|skipped|deselected|no tests ran)' "$1" | tail -n 1 | sed 's/^=* *//; s/ *=*$//'
}

comfyui_env() {  # build (or reuse) .venv-comfyui for the ComfyUI at $1
  local comfy=$1 venv=.venv-comfyui want
  want=$( { grep -vE '^(torch|torchvision|torchaudio)([^a-z_-]|$)' "$comfy/requirements.txt"; \
            cat tests/requirements-comfyui.txt; echo "$comfy_torch $comfy_no_deps $comfy_kitchen_overlay $comfy_frontend_overlay"; python3 -V; } \
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
  for overlay in "$comfy_kitchen_overlay" "$comfy_frontend_overlay"; do
    "${pip[@]}" --no-deps --no-compile --target "$venv/extra/${overlay/==/-}" "$overlay" || return 1
  done
  echo "$want" > "$venv/.requirements.sha"
}

status=0
declare -A seconds
timed() {  # timed NAME COMMAND...: runs it, keeping its wall time for the summary
  local name=$1 started=$SECONDS; shift
  "$@"; local rc=$?
  seconds[$name]=$((SECONDS - started))
  return $rc
}

echo "== lint: ruff check ."
bash tools/venv.sh ruff check . 2>&1 | tee "$logs/lint.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

comfy=""
if [ "$fast" -eq 0 ] && [ -n "${COMFYUI_PATH:-}" ]; then
  comfy=$COMFYUI_PATH
  if [ ! -f "$comfy/main.py" ] || [ ! -d "$comfy/comfy" ]; then
    echo "COMFYUI_PATH=$comfy is not a ComfyUI checkout (no main.py and comfy/ there)" >&2
    exit 2
  fi
elif [ "$fast" -eq 0 ] && [ -d "$shared_comfyui" ]; then
  temp_comfyui=$(mktemp -d)
  comfy="$temp_comfyui/ComfyUI"
  cp -r "$shared_comfyui" "$comfy" && chmod -R u+w "$comfy"
fi

# .venv-comfyui builds (when it must) while run 1 runs: on two cores the two overlap well (pip is mostly waiting)
if [ -n "$comfy" ]; then
  ( started=$SECONDS; comfyui_env "$comfy"; built=$?; echo $((SECONDS - started)) > "$logs/build.seconds"
    exit $built ) > "$logs/build.txt" 2>&1 &
  build_pid=$!
fi

echo "== run 1: without ComfyUI (.venv)"
run_without() { env -u COMFYUI_PATH bash tools/venv.sh python -m pytest -rs "$@" 2>&1 | tee "$logs/without.txt"; \
  return "${PIPESTATUS[0]}"; }
timed "without ComfyUI" run_without "$@" || status=1
for req in tests/requirements-transformers-*.txt; do  # run 1 again with another transformers first on the path
  version=$(basename "$req" .txt | sed 's/^requirements-transformers-//')
  echo "== run 1, transformers $version (.venv/extra/transformers-$version)"
  run_version() { env -u COMFYUI_PATH PYTHONPATH=".venv/extra/transformers-$version${PYTHONPATH:+:$PYTHONPATH}" \
    bash tools/venv.sh python -m pytest -rs --transformers "$version" "$@" 2>&1 | tee "$logs/transformers-$version.txt"
    local rc=${PIPESTATUS[0]}; [ "$rc" -eq 5 ] && rc=0; return "$rc"; }  # 5: the arguments selected none of its tests
  timed "transformers $version" run_version "$@" || status=1
done

if [ -n "$comfy" ]; then
  echo "== run 2: with ComfyUI at $comfy (.venv-comfyui)"
  wait "$build_pid"; built=$?
  cat "$logs/build.txt"
  seconds["building .venv-comfyui (beside run 1)"]=$(cat "$logs/build.seconds")
  if [ "$built" -eq 0 ]; then
    # Two pytest processes at once, each printed whole when it ends: the end-to-end tests (marker e2e: they share
    # their servers) and the rest. On two cores they overlap well: most tests wait on a subprocess or run one thread.
    # -m "not stdlib": run 1 ran those, and nothing they use differs here; --durations: where its time goes (CI time)
    run_half() {  # run_half NAME MARKER-EXPRESSION [pytest arguments]
      local name=$1 marks=$2; shift 2
      COMFYUI_PATH=$comfy .venv-comfyui/bin/python -m pytest -rs --durations=15 -m "not stdlib and ($marks)" "$@" \
        > "$logs/with-$name.txt" 2>&1
      local rc=$?; [ "$rc" -eq 5 ] && rc=0  # 5: the arguments selected none of its tests
      echo "== run 2, $name: exit $rc"; cat "$logs/with-$name.txt"; return "$rc"
    }
    run_with() {
      run_half "end to end" "e2e" "$@" & local e2e=$!
      run_half "the rest" "not e2e" "$@"; local rest=$?
      wait "$e2e" && [ "$rest" -eq 0 ]
    }
    timed "with ComfyUI" run_with "$@" || status=1
    if [ -d "$shared_comfyui" ]; then
      echo "== run 3: simulated cores, built from $shared_comfyui (.venv-comfyui)"
      run_cores() { .venv-comfyui/bin/python tests/hotfix_testing/simulated_cores.py -rs "$@" 2>&1 | tee "$logs/cores.txt"; \
        return "${PIPESTATUS[0]}"; }
      timed "simulated cores" run_cores "$@" || status=1
    fi
  else
    echo "could not build .venv-comfyui from $comfy/requirements.txt" | tee "$logs/with-end to end.txt" \
      "$logs/with-the rest.txt"
    status=1
  fi
fi

echo
echo "== summary"
echo "lint:            $(tail -n 1 "$logs/lint.txt")"
echo "without ComfyUI: $(summary "$logs/without.txt")"
for log in "$logs"/transformers-*.txt; do
  [ -e "$log" ] && printf '%-19s%s\n' "$(basename "$log" .txt | tr - ' '):" "$(summary "$log")"
done
if [ -n "$comfy" ]; then
  for half in "end to end" "the rest"; do
    printf '%s %s\n' "with ComfyUI, $half:" "$(summary "$logs/with-$half.txt")"
  done
  [ -f "$logs/cores.txt" ] && echo "simulated cores: $(tail -n 1 "$logs/cores.txt")" \
    && grep -E '^== simulated core .*: (passed|FAILED) in' "$logs/cores.txt" | sed 's/^== /  /'
elif [ "$fast" -eq 1 ]; then
  echo "with ComfyUI:    not run (--fast)"
else
  echo "with ComfyUI:    not run: set COMFYUI_PATH to a ComfyUI checkout (or place ComfyUI 0.33.0 at ../shared/comfyui/0.33.0)"
  echo "skipped in run 1, by reason:"
  grep -E '^SKIPPED' "$logs/without.txt" | sed 's/^SKIPPED \[\([0-9]*\)\] [^:]*:[0-9]*: /\1\t/' \
    | awk -F'\t' '{n[$2]+=$1} END {for (r in n) printf "  %4d  %s\n", n[r], r}' | sort -rn
fi
echo "wall time by part, slowest first:"
for name in "${!seconds[@]}"; do printf '  %5d s  %s\n' "${seconds[$name]}" "$name"; done | sort -rn
exit $status

#!/usr/bin/env bash
# The second environment for the SGLang plugin's tests (tests/sglang): sglang==VERSION
# with the torch it pins (2.14.1; pip takes it from this machine's disk on Python 3.11),
# built once under ENV_DIR (outside the checkout, keyed by the sglang version) and
# reused; our package is installed editable from CHECKOUT, re-pointed whenever the
# checkout or its pyproject.toml changes (CI runs from a fresh clone elsewhere).
#
#   scripts/sglang_env.sh ENV_DIR VERSION CHECKOUT
#
# Exit 0: ENV_DIR/bin/python imports sglang and this checkout's sglang_echo, and sees the
# `echo` plugin entry point. Otherwise exit 1 with the reason on stderr; a failed build
# is removed so that the next run starts clean.
set -uo pipefail

ENV_DIR=$1
VERSION=$2
CHECKOUT=$(cd "$3" && pwd)
PY="$ENV_DIR/bin/python"
BUILT="$ENV_DIR/.built-sglang-$VERSION"
POINTER="$ENV_DIR/.echo-checkout"
LOG="$ENV_DIR.build.log"
NEED_GB=14 # sglang 0.5.23 + torch 2.14.1 (CUDA build) + kernels: ~11 GB

fail() {
  echo "sglang_env: $*" >&2
  exit 1
}

mkdir -p "$(dirname "$ENV_DIR")" || fail "cannot create $(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock" || fail "cannot open the lock $ENV_DIR.lock"
flock 9 # one build at a time; a second make waits, then reuses it

if [ ! -f "$BUILT" ]; then
  rm -rf "$ENV_DIR"
  free_kb=$(df -Pk "$(dirname "$ENV_DIR")" | awk 'NR==2 {print $4}')
  if [ "${free_kb:-0}" -lt $((NEED_GB * 1024 * 1024)) ]; then
    fail "only $((free_kb / 1024 / 1024)) GB free under $(dirname "$ENV_DIR"); sglang $VERSION needs ~$NEED_GB GB"
  fi
  PYTHON=$(command -v python3.11 || command -v python3)
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
    echo "sglang_env: warning: $PYTHON is not Python 3.11; pip may download torch (~3 GB)" >&2
  echo "sglang_env: building $ENV_DIR (sglang==$VERSION, ~7 min, ~11 GB; log: $LOG)" >&2
  if ! { "$PYTHON" -m venv "$ENV_DIR" &&
    "$PY" -m pip install --disable-pip-version-check "sglang==$VERSION" pytest hypothesis; } >"$LOG" 2>&1; then
    rm -rf "$ENV_DIR"
    fail "pip could not install sglang==$VERSION (registry, disk or build); last line of $LOG: $(tail -n 1 "$LOG" | cut -c1-300)"
  fi
  touch "$BUILT"
fi

want="$CHECKOUT $(sha256sum "$CHECKOUT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$POINTER" 2>/dev/null)" != "$want" ]; then
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$CHECKOUT" >>"$LOG" 2>&1 ||
    fail "could not install $CHECKOUT into $ENV_DIR (see $LOG)"
  echo "$want" >"$POINTER"
fi

# From outside the checkout, so that what is found is what is installed.
(cd / && "$PY" - "$CHECKOUT" <<'EOF') || fail "the environment at $ENV_DIR is broken; delete it to rebuild"
import sys
from importlib.metadata import entry_points

import sglang
import sglang_echo

checkout = sys.argv[1]
assert sglang.__version__, "sglang has no version"
assert sglang_echo.__file__.startswith(checkout + "/"), (sglang_echo.__file__, checkout)
names = [ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.name == "echo"]
assert names == ["sglang_echo.plugin:register"], names
EOF

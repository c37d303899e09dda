#!/usr/bin/env bash
# scripts/demo.sh --hf installs the package only when it must, and never replaces a CUDA build
# with a CPU-only one. Runs after scripts/test.sh (.ci/run), on the .venv it installed into.
#
#   1. sources unchanged since test.sh's install: the demo says so and installs nothing;
#   2. a source newer than the install: the demo reinstalls, with the backend it had (a CUDA
#      build stays a CUDA build), and compiles nothing already compiled in the CMake tree;
#   3. each time `deltastate.cuda_built()` is what it was before.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/package.sh
PY=${VENV:-$PWD/.venv}/bin/python
fail() { echo "FAIL: $*" >&2; exit 1; }
demo() { scripts/demo.sh --hf --layers 1 --batch 1 --new-tokens 2 --no-compare 2>&1; }

before=$(installed_backend "$PY")
[ "$before" != none ] || fail "no deltastate in $PY (run scripts/test.sh first)"

out=$(demo) || fail "demo failed: $out"
grep -q "deltastate is current (CUDA backend: " <<<"$out" || fail "unchanged sources, yet: $out"
grep -q "installing" <<<"$out" && fail "reinstalled unchanged sources: $out"
[ "$(installed_backend "$PY")" = "$before" ] || fail "backend changed: $before -> $(installed_backend "$PY")"

touch python/deltastate/__init__.py  # a source newer than the install
out=$(demo) || fail "demo failed: $out"
grep -q "installing deltastate from this tree .*(sources changed since its install" <<<"$out" ||
  fail "a changed source was not reinstalled: $out"
[ "$(installed_backend "$PY")" = "$before" ] || fail "backend changed: $before -> $(installed_backend "$PY")"
out=$(demo) || fail "demo failed: $out"
grep -q "deltastate is current" <<<"$out" || fail "reinstalled a second time: $out"
echo "demo_install: the installed backend ($before) was kept throughout"
echo "demo_install: 3 passed, 0 failed"

#!/usr/bin/env bash
# clang-format over every tracked C++/CUDA file, with the committed .clang-format.
#
#   scripts/format.sh           rewrite the files in place
#   scripts/format.sh --check   change nothing; fail, naming the files, if any differs (CI runs this)
#
# Needs clang-format 14 (Debian's clang-format; installed with apt when missing and possible).
# Other versions format some constructs differently, so the check pins the major version.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
if ! command -v "$CLANG_FORMAT" >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-format >/dev/null
  else
    echo "error: clang-format not found (Debian: apt-get install clang-format)" >&2; exit 1
  fi
fi
version=$("$CLANG_FORMAT" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
if [ "$version" != 14 ]; then
  echo "error: $CLANG_FORMAT is version $version; the tree is formatted with clang-format 14" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = --check ]; then
  "$CLANG_FORMAT" --style=file --dry-run -Werror "${files[@]}"
  echo "format: ${#files[@]} files as clang-format makes them"
else
  "$CLANG_FORMAT" --style=file -i "${files[@]}"
fi

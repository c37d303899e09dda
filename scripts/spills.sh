#!/usr/bin/env bash
# The register spills ptxas reports in a build log (-Xptxas=-warn-spills, CMakeLists.txt): one
# line per kernel, "stores<TAB>loads<TAB>kernel" (bytes; the kernel demangled), sorted.
#
#   scripts/spills.sh build/build.log            the spills of that build
#   scripts/spills.sh --check build/build.log    compare them with docs/SPILLS.md's list: fails,
#                                                naming them, on a kernel that spills and is not
#                                                listed or spills more bytes than listed
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
if [ "${1:-}" = --check ]; then check=1; shift; fi
list() {
  grep -o "Registers are spilled to local memory in function '[^']*', [0-9]* bytes spill stores, [0-9]* bytes spill loads" "$1" |
    sed -E "s/.*function '([^']*)', ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads/\2 \3 \1/" |
    while read -r stores loads fn; do
      printf '%s\t%s\t%s\n' "$stores" "$loads" "$(c++filt "$fn")"
    done | sort -t "$(printf '\t')" -k3,3 -u
}
if [ $check = 0 ]; then list "$1"; exit 0; fi
found=$(list "$1")
[ -n "$found" ] || exit 0  # nothing compiled with ptxas in this build
known=$(sed -n '/^```spills$/,/^```$/p' docs/SPILLS.md | grep -P '^\d+\t\d+\t' || true)
bad=$(awk -F'\t' 'NR == FNR { s[$3] = $1; l[$3] = $2; next }
                  !($3 in s) || $1 > s[$3] || $2 > l[$3]' <(printf '%s\n' "$known") <(printf '%s\n' "$found"))
n=$(printf '%s\n' "$found" | wc -l)
if [ -n "$bad" ]; then
  printf '%s\n' "$bad" >&2
  echo "error: the kernels above spill registers beyond docs/SPILLS.md's list (stores, loads" \
    "in bytes): measure them, then record them there (scripts/spills.sh $1)" >&2
  exit 1
fi
echo "ptxas: the $n register-spill warnings of this build are known: docs/SPILLS.md lists each" \
  "kernel with its bytes, and its timing where one was measured"

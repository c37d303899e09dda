# Installing the Python package from this tree, shared by scripts/test.sh and scripts/demo.sh
# (sourced, from the repository root).
#
# `pip install .` runs in an existing CMake build tree (scikit-build-core's build-dir): the objects
# that tree already compiled (the library, the CUDA backend) are reused, not compiled a second time
# in a tree of pip's own. The install writes a stamp into the environment, so that an unchanged
# tree is not installed again.

# What the installed package is built from: a file here newer than the stamp means a reinstall.
PACKAGE_SOURCES=(CMakeLists.txt pyproject.toml include src python/CMakeLists.txt python/src
  python/deltastate tools)

# The stamp of the install into the environment of python $1.
package_stamp() { echo "$("$1" -c 'import sys; print(sys.prefix)')/.deltastate-install"; }

# "cuda", "cpu" or "none": what `import deltastate` gives in python $1 (its backend: built with
# CUDA or CPU-only), "none" when it does not import.
installed_backend() {
  "$1" -c 'import deltastate as d; print("cuda" if d.cuda_built() else "cpu")' 2>/dev/null ||
    echo none
}

# Succeeds when a source file changed since stamp $1 was written (or there is no stamp).
sources_changed() {
  [ -f "$1" ] || return 0
  [ -n "$(find "${PACKAGE_SOURCES[@]}" -type f -newer "$1" ! -name '*.pyc' -print -quit)" ]
}

# Uses the generator build tree $1 was configured with (else Ninja when present): pip's CMake run
# over the same tree must use the same one.
use_generator_of() {
  local gen=
  [ -f "$1/CMakeCache.txt" ] && gen=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$1/CMakeCache.txt")
  if [ -z "$gen" ]; then
    gen=${CMAKE_GENERATOR:-}
    [ -z "$gen" ] && command -v ninja >/dev/null && gen=Ninja
  fi
  if [ -n "$gen" ]; then export CMAKE_GENERATOR=$gen; fi
}

# The value of CMake cache variable $2 in build tree $1, else $3.
cache_value() {
  local v=
  [ -f "$1/CMakeCache.txt" ] && v=$(sed -n "s/^$2:[A-Z]*=//p" "$1/CMakeCache.txt")
  echo "${v:-$3}"
}

# pip install . into python $1 over CMake build tree $2 with DELTASTATE_CUDA=$3 (AUTO, ON, OFF);
# further arguments go to pip. The other definitions are the tree's own (a new tree: no tests, the
# generic CUDA kernels unless DELTASTATE_CUDA_ALL_KERNELS says otherwise), so pip's configure run
# changes nothing that would recompile; it builds only pyproject.toml's build.targets (the
# module, the CLI) and installs them. The stamp is written on success, dated from the start.
install_package() {
  local py=$1 build=$2 cuda=$3
  shift 3
  case $build in /*) ;; *) build=$PWD/$build ;; esac
  use_generator_of "$build"
  local stamp all tests ptx
  stamp=$(package_stamp "$py")
  all=$(cache_value "$build" DELTASTATE_CUDA_ALL_KERNELS "${DELTASTATE_CUDA_ALL_KERNELS:-OFF}")
  tests=$(cache_value "$build" DELTASTATE_BUILD_TESTS OFF)
  ptx=$(cache_value "$build" DELTASTATE_CUDA_PTX ON)
  rm -f "$stamp"
  touch "$stamp.new"
  SKBUILD_CMAKE_DEFINE="DELTASTATE_CUDA=$cuda;DELTASTATE_CUDA_ALL_KERNELS=$all;DELTASTATE_CUDA_PTX=$ptx;DELTASTATE_BUILD_TESTS=$tests;DELTASTATE_BUILD_TOOLS=ON" \
    "$py" -m pip install --no-build-isolation --config-settings=build-dir="$build" "$@" . &&
    mv "$stamp.new" "$stamp"
}

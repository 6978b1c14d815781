#!/usr/bin/env bash
# Build the stand-in native module for one interpreter:
#   benchmarks/native_views/build.sh [PYTHON]   (default: /work/main/.venv-test/bin/python)
# nanobind is needed at build time only. It is taken from the interpreter if
# it has it, else from NANOBIND_PATH, else pip-installed (--target) into the
# build folder, so no shared environment changes.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${1:-/work/main/.venv-test/bin/python}"
build="$here/build"
mkdir -p "$build"
if ! "$python" -c 'import nanobind' 2>/dev/null; then
  nbpath="${NANOBIND_PATH:-$build/nanobind-pkg}"
  if ! PYTHONPATH="$nbpath" "$python" -c 'import nanobind' 2>/dev/null; then
    python3 -m pip install --quiet --target "$nbpath" nanobind
  fi
  export PYTHONPATH="$nbpath${PYTHONPATH:+:$PYTHONPATH}"
fi
nb_dir="$("$python" -m nanobind --cmake_dir)"
"$python" -c 'import nanobind; print(nanobind.__version__)' >"$build/nanobind-version.txt"
cmake -S "$here" -B "$build/cmake" -DPython_EXECUTABLE="$python" -Dnanobind_DIR="$nb_dir" >/dev/null
cmake --build "$build/cmake" -j 2 >/dev/null
cp "$build"/cmake/_nullkv_native*.so "$build/"
echo "$build"

#!/usr/bin/env bash
# Builds llama.cpp's own C++ server (`llama-server`) from the llama.cpp that llama-cpp-python's
# source distribution vendors (the pip wheel ships no server binary), natively for this CPU, with
# cmake from the package index. Cached: a second call finds the binary and returns at once.
#
#   benches/peers/build_llama_server.sh VERSION OUT_DIR     # leaves OUT_DIR/llama-server
set -euo pipefail
VERSION=$1
OUT=$(realpath -m "$2")
BIN=$OUT/llama-server
STAMP=$OUT/llama-server.version
if [ -x "$BIN" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
mkdir -p "$OUT"
TOOLS=$OUT/build-venv
[ -x "$TOOLS/bin/pip" ] || python3 -m venv "$TOOLS"
command -v cmake >/dev/null && CMAKE=cmake || {
  "$TOOLS/bin/pip" install -q cmake
  CMAKE=$TOOLS/bin/cmake
}
SRC=$OUT/llama-cpp-python-$VERSION
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
  echo "== llama-server: the llama-cpp-python $VERSION source distribution"
  "$TOOLS/bin/pip" download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$OUT/sdist"
  tar xzf "$OUT/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$OUT" 2>/dev/null ||
    tar xzf "$OUT/sdist/llama-cpp-python-$VERSION.tar.gz" -C "$OUT"
  [ -d "$OUT/llama_cpp_python-$VERSION" ] && mv "$OUT/llama_cpp_python-$VERSION" "$SRC"
fi
[ -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ] || { echo "no vendored llama.cpp in $SRC" >&2; exit 1; }
echo "== llama-server: cmake build (native, ${PEERS_BUILD_JOBS:-2} jobs; several minutes)"
start=$(date +%s)
B=$OUT/llama-build
nice -n "${PEERS_BUILD_NICE:-10}" "$CMAKE" -S "$SRC/vendor/llama.cpp" -B "$B" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DBUILD_SHARED_LIBS=OFF > "$OUT/llama-server-cmake.log" 2>&1 ||
  { tail -20 "$OUT/llama-server-cmake.log" >&2; exit 1; }
nice -n "${PEERS_BUILD_NICE:-10}" "$CMAKE" --build "$B" --target llama-server -j "${PEERS_BUILD_JOBS:-2}" \
  >> "$OUT/llama-server-cmake.log" 2>&1 || { tail -30 "$OUT/llama-server-cmake.log" >&2; exit 1; }
cp "$B/bin/llama-server" "$BIN"
echo "$VERSION" > "$STAMP"
echo "== llama-server built in $(($(date +%s) - start)) s: $("$BIN" --version 2>&1 | grep -m1 -i version || true)"

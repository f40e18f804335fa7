#!/usr/bin/env bash
# Builds llama.cpp's own tools from the llama.cpp that the installed
# llama-cpp-python vendors (its sdist, from PyPI), so the tools and the binding
# run the same llama.cpp: llama-server (serving under load), llama-perplexity
# (its --kl-divergence is the peer quantlab's KL is checked against) and
# llama-bench (the peer of its TPOT). Installs them into PREFIX (default: the
# active Python's bin/, on PATH inside the venv). CPU only, native ISA. About
# 10 minutes on 2 cores; the three share one build of the library.
# One change to llama.cpp: llama-perplexity drains its log before it exits.
# Its logger is a thread that is never joined (llama.cpp leaks it on purpose),
# so on a busy host the process could exit before that thread had written the
# last chunk and the closing statistics (3 runs in 4 lost them with two other
# busy processes on 2 cores). The flush changes no number it prints.
# Callers key their cache on REVISION (printed by --revision): bump it with
# any change to what this script builds.
#   bash scripts/build_llama_tools.sh [PREFIX]
set -euo pipefail
REVISION=2
if [ "${1:-}" = "--revision" ]; then echo "$REVISION"; exit 0; fi
tools=(llama-server llama-perplexity llama-bench)
version=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
prefix=${1:-$(python -c "import os, sys; print(os.path.join(sys.prefix, 'bin'))")}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
ppl="$src/tools/perplexity/perplexity.cpp"
free='^    llama_backend_free();$'  # main's last call: the log is drained just before it
[ "$(grep -c "$free" "$ppl")" = 1 ] || { echo "perplexity.cpp: no single llama_backend_free() to flush the log before" >&2; exit 1; }
sed -i "s/$free/    common_log_pause(common_log_main());\n    llama_backend_free();/" "$ppl"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON >"$work/cmake.log"
cmake --build "$work/build" --target "${tools[@]}" -j"$(nproc)" >"$work/build.log"
mkdir -p "$prefix"
for t in "${tools[@]}"; do
  install -m 755 "$work/build/bin/$t" "$prefix/$t"
done
echo "${tools[*]} (llama-cpp-python $version's llama.cpp) -> $prefix"

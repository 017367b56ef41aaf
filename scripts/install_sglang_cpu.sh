#!/usr/bin/env bash
# Install the two pinned SGLang versions for the CPU tests of the specctl plugin.
#
# Each version goes, without its dependencies, into .sglang/<version> (git-ignored);
# the tests put one at a time on PYTHONPATH. SGLang's package import then needs only
# these small packages in the active environment (torch, numpy, pyzmq, pillow,
# packaging and tqdm come with the project). triton (1 GB) and torchvision are not
# installed: nothing the tests import uses them, and the tests put empty stand-ins
# on the path instead (sglang_hooks/testing.py:write_import_stand_ins).
#
# Usage: scripts/install_sglang_cpu.sh   (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}

"$python" -m pip install -q orjson psutil pybase64 requests starlette msgspec pydantic \
    ipython aiohttp
for version in 0.5.15.post1 0.5.23; do
    if [ ! -d ".sglang/$version/sglang" ]; then
        "$python" -m pip install -q --no-deps --no-compile --target ".sglang/$version" "sglang==$version"
    fi
done
echo "SGLang for the CPU tests: $(ls -d .sglang/*/sglang | tr '\n' ' ')"

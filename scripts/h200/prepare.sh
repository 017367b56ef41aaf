#!/usr/bin/env bash
# Prepare everything an H200 run of specctl needs, from the package registry, into .h200/
# (git-ignored), so it can be carried to the GPU machine (which reaches no registry):
#
#   .h200/whl-1 ... whl-N     the pinned SGLang 0.5.15.post1 wheels for Python 3.12 (list:
#                             wheels.txt, from shared/tools/sglang-h200/RECIPE.md), with
#                             sglang-kernel trimmed to 16 MiB, plus specctl's own needs and a
#                             wheel of this project (sglang_specctl-*.whl); split into as few
#                             parts as let each travel with the working tree under the 64 MiB
#                             limit of one call (the tree's size is measured, so N grows with
#                             it: 4 at 35 MB of tracked files)
#   .h200/models/{target,draft}  config-only model folders (Llama-3.1-8B shape, EAGLE-3 head)
#   .h200/models_moe          the MoE's (copied from ../shared/measured/, where present)
#   .h200/site/sitecustomize.py  a stand-in for SGLang's DSA attention backend module, whose
#                             imports (cutlass, deep_gemm) are not available there, and the
#                             hook of the compile diagnostic (SPECCTL_COMPILE_LOG)
#
# Usage: scripts/h200/prepare.sh   (then see docs/H200.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python}
out=.h200
rm -rf "$out" && mkdir -p "$out/all" "$out/site" "$out/models"

platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
    platforms+=(--platform "$p")
done
# shellcheck disable=SC2046
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$out/all" \
    $(grep -v '^#' scripts/h200/wheels.txt) \
    hydra-core==1.3.2 omegaconf==2.3.0 gymnasium==1.2.2 farama-notifications==0.0.4 \
    threadpoolctl==3.8.0
# omegaconf's parser runtime exists only as a source distribution: build its pure wheel.
"$python" -m pip wheel -q --no-deps -w "$out/all" antlr4-python3-runtime==4.9.3
# The FA3 / FlashMLA / SM100 kernels are 570 MiB; the run uses the triton backend.
zip -q -d "$out"/all/sglang_kernel-*.whl 'sgl_kernel/flash_ops.abi3.so' \
    'sgl_kernel/flashmla_ops.abi3.so' 'sgl_kernel/sm100/*'
"$python" -m pip wheel -q --no-deps -w "$out/all" .

# The working tree travels with every call; what is left of the 64 MiB carries wheels.
# The results (docs/results/, 71 MB on 5 December, half of it recorded traces) are set
# aside for every call that carries a part (docs/H200.md): the machine reads none of them.
tree_bytes=$(git ls-files -z | grep -zv '^docs/results/' \
    | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
"$python" - "$out" "$tree_bytes" <<'PY'
import shutil, sys
from pathlib import Path
out, tree = Path(sys.argv[1]), int(sys.argv[2])
budget = 60 * 2**20 - tree  # 4 MiB of margin under the limit for untracked files
wheels = sorted((out / "all").glob("*.whl"), key=lambda p: -p.stat().st_size)
if wheels[0].stat().st_size > budget:
    sys.exit(f"prepare.sh: {wheels[0].name} ({wheels[0].stat().st_size / 2**20:.1f} MiB) does "
             f"not fit beside the working tree ({tree / 2**20:.1f} MiB) in one 64 MiB call")
parts: list[list[Path]] = []
sizes: list[int] = []
for wheel in wheels:  # first fit, largest first
    size = wheel.stat().st_size
    slot = next((i for i, used in enumerate(sizes) if used + size <= budget), None)
    if slot is None:
        parts.append([]), sizes.append(0)
        slot = len(parts) - 1
    parts[slot].append(wheel)
    sizes[slot] += size
for i, (part, size) in enumerate(zip(parts, sizes), start=1):
    folder = out / f"whl-{i}"
    folder.mkdir()
    for wheel in part:
        shutil.move(str(wheel), folder / wheel.name)
    print(f"whl-{i}: {size / 2**20:.1f} MiB")
(out / "all").rmdir()
PY

cat > "$out/site/sitecustomize.py" <<'PY'
# Loaded at start-up by every Python process with this folder on PYTHONPATH (the SGLang
# server's children too). EAGLEWorkerV2 imports the DSA backend only for an isinstance
# check; the real module needs cutlass and deep_gemm, which this machine lacks.
import sys
import types

_name = "sglang.srt.layers.attention.dsa_backend"
if _name not in sys.modules:
    _module = types.ModuleType(_name)
    _module.DeepseekSparseAttnBackend = type("DeepseekSparseAttnBackend", (), {})
    sys.modules[_name] = _module

# The compile diagnostic (scripts/h200/compile_log.py), only where asked for.
import os

if os.environ.get("SPECCTL_COMPILE_LOG"):
    try:
        from scripts.h200.compile_log import install

        install(os.environ["SPECCTL_COMPILE_LOG"])
    except Exception as error:  # a diagnostic must not stop the server
        print(f"sitecustomize: compile log not installed: {error!r}", file=sys.stderr)
PY

mkdir -p "$out/models/target" "$out/models/draft"
cat > "$out/models/target/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "hidden_act": "silu",
 "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
 "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
 "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": false,
 "torch_dtype": "bfloat16"}
JSON
cat > "$out/models/draft/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
 "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32,
 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "draft_vocab_size": 32000,
 "target_hidden_size": 4096, "hidden_act": "silu", "max_position_embeddings": 131072,
 "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "bos_token_id": 128000,
 "eos_token_id": 128001, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}
JSON
# The MoE (Qwen3-30B-A3B shape) of the off-switch runs, where the shared data has it.
moe=../shared/measured/h200-sglang-0.5.15-offswitch/models_moe
if [ -d "$moe" ]; then cp -r "$moe" "$out/models_moe"; fi
du -sh "$out"/*

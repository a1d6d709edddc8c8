#!/usr/bin/env bash
# One device call, in the order a GPU session should spend its minutes (the device tool gives
# a session about 15 minutes in all, 10 a call):
#   decode issue 57's figures: benchmarks/gpu_decode.py, troupe's decode step captured as CUDA
#          graphs against its eager engine and transformers (SmolLM2 and Llama-3.2-1B shapes,
#          random weights, bf16, batch 1, 8 and 64; not yet run on a device: budget ~4 min);
#   gpu    `pytest -m gpu` over the files that hold GPU tests (~3 min on an H100);
#   async  issue 33's open figure: one-step-off against synchronous GRPO on the machine's CPU
#          cores (16 on the lent machines; SmolLM2's shape with random weights; ~5 min).
# Run from the repository root with .devkit/ carried (bash benchmarks/device/kit.sh builds
# it): `bash benchmarks/device/session.sh [decode] [gpu] [async]`, all by default. Logs and JSON lines
# go to $OUT (the device tool brings them back).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/troupe-device}
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
STAGES=${*:-decode gpu async}

if [ ! -d /tmp/site/ray ]; then  # a warm machine keeps /tmp between calls
  mkdir -p /tmp/site && tar -xJf .devkit/kit.tar.xz -C /tmp/site || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
echo "kit ready at $(elapsed) s"
python3 -c "import ray, torch, cupy, transformers; print('ray', ray.__version__, 'torch', \
torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
grep -o -w -E "avx512f|avx512_vnni|amx_int8|amx_bf16|avx512_bf16" /proc/cpuinfo | sort -u | xargs

case " $STAGES " in *" decode "*)
  echo "=== benchmarks/gpu_decode.py"
  timeout 300 python3 benchmarks/gpu_decode.py --out "$OUT" 2>&1 | tail -40
  echo "=== decode done at $(elapsed) s";;
esac

case " $STAGES " in *" gpu "*)
  echo "=== pytest -m gpu"
  FILES=$(grep -rl "pytest.mark.gpu" tests --include=*.py | sort)
  timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -ra --durations=15 $FILES 2>&1 \
    | tee "$OUT/gpu.log" | tail -60
  echo "=== gpu done at $(elapsed) s";;
esac

case " $STAGES " in *" async "*)
  python3 - <<'PY'
import shutil
from pathlib import Path

import torch
import transformers

src, dst = Path(".devkit/smol"), Path("/tmp/smol")
if not (dst / "model.safetensors").exists():
    config = transformers.AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, dst / f.name)
print("SmolLM2's shape, random weights, in", dst)
PY
  CORES=$(nproc)
  echo "=== async_rl on $CORES cores (device=cpu), at $(elapsed) s"
  timeout 480 python3 benchmarks/async_rl.py --model /tmp/smol --cores "$CORES" --seeds 1 \
      --steps 10 --eval-examples 8 --runs "sync-${CORES}t" "sync-$((CORES / 2))t" one-step-off \
      --out "$OUT/async_rl.jsonl" 2>&1 | tail -8 | cut -c1-1500
  echo "=== async done at $(elapsed) s";;
esac

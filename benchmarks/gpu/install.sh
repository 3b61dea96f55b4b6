#!/usr/bin/env bash
# Run on the GPU machine (no network), from the repository root that the device tool copied there, with .whl/
# carried: installs the wheels of fetch_wheels.sh into python3's own environment with --no-deps (so the `deepspeed`
# launcher lands beside python3, where tests/launch.py and the benchmarks look for it), then prints the versions,
# the CUDA build and the GPU and driver. Idempotent: a second call in the same machine installs nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if ! python3 -c "import deepspeed, pydantic, hjson, pytorch_optimizer" 2>/dev/null || [ "$(python3 -c 'import transformers; print(transformers.__version__)')" != 5.23.0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$ROOT"/.whl/*.whl
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 - <<'PY'
import deepspeed, pydantic, torch, transformers
print(f"python3 {__import__('sys').version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}), {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; deepspeed {deepspeed.__version__}, "
      f"pydantic {pydantic.__version__}, transformers {transformers.__version__}")
PY

#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script: the CUDA tests (the fused update's parity with
# the eager reference and across chunk sizes, the hybrid on CUDA against the CPU), then micro.py
# and compare.py on the GPU. It imports the packages from their src/ folders (PYTHONPATH), so it
# runs on a machine with a CUDA build of torch and no package index. Each part has its own time
# limit, so one that hangs does not take the others' time; OUT (default cuda-out/) receives
# log.txt and the JSON results.
#
#     OUT=cuda-out bash benchmarks/cuda_check.sh
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-cuda-out}"
mkdir -p "$out/micro" "$out/compare"
out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(printf "$root/packages/%s/src:" gefen-contracts gefen-dist gefen-core gefen-muon gefen-hybrid)"
python="${PYTHON:-python3}"
log="$out/log.txt"

part() {  # part SECONDS TITLE COMMAND...: run one part under its own deadline
    local seconds="$1" title="$2"
    shift 2
    echo "== $title (limit ${seconds}s)" | tee -a "$log"
    local begin=$SECONDS
    timeout --kill-after=10 "$seconds" "$@" >>"$log" 2>&1
    echo "== $title: exit $? after $((SECONDS - begin))s" | tee -a "$log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$log" 2>&1
"$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" >>"$log" 2>&1
cd "$root" || exit 1
part "${TESTS_S:-240}" "CUDA tests" "$python" -m pytest -q -p no:cacheprovider -rA \
    packages/gefen-core/tests/test_core_fused_parity.py \
    packages/gefen-core/tests/test_core_fused_chunks.py \
    packages/gefen-core/tests/test_core_amp_atomicity.py \
    packages/gefen-hybrid/tests/test_hybrid_cuda.py -k "cuda"
cd "$root/benchmarks" || exit 1
part "${MICRO_S:-150}" "micro.py on cuda" "$python" micro.py --device cuda --skip-codebook \
    --optimizers adamw,gefen,muon,gefen_muon_gefen --sizes 16M,4x4096 --out "$out/micro"
part "${COMPARE_S:-150}" "compare.py on cuda" "$python" compare.py --device cuda --threads 4 \
    --optimizers adamw,gefen,gefen_eager,muon,gefen_muon_gefen --out "$out/compare"

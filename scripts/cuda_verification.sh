#!/usr/bin/env bash
# The CUDA verification run behind the README's GPU figures, on one GPU (several ranks share it
# through gloo with host staging). Run from the repository root on a CUDA machine:
#     OUT=cuda-out bash scripts/cuda_verification.sh
# Optional wheels in .whl/ (sageattention, yunchang) are installed to a temp dir first.
# Everything lands in $OUT/cuda.tgz (re-packed after each step, so a cut-short run keeps what it did).
set -uo pipefail
OUT=${OUT:-cuda-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/parity-site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/parity-site
fi
W=$(mktemp -d)
P="python3 -m harness.cli"
pack() { tar czf "$OUT/cuda.tgz" -C "$W" . ; }
step() { local name=$1; shift; local t=$SECONDS; "$@" >"$W/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t))s" | tee -a "$W/steps.txt"; pack; }

cp -r baselines "$W/baselines"      # recalibration writes the overlays here
$P doctor --json "$W/doctor.json" 2>&1
nvidia-smi >"$W/nvidia-smi.txt" 2>&1
for i in 1 2 3; do
  step "gate$i" $P gate --device cuda --perf --baselines "$W/baselines" --report "$W/gate$i"
done
step recal_thresholds $P recalibrate thresholds --baselines "$W/baselines" --results "$W"/gate?/results.json --per-platform --write
step recal_perf $P recalibrate perf --baselines "$W/baselines" --results "$W"/gate?/results.json --write
step sweep_shapes $P sweep --device cuda --cases cases/sweeps --dtypes bf16 fp16 fp32 --json "$W/sweep_shapes.json"
step matrix_shapes $P matrix "$W/sweep_shapes.json" -o "$W/matrix_shapes.md"
step usp_overhead python3 benchmarks/usp_overhead.py --device cuda
step sweep_default $P sweep --device cuda --no-kernels --dtypes bf16 fp32 \
  --contracts usp.replicated_suffix_bitwise usp.ulysses_parity usp.ring_parity model.zimage_sp_parity model.hunyuan_sp_parity \
  --json "$W/sweep_default.json"
step matrix $P matrix "$W/sweep_shapes.json" "$W/sweep_default.json" -o "$W/matrix.md"
cat "$W/steps.txt"

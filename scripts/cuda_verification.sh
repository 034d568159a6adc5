#!/usr/bin/env bash
# The CUDA verification runs behind the README's GPU figures, on one GPU (several ranks share it
# through gloo with host staging). Run from the repository root on a CUDA machine:
#     OUT=cuda-out bash scripts/cuda_verification.sh PHASE...
# Phases:
#   ab         the perf A/B acceptance (scripts/perf_ab_acceptance.py): $AB_COPIES (default 10) independent
#              A/Bs per pipeline with BASE = HEAD, and with every denoising step 10 % slower, for the
#              built-in pipeline (zimage_t2i_1rank, zimage_t2i_2ranks) and a command pipeline
#   thresholds 3 gates (images only) and a per-platform threshold recalibration: the new
#              baselines/platforms/<gpu>.json, for when the image references were re-blessed
#   tests      pytest tests/gpu (kernels by the FA rule, LSE paths, SP with ranks sharing the GPU)
#   reference  the default contract cases on the reference, on CUDA
#   targets    the contract cases on --target diffusers and --target sglang on CUDA
#   gate       the whole gate on CUDA with the shipped cases and baselines (results, JUnit, HTML report)
#   production the production suite's Z-Image 1024² forward and gradient cases and HunyuanVideo 720p × 129
#              frames at W = 2, then that video case with planted defects (rank_order, scaled_rank: both must
#              fail), and the Z-Image gradient with each SDPA kernel pinned (which ones are deterministic)
#   scale      benchmarks/oracle_scale.py --device cuda: contract cost beside the kernel's, 4.6k to 119k tokens
#   suite      the production suite's cases named in $SUITE_IDS (default: all of it)
#   planted_grads  every gradient case with each backward bug of tests/targets/planted_grad_bugs.py (must fail)
#   fa         with flash-attn installed (../shared/tools/flash-attn-wheels, then `source /tmp/fa4.env`): doctor,
#              tests/gpu/test_flash_attn_cuda.py (the kernel against float64), every default contract case with
#              --backend fa, the gradient cases again with --deterministic
#   fa_scale   the production suite's $FA_IDS with --backend fa, with and without --deterministic, and
#              benchmarks/fa_kernels.py (FA against SDPA flash and cuDNN at production shapes)
# Wheels in .whl/ (diffusers, sglang and what its import needs) are installed to a temp dir first;
# sglang's top-level __init__ is replaced as scripts/sglang_cpu/README.md describes.
# Everything lands in $OUT/cuda.tgz (re-packed after each step, so a cut-short run keeps what it did).
set -uo pipefail
OUT=${OUT:-cuda-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PARITY_HOME=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/parity-site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/parity-site
  site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  printf "import sys; sys.path.insert(0, '%s/scripts/sglang_cpu/boot'); import parity_sglang_cpu\n" "$PWD" >"$site/zz-parity-sglang.pth"
fi
W=$(mktemp -d)
P="python3 -m harness.cli"
pack() { tar czf "$OUT/cuda.tgz" -C "$W" . ; }
step() { local name=$1; shift; local t=$SECONDS; "$@" >"$W/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t))s" | tee -a "$W/steps.txt"; pack; }

nvidia-smi --query-gpu=name,uuid,driver_version,clocks.max.sm --format=csv >"$W/gpu.txt" 2>&1
hostname >>"$W/gpu.txt"; nproc >>"$W/gpu.txt"; grep -m1 "model name" /proc/cpuinfo >>"$W/gpu.txt"
for phase in "$@"; do
  case $phase in
    ab)
      step perf_ab python3 scripts/perf_ab_acceptance.py --device cuda --copies "${AB_COPIES:-10}" --out "$W/ab"
      rm -rf "$W"/ab/builtin "$W"/ab/command; pack ;;
    thresholds)
      cp -r baselines "$W/baselines"
      for i in 1 2 3; do step "images$i" $P gate --device cuda --no-perf --baselines "$W/baselines" --report "$W/images$i"; done
      step recal_thresholds $P recalibrate thresholds --baselines "$W/baselines" --results "$W"/images?/results.json --per-platform --write
      rm -rf "$W"/images?/candidates "$W"/images?/triptychs; pack ;;
    tests)
      step gpu_tests python3 -m pytest tests/gpu -q -s -p no:cacheprovider ;;
    reference)
      step reference $P check --device cuda --json "$W/reference.json" ;;
    targets)
      for t in diffusers sglang; do step "target_$t" $P check --device cuda --target $t --json "$W/target_$t.json"; done ;;
    gate)
      step gate $P gate --device cuda --report "$W/gate"
      rm -rf "$W"/gate/candidates "$W"/gate/triptychs; pack ;;
    production)
      step production $P check --suite production --device cuda zimage_1024_w2 zimage_1024_grad_w2 hunyuan_720p_w2 \
        --json "$W/production.json"
      for defect in rank_order scaled_rank; do
        step "planted_$defect" $P check --suite production --device cuda hunyuan_720p_w2 --allow-new-skips \
          --target tests.targets.planted_sp:factory --target-arg defect=$defect --json "$W/planted_$defect.json"
      done
      for kernel in flash efficient cudnn; do
        step "zimage_grad_$kernel" $P check --suite production --device cuda zimage_1024_grad_w2 --sdpa-kernel $kernel \
          --json "$W/zimage_grad_$kernel.json"
      done ;;
    suite)
      step suite $P check --suite production --device cuda ${SUITE_IDS:-} --json "$W/suite.json" ;;
    planted_grads)
      for bug in ring_detached ring_same_direction ulysses_averaged; do
        step "grad_$bug" $P check 'usp.*_grad' --device cuda --allow-new-skips --target tests.targets.planted_grad_bugs:factory \
          --target-arg bug=$bug --json "$W/grad_$bug.json"
      done ;;
    fa)
      step fa_doctor $P doctor --json "$W/fa_doctor.json"
      step fa_kernel_tests python3 -m pytest tests/gpu/test_flash_attn_cuda.py -q -s -p no:cacheprovider -rs
      step fa_check $P check --device cuda --backend fa --json "$W/fa_check.json"
      step fa_grad_deterministic $P check 'usp.*_grad' --device cuda --backend fa --deterministic \
        --json "$W/fa_grad_deterministic.json" ;;
    fa_scale)
      ids=${FA_IDS:-zimage_1024_w2 zimage_1024_grad_w2 wan14b_480p_ring_w2 hunyuan_720p_w2}
      step fa_production $P check --suite production --device cuda --backend fa $ids --json "$W/fa_production.json"
      step fa_production_deterministic $P check --suite production --device cuda --backend fa --deterministic \
        zimage_1024_grad_w2 --json "$W/fa_production_deterministic.json"
      step fa_bench python3 benchmarks/fa_kernels.py --json "$W/fa_bench.json" ;;
    scale)
      step scale python3 benchmarks/oracle_scale.py --device cuda --grad-max "${GRAD_MAX:-65536}" --json "$W/scale.json" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
cat "$W/steps.txt"

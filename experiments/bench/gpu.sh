#!/usr/bin/env bash
# Everything GPU-specific in one run, about 10 minutes in all (each part has its own time limit, so one that hangs
# or fails leaves the others' results):
#   1. the Pallas kernel tests compiled for the GPU (JAX_PLATFORMS=cuda, so interpret=False) against their XLA
#      references, the full matrix (the cases marked slow as well; the CPU suite interprets representative cases
#      only): unified attention, split-KV decode, quantise-and-write, every format at head dims 64-256, and the
#      NaN/Inf-poisoned pools that must give bit-identical outputs. Their tolerances are float32's, so they run
#      with JAX_DEFAULT_MATMUL_PRECISION=highest (IEEE products in the kernel and in XLA; by default both take
#      TF32 on a GPU, about 1e-3 relative for the bf16 and fp8 formats' queries);
#   2. `experiments.bench.decode`, 1K-262K tokens, every KV format, with the Pallas split-KV kernel timed beside
#      the XLA paths and the decode goal at 128K checked (fp4 >= 2.5x faster than bf16, >= 60% of the copy bandwidth; docs/kvcache.md);
#   3. `experiments.bench.quant`: train step per 4-bit recipe against BF16.
#
# What it needs: a machine with a CUDA GPU (written for one H200) and Python 3.12 with jax[cuda] 0.11, flax, optax,
# chex, orbax-checkpoint, numpy and pytest preinstalled, and a copy of this repository's working tree (it runs
# from there; nothing is installed into the machine's Python). Every other package the three parts import that
# the machine lacks (ml-collections, for one) must be present as a wheel in `.whl/` at the repository root
# (git-ignored); the script installs those wheels, without a network, into /tmp/site. Fetching one elsewhere:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       -d .whl ml-collections==1.1.0
# Run it as `bash experiments/bench/gpu.sh` from anywhere. Results land in $OUT if set, else results/gpu: gpu.log,
# decode.{json,md,png}, quant.{json,md}.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-results/gpu}"
mkdir -p "$out"
log="$out/gpu.log"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu.sh: installing the carried wheels failed" | tee -a "$log"; exit 1; }
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...: run one part under a time limit, its output appended to the log
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$log"
}

part environment 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import jax; print(jax.__version__, jax.devices())"'
part kernel-tests 200 env JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest \
  python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_kvcache_attention.py
part decode-bench 240 python3 -m experiments.bench.decode --out "$out" --formats bf16,fp8,fp4,nvfp4,k8v4
part quant-bench 120 python3 -m experiments.bench.quant --out "$out"

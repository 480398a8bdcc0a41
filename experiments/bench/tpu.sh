#!/usr/bin/env bash
# The TPU campaign: everything TPU-specific in one run of at most 10 minutes wall (the parts' limits add up to 580 s;
# each part has its own, so one that hangs or fails leaves the others' results):
#   1. environment (15 s): the TPU's kind and count, Python, jax and its devices -> environment.json;
#   2. kernel-tests (150 s): the Mosaic TPU paged-attention kernels (kvcache.kernels.tpu_attention) compiled for the
#      TPU (JAX_PLATFORMS=tpu) against the XLA reference, the full matrix of tests/test_kvcache_tpu.py (the cases
#      marked slow as well; the CPU suite interprets representative cases only). Their tolerances are float32's, so
#      they run with JAX_DEFAULT_MATMUL_PRECISION=highest (float32 products in the kernel and in XLA; by default the
#      TPU multiplies float32 in one bfloat16 pass) -> kernel_tests.xml;
#   3. decode-bench (160 s): `experiments.bench.decode`, 1K-262K tokens, every KV format, the XLA paths with and
#      without split-KV, fp4 against bf16 at 128K -> decode.{json,md,png};
#   4. quant-bench (90 s): `experiments.bench.quant`, the train step per 4-bit recipe against BF16 -> quant.{json,md};
#   5. recipe-question (165 s): `experiments.reproduce.ufp4_scale`, bf16, nvfp4, ufp4 and mxfp4 each training the
#      113M-parameter decoder for the token budget that fits 2.3 minutes, seeds 0 and 1 where they fit
#      -> ufp4_scale.{json,md,png}.
# Then campaign.json and campaign.md: each part's exit status, seconds and limit, and the kernel tests' counts; the
# script exits 1 if a part failed or ran out of time.
#
# What it needs: a TPU VM (one host; written for a v5e or v6e chip with 16 GB or more of HBM, which the 113M model's
# states and one run's activations fit) and Python 3.12 with jax[tpu] 0.11 (jax, jaxlib and the matching libtpu),
# flax, optax, chex, orbax-checkpoint, numpy, matplotlib and pytest preinstalled, and a copy of this repository's
# working tree (it runs from there; nothing is installed into the machine's Python). Every other package the parts
# import that the machine lacks (ml-collections, for one) must be present as a wheel in `.whl/` at the repository
# root (git-ignored); the script installs those wheels, without a network, into `.whl/site`. Fetching one elsewhere:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       -d .whl ml-collections==1.1.0
# Run it as `bash experiments/bench/tpu.sh` from anywhere. Results land in $OUT if set, else results/tpu, with the
# log of every part in campaign.log. PYTHON names the interpreter (default python3).
#
# Dry run: CAMPAIGN_DRY_RUN=1 runs the same parts on the CPU at tiny sizes, each under 10 times its limit
# (JAX_PLATFORMS=cpu, no TPU query, the kernel tests reduced to one case, run in TPU interpret mode, decode at 64 and
# 256 tokens for bf16 and fp4, one timed round per benchmark, ufp4_scale --tiny with two recipes): what
# tests/test_campaign.py runs to keep this script working. CAMPAIGN_PARTS (comma-separated part names, default all)
# runs some parts only.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-results/tpu}"
py="${PYTHON:-python3}"
dry="${CAMPAIGN_DRY_RUN:-0}"
mkdir -p "$out"
log="$out/campaign.log"
: >"$log"
: >"$out/parts.tsv"
rm -f "$out/kernel_tests.xml"  # a report of an earlier run is not this one's
if [ "$dry" = 1 ]; then
  export JAX_PLATFORMS=cpu
elif compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl/site .whl/*.whl \
    || { echo "tpu.sh: installing the carried wheels failed" | tee -a "$log"; exit 1; }
  export PYTHONPATH="$PWD/.whl/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...: one part under its time limit, its output appended to the log
  local name=$1 limit=$2 start=$SECONDS code
  shift 2
  [[ ",${CAMPAIGN_PARTS:-$name}," == *",$name,"* ]] || return 0
  [ "$dry" = 1 ] && limit=$((10 * limit))  # the CPU, not the device: the limits guard a device's time
  echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  code=${PIPESTATUS[0]}
  echo "=== $name: exit $code after $((SECONDS - start))s" | tee -a "$log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - start))" "$limit" >>"$out/parts.tsv"
}

environment() {  # the accelerator and the Python stack -> environment.json
  DRY="$dry" "$py" - "$out/environment.json" <<'EOF'
import json, os, platform, sys
import jax
dry = os.environ["DRY"] == "1"
kind = "dry run: no TPU queried" if dry else f"{len(jax.devices())} x {jax.devices()[0].device_kind}"
info = {"accelerator": kind, "python": platform.python_version(), "jax": jax.__version__,
        "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
        "dry_run": os.environ["DRY"] == "1"}
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
EOF
}

kernel_tests() {  # kernel_tests FILE DRY_CASE: the full matrix (dry run: the first case matching DRY_CASE)
  local select=(-m "slow or not slow" "$1")
  if [ "$dry" = 1 ]; then
    select=("$("$py" -m pytest -q -p no:cacheprovider --collect-only -m "not slow" -k "$2" "$1" | head -1)")
  fi
  "$py" -m pytest -q -p no:cacheprovider --junitxml="$out/kernel_tests.xml" "${select[@]}"
}

if [ "$dry" = 1 ]; then
  decode=(--contexts 64,256 --formats bf16,fp4 --repeats 1)
  quant=(--repeats 1)
  recipe=(--tiny --steps 6 --seeds 0 --recipes bf16,ufp4)
  platform=cpu
else
  decode=(--formats bf16,fp8,fp4,nvfp4,k8v4 --repeats 3)
  quant=(--repeats 3)
  recipe=(--minutes 2.3 --seeds 0,1)
  platform=tpu
fi

export py out dry
export -f environment kernel_tests
part environment 15 bash -c environment
part kernel-tests 150 env JAX_PLATFORMS=$platform JAX_DEFAULT_MATMUL_PRECISION=highest \
  bash -c 'kernel_tests "$@"' _ tests/test_kvcache_tpu.py decode_matches_reference
part decode-bench 160 "$py" -m experiments.bench.decode --out "$out" "${decode[@]}"
part quant-bench 90 "$py" -m experiments.bench.quant --out "$out" "${quant[@]}"
part recipe-question 165 "$py" -m experiments.reproduce.ufp4_scale --out "$out" "${recipe[@]}"

"$py" - "$out" tpu <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET
out, campaign = sys.argv[1], sys.argv[2]
parts = []
for line in open(os.path.join(out, "parts.tsv")):
    name, code, seconds, limit = line.rstrip("\n").split("\t")
    parts.append({"part": name, "exit": int(code), "seconds": int(seconds), "limit_seconds": int(limit)})
tests = None
if os.path.exists(os.path.join(out, "kernel_tests.xml")):
    suite = ET.parse(os.path.join(out, "kernel_tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
record = {"campaign": campaign, "dry_run": os.environ.get("CAMPAIGN_DRY_RUN") == "1", "parts": parts,
          "kernel_tests": tests}
json.dump(record, open(os.path.join(out, "campaign.json"), "w"), indent=2)
rows = [f"| {p['part']} | {p['exit']} | {p['seconds']} | {p['limit_seconds']} |" for p in parts]
kt = "" if tests is None else ", ".join(f"{k} {v}" for k, v in tests.items())
text = [f"# The {campaign} campaign" + (" (dry run on the CPU)" if record["dry_run"] else ""), "",
        "| part | exit | seconds | limit |", "|---|---|---|---|", *rows, "", f"Kernel tests: {kt or 'no report'}."]
open(os.path.join(out, "campaign.md"), "w").write("\n".join(text) + "\n")
print("\n".join(text))
sys.exit(1 if any(p["exit"] for p in parts) else 0)
EOF
status=$?  # 1 when a part failed or ran out of time
rm -f "$out/parts.tsv"
exit $status

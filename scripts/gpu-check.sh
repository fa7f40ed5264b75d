#!/usr/bin/env bash
# The device check, on a GPU machine with no TVM: run a bundle made here by
#     fuseguard device-bundle --gpu-arch sm_90 --out .gpucheck [--mode smoke]
# then, on the device (the bundle carried beside the working tree):
#     bash scripts/gpu-check.sh .gpucheck [smoke|full] [SUMMARY.json]
# Installs the bundled tvm-ffi wheel into a private folder (no network needed), then runs
# verify/device/check.py: fused and unfused builds against the expected outputs, timed; attention against
# PyTorch's SDPA. Exit 0 when everything passed.
set -euo pipefail
bundle=${1:?usage: gpu-check.sh BUNDLE [smoke|full] [SUMMARY.json]}
mode=${2:-smoke}
summary=${3:-${OUT:-.}/devicecheck.json}
site=$(mktemp -d /tmp/fuseguard-site.XXXXXX)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$bundle"/runtime/apache_tvm_ffi-*.whl
cd "$(dirname "$0")/.."
# fuseguard is not installed there: its folders under the one import name they install as (fuseguard.*)
mkdir -p "$site/fuseguard"
for pkg in compiler verify suites; do ln -sfn "$PWD/$pkg" "$site/fuseguard/$pkg"; done
PYTHONUNBUFFERED=1 PYTHONPATH="$site" python3 -m fuseguard.verify.devicecheck "$bundle" --mode "$mode" --json "$summary"

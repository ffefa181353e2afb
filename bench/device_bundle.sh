#!/bin/bash
# Packs what the lent GPU machine lacks (it has no package registry) into one file that fits a
# device call's 64 MiB: .whl/slim/slim.tar.xz (~40 MB) holding site/ (nvidia-pytriton 0.7.0 less
# its libpython 3.13 and other Pythons' stubs, tritonclient 2.73.0, python-rapidjson 1.25),
# np/ (numpy 1.26.4 for the stub: tritonserver 2.51's stub breaks on TYPE_STRING tensors under
# numpy 2) and tools/ (py-spy); site/ also holds compressed-tensors 0.20.0 and what it needs (the
# FP8 checkpoints' reference in transformers) and xgrammar 0.2.9 (structured outputs). For the
# device's Python 3.12. Run here, once; `.whl/` is ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
dl() { "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux1_x86_64 -d "$1" "${@:2}"; }
tmp=$(mktemp -d)
dl "$tmp/w" nvidia-pytriton==0.7.0 tritonclient==2.73.0 python-rapidjson==1.25 ml-dtypes==0.5.4
dl "$tmp/w" xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
dl "$tmp/w" compressed-tensors==0.20.0 loguru==0.7.3 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated_types==0.8.0 typing_inspection==0.4.5 typing_extensions==4.16.0 psutil==7.2.2
dl "$tmp/np" numpy==1.26.4
dl "$tmp/tools" py-spy==0.4.3
mkdir -p "$tmp/b/site" "$tmp/b/np" "$tmp/b/tools/bin"
for w in "$tmp"/w/*.whl; do unzip -q -o "$w" -d "$tmp/b/site"; done
unzip -q -o "$tmp"/np/*.whl -d "$tmp/b/np"
unzip -q -o "$tmp"/tools/*.whl -d "$tmp/t" && cp "$tmp"/t/py_spy-*.data/scripts/py-spy "$tmp/b/tools/bin/"
rm -f "$tmp"/b/site/nvidia_pytriton.libs/libpython3-*.13.so.1.0
for v in 3.8 3.9 3.10 3.11 3.13; do rm -rf "$tmp/b/site/pytriton/tritonserver/python_backend_stubs/$v"; done
chmod +x "$tmp"/b/site/pytriton/tritonserver/bin/* "$tmp"/b/site/pytriton/tritonserver/python_backend_stubs/*/* \
  "$tmp"/b/tools/bin/py-spy
mkdir -p .whl/slim
tar -cJf .whl/slim/slim.tar.xz -C "$tmp/b" site np tools
rm -rf "$tmp"
ls -la .whl/slim/slim.tar.xz

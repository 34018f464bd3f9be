#!/bin/sh
# `nox -s gpu_integration` for a GPU machine with no package index, such as the workplace's lent one: the image's
# own python3 and torch (2.11 there, below the packages' 2.13: on 2.11 the client, worker and integration CPU tests
# of ops, redistributions, steps and collectives pass but for 3 placement choices its rules make differently), the
# DTorch packages of this tree on PYTHONPATH (nothing installed), and the wheels such an image lacks (msgspec,
# grpcio-health-checking, pytest-timeout for the tests' own bounds), fetched beforehand on a machine with an index
# into .whl/ (git ignores it; carry it). The Llama tests skip with one line where the image has no transformers:
#
#     integration/gpu_offline.sh --fetch          # here: wheels for CPython 3.12 on x86_64 Linux into .whl/
#     integration/gpu_offline.sh                  # there: the GPU tests, then bench_gpu.py; bounded (~10 minutes)
#
# grpcio-health-checking's generated code must suit the image's protobuf, so several releases are fetched and the
# newest one that imports is kept. Every step is bounded by `timeout`; the exit status is the tests'.
set -u
cd "$(dirname "$0")/.."
WHEELS=.whl
PY=${PYTHON:-python3}
HEALTH="1.85.1 1.71.0 1.66.2 1.62.3"

if [ "${1:-}" = "--fetch" ]; then
    set -e
    get() { "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
        --platform manylinux2014_x86_64 -d "$1" "$2"; }
    get "$WHEELS" msgspec
    get "$WHEELS" pytest-timeout
    for v in $HEALTH; do get "$WHEELS/health-$v" "grpcio-health-checking==$v"; done
    ls -R "$WHEELS"
    exit 0
fi

for module in msgspec pytest_timeout; do  # a wheel's file name spells its project as the module does
    if ! "$PY" -c "import $module" 2>/dev/null; then
        "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS/$module"-*.whl
    fi
done
for v in $HEALTH; do
    "$PY" -c "import grpc_health.v1.health" 2>/dev/null && break
    "$PY" -m pip install --quiet --no-index --no-deps --force-reinstall "$WHEELS/health-$v"/*.whl
done
PYTHONPATH=$(ls -d "$PWD"/packages/dtorch-*/src | grep -v dtorch-sim | paste -sd: -)
export PYTHONPATH
"$PY" -c "import torch, dtorch_protocol.health; print('torch', torch.__version__, 'sees', torch.cuda.device_count(), \
'CUDA device(s)')" || exit 1
timeout 480 "$PY" -m pytest -v -rs -p no:randomly -p no:cacheprovider -m gpu integration/test_gpu.py
status=$?
timeout 120 "$PY" benchmarks/bench_gpu.py --mib 64 256 --repeats 3
exit $status

#!/usr/bin/env bash
# Everything that needs a GPU, in two parts sized for a short lease. Results go to $OUT when set (a remote run),
# else a new folder benchmarks/results/gpu-<date-time> (speed: the files already in benchmarks/results, which the
# docs cite, are never replaced) and output/gpu_study (study).
#
#   bash benchmarks/run_gpu.sh speed         # ~5 min (its timeouts add up to 8 min 50 s, under a lease command's
#                                            #   10 min, so the archive is always written): CUDA tests (sync-free mixer and step), mixer (with a profile,
#                                            #   its parts with and without the captured draw, a torch.compile
#                                            #   case), patch head and --device-data benchmarks, JSON per benchmark;
#                                            #   on a lease all of them packed as $OUT/gpu_speed.tar.gz
#   EPOCHS=6 bash benchmarks/run_gpu.sh study  # the full-data Fashion-MNIST study, pipeline --budget gpu, 3 seeds,
#                                            #   JOBS (default 3) phases at once sharing the GPU (pipeline --jobs)
#
# Preparation on a machine with pip (the GPU machine reaches no registry):
#   mkdir -p data/fmnist && cp /usr/share/datasets/fashion-mnist/*.gz data/fmnist/   # data/ is git-ignored
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
#       deap==1.4.4 moocore==0.3.2 cffi==2.1.1 pycparser==3.12 platformdirs==4.14.8 timm==1.0.31
#   (deap 1.4.4 imports moocore, which needs cffi, pycparser and platformdirs; the GPU image has none of them)
#   echo /.whl/ >> .git/info/exclude
# and carry data/fmnist and .whl with the run.
set -u
PART=${1:-speed}
R=benchmarks/results/gpu-$(date +%Y%m%d-%H%M%S)
if [ -n "${OUT:-}" ] && [ "$PART" = speed ]; then
    # at most 8 files come back from a lease: every result goes into one archive, made however the script ends
    R=/tmp/gpu_speed
    trap 'tar czf "$OUT/gpu_speed.tar.gz" -C "$R" .' EXIT
fi
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
    export PYTHONPATH=$PWD
fi
if [ "$PART" = speed ]; then mkdir -p "$R"; fi
python3 -c "import torch, timm, deap; print('torch', torch.__version__, 'timm', timm.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
FM=${FMNIST:-data/fmnist}

if [ "$PART" = speed ]; then
    timeout -k 5 60 python3 -m pytest -q -rfE tests/test_cuda.py -p no:cacheprovider >"$R/cuda_tests.log" 2>&1
    tail -25 "$R/cuda_tests.log"
    # the collates also run in real DataLoaders (collate_loader); the JSON records the host's huge-page setting
    timeout -k 5 90 python3 benchmarks/bench_mix.py --device cuda --profile --json "$R/mix_cuda.json" 2>&1 \
        | tee "$R/mix_cuda.log"
    # the tensor mixer taken apart: host against device time per part, with and without the captured draw
    timeout -k 5 50 python3 benchmarks/bench_mix_cuda.py --json "$R/mix_cuda_parts.json"
    timeout -k 5 30 python3 benchmarks/bench_mix_host.py --device cuda --repeats 200 --json "$R/mix_host_cuda.json"
    timeout -k 5 90 python3 benchmarks/bench_models.py --device cuda --amp bf16 --channels-last --cifar-batch 128 \
        --imagenet-batch 128 --repeats 40 --import-repeats 1 --json "$R/models_cuda.json"
    # 11 repeats: the H100 run's 5 spread over about 20% in each case, as much as the effect it was to show
    timeout -k 5 70 python3 benchmarks/bench_device_data.py --device cuda --dataset fashion_mnist --data-dir "$FM" \
        --batch-size 512 --amp --channels-last -j 8 --repeats 11 --json "$R/device_data_cuda.json"
    # recompiles and graph breaks logged: the compiled device path ran slower than synthetic on the H100 (0.83);
    # on the CPU (embedded data, batch 64, with and without --amp --channels-last) the benchmark logs neither
    TORCH_LOGS=recompiles,graph_breaks timeout -k 5 80 python3 benchmarks/bench_device_data.py --device cuda \
        --dataset fashion_mnist --data-dir "$FM" --batch-size 512 --amp --channels-last --compile --skip-loader \
        --repeats 11 --json "$R/device_data_cuda_compile.json" 2>&1 | tee "$R/device_data_cuda_compile.log" | grep -v Warning
    # last, as it may take a while to compile: does torch.compile lift the host-bound tensor mixer?
    timeout -k 5 60 python3 benchmarks/bench_mix.py --device cuda --compile --skip-collate --json "$R/mix_cuda_compile.json"
elif [ "$PART" = study ]; then
    S=output/gpu_study
    EPOCHS=${EPOCHS:-6}
    start=$(date +%s)
    JOBS=${JOBS:-3}
    timeout ${STUDY_TIMEOUT:-480} python3 -m timm_patchmix.pipeline --budget gpu --dataset fashion_mnist \
        --data-dir "$FM" --model resnet32_cifar --seeds 0 1 2 --output "$S" --jobs "$JOBS" --train-args --epochs "$EPOCHS"
    echo "study wall time $(( $(date +%s) - start )) s, $EPOCHS epochs, $JOBS jobs"
    # at most 8 files come back from a lease: the report, and every run's CSVs and records in one archive
    mkdir -p "${OUT:-output}"
    D=$(cd "${OUT:-output}" && pwd)  # absolute: the archive is written from inside $S
    (cd "$S" && find . \( -name '*.csv' -o -name '*.json' -o -name '*.md' -o -name '*.yaml' -o -name '*.log' \) -print0 \
        | tar czf "$D/gpu_study_runs.tar.gz" --null -T -)
    for f in report.md report.json; do [ -f "$S/$f" ] && cp "$S/$f" "$D/gpu_study_$f"; done
    ls -la "$S" "$D"
else
    echo "usage: bash benchmarks/run_gpu.sh speed|study" >&2
    exit 2
fi

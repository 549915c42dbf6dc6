#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the CUDA-vs-CPU tests, the full paper-scale search (250 generations), and
# the mixer and model benchmarks on CUDA. JSON results go to $OUT when set (a remote run), else benchmarks/results.
#   bash benchmarks/run_gpu.sh [path/to/f_T.safetensors]
# f_T: a Random-PatchMix checkpoint, e.g. from `python train.py --patchmix --output output/bench --experiment ft-rpm`.
set -u
R=${OUT:-benchmarks/results}
CKPT=${1:-output/bench/ft-rpm/best.safetensors}
export PYTHONUNBUFFERED=1
mkdir -p "$R"
python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 120 python3 -m pytest -q tests/test_cuda.py -p no:cacheprovider 2>&1 | tail -15
timeout 330 python3 benchmarks/bench_search.py paper --checkpoint "$CKPT" --generations 250 --device cuda --amp \
    --channels-last --eval-batch-size 4096 --json "$R/search_paper_cuda.json"
timeout 60 python3 benchmarks/bench_mix.py --device cuda --json "$R/mix_cuda.json"
timeout 90 python3 benchmarks/bench_models.py --device cuda --repeats 15 --import-repeats 3 --json "$R/models_cuda.json"

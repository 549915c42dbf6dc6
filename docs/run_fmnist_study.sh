#!/usr/bin/env bash
# Base / Mixup / CutMix / Random PatchMix on Fashion-MNIST (Debian's dataset-fashion-mnist), ResNet-32, a short
# CPU budget: 8,000 training images, the first 2,000 of a fixed shuffle of the 10,000 test images, 8 epochs, the
# paper's optimiser settings (--recipe paper-cifar: SGD Nesterov 0.9, lr 0.1, wd 5e-4, cosine, batch 100).
set -euo pipefail
OUT=${1:-output/fmnist_study}
SEED=${SEED:-42}
COMMON="--dataset fashion_mnist --recipe paper-cifar --epochs 8 --train-subset 8000 --val-subset 2000 -j 1 --seed $SEED --no-progress --log-interval 1000 --output $OUT"
python train.py $COMMON --model resnet32_cifar --experiment base-s$SEED
python train.py $COMMON --model resnet32_cifar --mixup 1.0 --experiment mixup-s$SEED
python train.py $COMMON --model resnet32_cifar --cutmix 1.0 --experiment cutmix-s$SEED
python train.py $COMMON --model patchhead_resnet32_cifar --patchmix --experiment randompm-s$SEED

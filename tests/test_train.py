"""Tiny end-to-end runs of train.py on the embedded data."""
import csv
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

import timm_patchmix  # noqa: F401
from timm_patchmix.checkpoint import load_state, load_weights
from timm_patchmix.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # the tree first
KILLER = os.path.join(ROOT, 'tests', 'kill_after_steps.py')  # runs train.py's main with an on_step that SIGKILLs
TINY = ['--train-subset', '64', '--val-subset', '40', '-b', '16', '-j', '0', '--no-progress', '--epochs', '2']


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def run(tmp_path, *extra, name='run'):
    return main(TINY + ['--output', str(tmp_path), '--experiment', name] + list(extra))


@pytest.mark.parametrize('flags, model, grid', [
    ([], 'resnet32_cifar', None),
    (['--mixup', '0.2'], 'resnet32_cifar', None),
    (['--cutmix', '1.0'], 'resnet32_cifar', None),
    (['--mixup', '0.2', '--no-prefetcher'], 'resnet32_cifar', None),
    (['--patchmix'], 'patchhead_resnet32_cifar', [4, 4]),
    (['--patchmix', '--patchmix-collate', '--patchmix-mode', 'pair'], 'patchhead_resnet32_cifar', [4, 4]),
    (['--patchmix', '--no-prefetcher', '--patchmix-grid', '2'], 'patchhead_resnet32_cifar', [2, 2]),
])
def test_modes_train_and_write_outputs(tmp_path, flags, model, grid):
    res = run(tmp_path, *flags)
    out = res['output']
    assert out == os.path.join(str(tmp_path), 'run')
    assert sorted(os.listdir(out)) == ['args.yaml', 'best.safetensors', 'last.safetensors', 'state.safetensors',
                                       'summary.csv']  # and no temporary file left behind
    rows = read_csv(os.path.join(out, 'summary.csv'))
    assert [int(r['epoch']) for r in rows] == [0, 1]
    assert list(rows[0]) == ['epoch', 'train_loss', 'eval_loss', 'eval_top1', 'eval_top5', 'lr', 'img_s']
    # the returned rows are the file's, as numbers
    assert [{k: str(v) for k, v in r.items()} for r in res['rows']] == rows
    for r in rows:
        assert 0 <= float(r['eval_top1']) <= 100 and float(r['eval_top1']) <= float(r['eval_top5'])
        assert float(r['train_loss']) > 0 and float(r['img_s']) > 0
        assert float(r['eval_top1']) * 40 / 100 == pytest.approx(round(float(r['eval_top1']) * 40 / 100))
    # the demo recipe: lr 0.1, cosine over 2 epochs without warm-up
    assert float(rows[0]['lr']) == pytest.approx(0.1) and float(rows[1]['lr']) == pytest.approx(0.05)

    patchmix = '--patchmix' in flags
    weights, meta = load_weights(os.path.join(out, 'last.safetensors'))
    assert any(k.startswith('patch_head.') for k in weights) == model.startswith('patchhead_')
    assert meta['model'] == model and meta['num_classes'] == 10 and meta['epoch'] == 1
    assert meta['metrics'] == res['rows'][-1]
    assert meta['data']['input_size'] == [3, 32, 32] and meta['command'].startswith('train.py --train-subset 64')
    if grid is None:  # a plain backbone records no PatchMix section
        assert meta['patchmix'] is None and meta['model_kwargs'] == {}
    else:
        assert meta['patchmix'] == {'enabled': patchmix, 'grid': grid, 'table': None, 'image_loss': True,
                                    'patch_loss': True}
        assert meta['model_kwargs'] == {'grid': grid}

    state = load_state(os.path.join(out, 'state.safetensors'))
    smeta = state['meta']
    assert smeta['epoch'] == 1 and smeta['args']['model'] == model and smeta['updates'] == 2 * 4
    assert state['optimizer']['state'], 'momentum buffers are saved'
    assert smeta['rows'] == res['rows'] and smeta['best'] == res['best']
    best_weights, best_meta = load_weights(os.path.join(out, 'best.safetensors'))
    assert best_meta['epoch'] == res['best']['epoch'] and res['best']['metric'] == 'top1'
    assert res['best']['score'] == max(r['eval_top1'] for r in res['rows'])
    # the mixing settings a resume must keep, under their flag names
    settings = smeta['settings']
    assert settings['--patchmix'] is patchmix and settings['--patchmix-table'] is None
    assert settings['--patchmix-grid'] == (grid or [4, 4])
    assert settings['--mixup'] == (0.2 if '--mixup' in flags else 0.0)
    assert settings['--cutmix'] == (1.0 if '--cutmix' in flags else 0.0)
    assert settings['--patchmix-mode'] == ('pair' if 'pair' in flags else 'elem')
    assert settings['--patchmix-collate'] is ('--patchmix-collate' in flags)
    assert settings['--no-prefetcher'] is ('--no-prefetcher' in flags)
    with open(os.path.join(out, 'args.yaml')) as f:
        recorded = yaml.safe_load(f)
    assert recorded['model'] == model and recorded['recipe'] == 'demo' and recorded['epochs'] == 2
    assert recorded['lr'] == 0.1 and recorded['patch_head'] is (grid is not None)
    assert recorded['grid'] == (grid or [4, 4]) and recorded['num_classes'] == 10


def _all_pairs_table(path):
    """A mask table of every pair of the embedded data's classes, random masks: most guided samples of a batch of
    16 find their partner class only in the mixer's class memory."""
    import numpy as np
    from timm_patchmix.data import PATCHSHAPES_CLASSES
    from timm_patchmix.guided import MaskTable, dataset_fingerprint
    rng = np.random.default_rng(0)
    pairs = [(i, j) for i in range(10) for j in range(i + 1, 10)]
    MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), dataset_fingerprint('', PATCHSHAPES_CLASSES), pairs,
              [rng.random((4, 4)) < 0.5 for _ in pairs], [0.1] * len(pairs), 0.1).save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize('guided, accum, ema, aug', [(False, 1, False, False), (True, 1, False, False),
                                                     (False, 3, False, False), (False, 1, True, False),
                                                     (False, 1, False, True)],
                         ids=['random', 'guided', 'accum3', 'ema', 'augment'])
def test_resume_after_kill_matches_uninterrupted(tmp_path, guided, accum, ema, aug):
    # on the CPU, also where a GPU is present: bit-identical replays need deterministic kernels
    args = TINY[:-1] + ['3', '--patchmix', '--output', str(tmp_path), '--device', 'cpu']
    if aug:  # RandAugment and a vertical flip in the transform, random erasing on the prefetched batch: replayed
        args += ['--aa', 'rand-m9-mstd0.5-inc1', '--vflip', '0.2', '--reprob', '0.5']
    if guided:  # the tensor mixer keeps a class memory across batches: each epoch starts it empty
        args += ['--patchmix-table', _all_pairs_table(str(tmp_path / 'masks.json'))]
    if accum > 1:  # 4 batches an epoch in groups of 3 and 1: 2 updates an epoch, so the kill after update 5 falls
        args += ['--grad-accum-steps', str(accum), '--sched-on-updates']  # in epoch 2, between its two groups
    if ema:  # the weight average resumes too: the weights files hold it
        args += ['--model-ema', '--model-ema-decay', '0.8', '--model-ema-warmup']
    kill_after = 6 if accum == 1 else 5
    env = dict(os.environ, PYTHONPATH=PYPATH)
    full = subprocess.run([sys.executable, 'train.py', *args, '--experiment', 'full'], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert full.returncode == 0, full.stderr[-2000:]
    # 64 images / batch 16 = 4 steps per epoch: a SIGKILL after step 6 is in the middle of epoch 1
    killed = subprocess.run([sys.executable, KILLER, str(kill_after), 'train', *args, '--experiment', 'killed'],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    out = os.path.join(tmp_path, 'killed')
    done = ['0'] if accum == 1 else ['0', '1']
    assert [r['epoch'] for r in read_csv(os.path.join(out, 'summary.csv'))] == done
    resumed = subprocess.run([sys.executable, 'train.py', *args, '--resume', os.path.join(out, 'state.safetensors')],
                             cwd=ROOT, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows_full = read_csv(os.path.join(tmp_path, 'full', 'summary.csv'))
    rows_resumed = read_csv(os.path.join(out, 'summary.csv'))
    assert [r['epoch'] for r in rows_resumed] == ['0', '1', '2']
    strip = [{k: v for k, v in r.items() if k != 'img_s'} for r in rows_full]
    assert strip == [{k: v for k, v in r.items() if k != 'img_s'} for r in rows_resumed]
    a = load_file(os.path.join(tmp_path, 'full', 'last.safetensors'))
    b = load_file(os.path.join(out, 'last.safetensors'))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize('accum, ema', [(1, False), (3, False), (1, True)], ids=['plain', 'accum3', 'ema'])
def test_two_process_ddp_gloo(tmp_path, accum, ema):
    torchrun = os.path.join(os.path.dirname(sys.executable), 'torchrun')
    cmd = [torchrun, '--standalone', '--nproc_per_node', '2', 'train.py', *TINY, '--patchmix', '--device', 'cpu',
           '--output', str(tmp_path), '--experiment', 'ddp']  # gloo on the CPU, also where one GPU is present
    if accum > 1:  # 2 batches a rank and epoch: one group of both, the first under DDP's no_sync
        cmd += ['--grad-accum-steps', str(accum)]
    if ema:  # each rank averages its own BatchNorm stats: reduced like the model's before validation
        cmd += ['--model-ema', '--model-ema-decay', '0.5']
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(os.path.join(tmp_path, 'ddp', 'summary.csv'))
    assert [r['epoch'] for r in rows] == ['0', '1']
    # validation is reduced over both ranks: every one of the 40 images is counted exactly once
    for r in rows:
        assert float(r['eval_top1']) * 40 / 100 == pytest.approx(round(float(r['eval_top1']) * 40 / 100))
    assert proc.stdout.count('epoch 0:') == 1, 'only rank 0 reports'
    # each epoch's last log line gives the loss over both ranks (it gave rank 0's): the epoch's train_loss
    for r in rows:
        last = [ln for ln in proc.stdout.splitlines() if ln.startswith(f'train {r["epoch"]} [')][-1]
        assert last.split()[4] == f'{float(r["train_loss"]):.4f}', (last, r['train_loss'])
    # --dist-bn reduce (the default): both ranks validated the BatchNorm stats rank 0 saved, so the saved weights,
    # evaluated in one process, give the reported numbers
    ev = _evaluate_alone(os.path.join(tmp_path, 'ddp', 'last.safetensors'), TINY + ['--patchmix', '--device', 'cpu'])
    assert round(ev['eval_top1'], 4) == float(rows[-1]['eval_top1'])
    # the loss as summary.csv writes it (6 decimals), summed over two ranks rather than one: a float32 ulp or two of
    # the loss apart (a loss of 32 has ulps of 4e-6), where BatchNorm stats not reduced would move it by far more
    assert ev['eval_loss'] == pytest.approx(float(rows[-1]['eval_loss']), rel=2e-7, abs=2e-6)


TWICE_DRIVER = """
import os, sys, time
from timm_patchmix.engine import train
from timm_patchmix.train import parse_config
out, flags = sys.argv[1], sys.argv[2:]
for name in ('one', 'two'):
    if name == 'two' and os.environ['RANK'] == '1':
        time.sleep(3)  # one process late to the second run, as on a busy machine
    result = train(parse_config(flags + ['--output', out, '--experiment', name]))
    print(name, 'done', len(result.rows), flush=True)
"""


@pytest.mark.slow
def test_two_process_ddp_trains_twice_in_one_process(tmp_path):
    """The Python API under torchrun: the group the first train() started serves the second (a second group on
    torchrun's store failed in gloo)."""
    driver = tmp_path / 'twice.py'
    driver.write_text(TWICE_DRIVER)
    torchrun = os.path.join(os.path.dirname(sys.executable), 'torchrun')
    cmd = [torchrun, '--standalone', '--nproc_per_node', '2', str(driver), str(tmp_path), *TINY, '--epochs', '1',
           '--device', 'cpu']
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('one done 1') == 2 and proc.stdout.count('two done 1') == 2, proc.stdout[-2000:]
    rows = [read_csv(os.path.join(tmp_path, name, 'summary.csv')) for name in ('one', 'two')]
    strip = [[{k: v for k, v in r.items() if k != 'img_s'} for r in rs] for rs in rows]
    assert strip[0] == strip[1]  # the same flags and seed: the same run


@pytest.mark.slow
def test_two_process_ddp_stops_every_rank_on_a_busy_folder(tmp_path):
    """Another run holds the folder: both ranks stop with the one message, before any training step."""
    from timm_patchmix.locking import hold_folder
    torchrun = os.path.join(os.path.dirname(sys.executable), 'torchrun')
    cmd = [torchrun, '--standalone', '--nproc_per_node', '2', 'train.py', *TINY, '--patchmix', '--device', 'cpu',
           '--output', str(tmp_path), '--experiment', 'busy']
    with hold_folder(str(tmp_path / 'busy'), 'test'):
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'),
                              capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert proc.stderr.count('is in use') == 2, proc.stderr[-3000:]  # rank 0's error, and rank 1's from rank 0
    assert 'Connection closed by peer' not in proc.stderr and 'epoch 0' not in proc.stdout
    assert os.listdir(tmp_path / 'busy') == []  # nothing written


def _evaluate_alone(weights, flags):
    """The validation metrics of ``weights`` in this process, on the loaders ``train.py flags`` builds."""
    from contextlib import nullcontext
    from timm_patchmix.checkpoint import load_weights
    from timm_patchmix.engine.loop import validate
    from timm_patchmix.engine.run import _setup
    from timm_patchmix.engine.runtime import Runtime
    from timm_patchmix.train import parse_config
    cfg, _, model, _, loaders, _ = _setup(parse_config(flags), Runtime(torch.device('cpu')), False)
    model.load_state_dict(load_weights(weights)[0])
    return validate(model, loaders.val, cfg, torch.device('cpu'), nullcontext)


def test_fgsm_after_training_and_standalone(tmp_path):
    res = run(tmp_path, '--fgsm', '0.1', '0.3')
    fg = json.load(open(os.path.join(res['output'], 'fgsm.json')))
    assert set(fg) == {'0.0', '0.1', '0.3'} and all(0 <= v <= 100 for v in fg.values())
    assert fg['0.0'] == pytest.approx(float(res['rows'][-1]['eval_top1']), abs=100 / 40 + 1e-9)
    from timm_patchmix.robustness import main as fgsm_main
    fgsm_main(['--checkpoint', os.path.join(res['output'], 'last.safetensors'), '--eps', '0.1', '0.3',
               '--val-subset', '40', '--output', str(tmp_path)])
    again = json.load(open(os.path.join(tmp_path, 'fgsm.json')))
    assert again == pytest.approx(fg)


@pytest.mark.parametrize('flags, message', [
    (['--dataset', 'torch/cifar10', '--data-dir', '/nonexistent'], "could not open dataset 'torch/cifar10'"),
    (['--model', 'no_such_model'], "unknown model 'no_such_model'"),
    (['--model', 'patchhead_resnet18', '--patchmix', '--img-size', '32'], r'final feature map is 1x1.*output_stride=8'),
    (['--model', 'resnet32_cifar', '--patchmix'], 'use --model patchhead_resnet32_cifar'),
    (['--num-classes', '7'], '--num-classes 7 does not match the 10 classes'),
    (['--patchmix', '--mixup', '0.2'], 'alternatives'),
    (['--model', 'resnet32_cifar', '--patchmix', '--no-patch-loss', '--patchmix-grid', '33'],
     r'--patchmix-grid 33x33 does not fit the input 32x32: cannot split a length of 32 into 33'),
])
def test_clear_errors(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        run(tmp_path, *flags)
    # a run that cannot start: SystemExit with the 'error: ...' line; a usage error: argparse's message, status 2
    text = str(e.value.code) if e.value.code != 2 else capsys.readouterr().err
    assert re.search(message, text), text
    assert not (tmp_path / 'run').exists()  # stopped before the run folder was made


def write_idx(path, array):
    import gzip
    import numpy as np
    header = bytes([0, 0, 0x08, array.ndim]) + b''.join(int(d).to_bytes(4, 'big') for d in array.shape)
    with gzip.open(path, 'wb') as f:
        f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


@pytest.mark.parametrize('in_chans', [1, 3])
def test_fashion_mnist_idx_files_greyscale(tmp_path, in_chans):
    import numpy as np
    from timm_patchmix.data import FashionMNISTFiles, read_idx
    rng = np.random.default_rng(0)
    data = tmp_path / 'fm'
    data.mkdir()
    for stem, n in (('train', 64), ('t10k', 40)):
        write_idx(data / f'{stem}-images-idx3-ubyte.gz', rng.integers(0, 256, (n, 28, 28)))
        write_idx(data / f'{stem}-labels-idx1-ubyte.gz', np.arange(n) % 10)
    ds = FashionMNISTFiles(str(data), 'test')
    assert len(ds) == 40 and ds[3][1] == 3 and ds[0][0].size == (28, 28)
    assert np.array_equal(read_idx(str(data / 't10k-labels-idx1-ubyte.gz')), np.arange(40) % 10)
    res = main(['--dataset', 'fashion_mnist', '--data-dir', str(data), '--in-chans', str(in_chans), '-b', '16',
                '-j', '0', '--epochs', '1', '--no-progress', '--output', str(tmp_path), '--experiment', 'fm',
                '--model', 'patchhead_resnet32_cifar', '--patchmix', '--fgsm', '0.1'])
    assert len(res['rows']) == 1 and set(res['fgsm']) == {0.0, 0.1}
    weights = load_file(os.path.join(res['output'], 'last.safetensors'))
    assert weights['backbone.conv1.weight'].shape[1] == in_chans
    with pytest.raises(FileNotFoundError, match='apt-get install -y dataset-fashion-mnist'):
        FashionMNISTFiles(str(tmp_path / 'empty'), 'train')


def test_a_plateau_schedule_with_lr_noise_resumes_to_the_uninterrupted_run(tmp_path, capsys):
    """timm's plateau schedule adds --lr-noise to the optimizer's rates and keeps the clean ones apart; the state
    held the noisy rates only, and the resumed epoch added its noise to them a second time (lr 0.1121 for 0.1059),
    every later epoch training at the wrong rate. The clean rates travel with the state now."""
    from timm_patchmix.engine import train
    from timm_patchmix.train import parse_config
    flags = ['--model', 'resnet8_cifar', '--train-subset', '64', '--val-subset', '32', '-b', '16', '-j', '0',
             '--epochs', '3', '--sched', 'plateau', '--lr-noise', '0.3', '0.9', '--output', str(tmp_path),
             '--no-progress']
    full = train(parse_config(flags + ['--experiment', 'full']))

    def stop(event):
        if event.epoch == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        train(parse_config(flags + ['--experiment', 'cut']), on_step=stop)
    state = str(tmp_path / 'cut' / 'state.safetensors')
    resumed = train(parse_config(flags + ['--experiment', 'cut', '--resume', state]))
    keep = ('epoch', 'train_loss', 'eval_loss', 'eval_top1', 'lr')
    assert [{k: r[k] for k in keep} for r in resumed.rows] == [{k: r[k] for k in keep} for r in full.rows]
    assert full.rows[2]['lr'] != full.rows[1]['lr']  # (the noise moved the resumed epoch's rate)
    a, b = load_file(str(tmp_path / 'full' / 'last.safetensors')), load_file(str(tmp_path / 'cut' / 'last.safetensors'))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a finished run resumed: nothing to train, and it says so (it said nothing)
    capsys.readouterr()
    again = train(parse_config(flags + ['--experiment', 'cut', '--resume', state]))
    assert again.rows == resumed.rows
    assert f'note: {state} has trained 3 epochs, and this schedule has 3: no epoch is left to train' in \
        capsys.readouterr().out


def test_plateau_schedule_resumes_with_its_counters(tmp_path):
    """A plateau schedule's counters (best score, epochs without improvement, cool-down) travel with the state, so
    a resumed run lowers its rate at the epoch the uninterrupted run does; a schedule of the epoch alone records
    none."""
    from timm.scheduler import create_scheduler_v2
    from timm_patchmix.checkpoint import load_state
    from timm_patchmix.engine.records import load_scheduler_state, scheduler_state

    def schedule():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched, _ = create_scheduler_v2(opt, sched='plateau', num_epochs=30, patience_epochs=2, decay_rate=0.1,
                                       plateau_mode='max', warmup_epochs=0)
        return opt, sched

    metrics = [1.0, 2.0, 2.0, 2.0, 1.0, 1.5, 1.0, 0.5, 0.5, 0.5]
    opt, full = schedule()
    lrs_full = []
    for e, m in enumerate(metrics):
        full.step(e + 1, m)
        lrs_full.append(opt.param_groups[0]['lr'])
    opt_a, first = schedule()
    for e, m in enumerate(metrics[:4]):
        first.step(e + 1, m)
    saved = scheduler_state(first)
    assert saved['num_bad_epochs'] == 2 and saved['best'] == 2.0
    opt_b, resumed = schedule()
    opt_b.param_groups[0]['lr'] = opt_a.param_groups[0]['lr']  # the optimizer state carries the rate
    resumed.step(4)
    load_scheduler_state(resumed, saved)
    lrs = []
    for e, m in enumerate(metrics[4:], start=4):
        resumed.step(e + 1, m)
        lrs.append(opt_b.param_groups[0]['lr'])
    assert lrs == lrs_full[4:] and lrs_full[4] < lrs_full[3]  # the drop lands on the same epoch
    # through train.py: the state records the counters, and a resume from it runs
    res = run(tmp_path, '--sched', 'plateau')
    meta = load_state(os.path.join(res['output'], 'state.safetensors'))['meta']
    assert set(meta['scheduler']) == {'best', 'num_bad_epochs', 'cooldown_counter', 'last_epoch', 'restore_lr'}
    assert meta['scheduler']['last_epoch'] == 2
    again = main(TINY[:-1] + ['3', '--sched', 'plateau', '--resume', os.path.join(res['output'], 'state.safetensors')])
    assert [r['epoch'] for r in again['rows']] == [0, 1, 2]
    cosine = run(tmp_path, name='cosine')
    assert load_state(os.path.join(cosine['output'], 'state.safetensors'))['meta']['scheduler'] is None


class _GrowingScaler:
    """timm's NativeScaler's interface around a CPU GradScaler whose scale grows at every update (the float16
    scaler of --amp on CUDA, which CI has not): a stand-in whose state shows whether a resume carried it on."""

    def __init__(self, device='cpu'):
        self.scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 4, growth_interval=1)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode='norm', parameters=None, create_graph=False,
                 need_update=True):
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            self.scaler.step(optimizer)
            self.scaler.update()

    def state_dict(self):
        return self.scaler.state_dict()

    def load_state_dict(self, state):
        self.scaler.load_state_dict(state)


def test_resume_carries_the_loss_scaler_on(tmp_path, monkeypatch):
    """The float16 loss scaler's scale and growth count travel with the state, as timm saves them (amp_scaler): a
    resumed run's scale is the uninterrupted run's (it started again from the initial scale)."""
    from contextlib import nullcontext
    from timm_patchmix.checkpoint import load_state
    from timm_patchmix.engine import run as engine_run
    made = []

    def amp_setup(cfg, device):
        made.append(_GrowingScaler())
        return nullcontext, made[-1]
    monkeypatch.setattr(engine_run, 'amp_setup', amp_setup)
    run(tmp_path, name='full')  # 2 epochs of 4 updates each
    full = made[-1].state_dict()
    assert full['scale'] == 2.0 ** 12
    first = main(TINY[:-1] + ['1', '--output', str(tmp_path), '--experiment', 'part'])
    state = os.path.join(first['output'], 'state.safetensors')
    assert load_state(state)['meta']['scaler']['scale'] == 2.0 ** 8
    main(TINY + ['--output', str(tmp_path), '--experiment', 'part', '--resume', state])
    assert made[-1].state_dict() == full
    assert load_state(state)['meta']['scaler'] == full
    # a damaged scaler record is named
    from timm_patchmix.checkpoint import save_state
    st = load_state(os.path.join(tmp_path, 'full', 'state.safetensors'))
    meta = {k: v for k, v in st['meta'].items() if k != 'optimizer'}
    save_state(str(tmp_path / 'bad.safetensors'), st['model'], None, dict(meta, scaler={'scale': 'big'}))
    with pytest.raises(SystemExit, match=r"scaler must hold the loss scaler's numbers, got \{'scale': 'big'\}"):
        main(TINY + ['--output', str(tmp_path), '--experiment', 'bad', '--resume', str(tmp_path / 'bad.safetensors')])


def test_resume_refuses_a_state_of_another_shape_or_with_damaged_rows(tmp_path, capsys):
    """A resume whose model shape changed (--in-chans) is a named settings change (exit 2); a state whose tensors do
    not fit the model, or whose rows lack a column, is an `error: cannot resume ...` (exit 1), never a traceback,
    and nothing is written."""
    from timm_patchmix.checkpoint import load_state, save_state
    from timm_patchmix.train import cli
    res = run(tmp_path)
    state = os.path.join(res['output'], 'state.safetensors')
    assert cli(TINY + ['--resume', state, '--in-chans', '1']) == 2
    err = capsys.readouterr().err
    assert '--in-chans: None before, 1 now' in err and 'Traceback' not in err, err
    # another model or class count is a settings change too, named with the others (exit 2)
    assert cli(TINY + ['--resume', state, '--model', 'patchhead_resnet20_cifar', '--patchmix']) == 2
    err = capsys.readouterr().err
    assert "--model: 'resnet32_cifar' before, 'patchhead_resnet20_cifar' now" in err, err
    assert '--patchmix: False before, True now' in err and 'Traceback' not in err, err
    st = load_state(state)
    for name, change in (('no_fc', lambda m, meta: m.pop('fc.weight')),
                         ('rows', lambda m, meta: meta['rows'][0].pop('eval_top1'))):
        model_state, meta = dict(st['model']), json.loads(json.dumps(st['meta']))
        change(model_state, meta)
        folder = tmp_path / name
        folder.mkdir()
        bad = str(folder / 'state.safetensors')
        save_state(bad, model_state, None, {k: v for k, v in meta.items() if k not in ('optimizer', 'rng')})
        with pytest.raises(SystemExit) as e:  # train.py prints it and exits 1
            cli(TINY + ['--epochs', '3', '--resume', bad])
        assert str(e.value).startswith('error: cannot resume') and name in str(e.value), str(e.value)
        assert not os.path.exists(folder / 'args.yaml')  # refused before anything was written


def test_a_resume_that_stops_before_its_first_epoch_keeps_args_yaml(tmp_path):
    """args.yaml describes the files in its folder: a resume (here with more --epochs) that stops before it saves an
    epoch leaves the record of the run that wrote them; the first epoch it saves brings its own."""
    from timm_patchmix.engine import train
    from timm_patchmix.train import parse_config

    class Stop(Exception):
        pass

    def stop(event):
        raise Stop

    res = run(tmp_path, '--epochs', '1')
    args_path = os.path.join(res['output'], 'args.yaml')
    with open(args_path) as f:
        before = f.read()
    assert yaml.safe_load(before)['epochs'] == 1
    state = os.path.join(res['output'], 'state.safetensors')
    cfg = parse_config(TINY[:-1] + ['2', '--resume', state])
    with pytest.raises(Stop):
        train(cfg, on_step=stop)
    with open(args_path) as f:
        assert f.read() == before
    train(cfg)
    with open(args_path) as f:
        assert yaml.safe_load(f)['epochs'] == 2
    assert [r['epoch'] for r in read_csv(os.path.join(res['output'], 'summary.csv'))] == ['0', '1']
    # a fresh rerun over the finished run's files that stops before its first epoch keeps that run's record too
    with open(args_path) as f:
        before = f.read()
    rerun = parse_config(TINY[:-1] + ['1', '--drop', '0.3', '--output', str(tmp_path), '--experiment', 'run'])
    with pytest.raises(Stop):
        train(rerun, on_step=stop)
    with open(args_path) as f:
        assert f.read() == before


def test_robustness_command_evaluates_a_patch_loss_only_model_as_train_does(tmp_path, capsys):
    """A model trained with --no-image-loss is evaluated by its patch head; the checkpoint says so, and
    `timm-patchmix robustness` on it gives train.py --fgsm's numbers exactly."""
    from timm_patchmix import robustness
    res = run(tmp_path, '--no-image-loss', '--patchmix', '--epochs', '1', '--fgsm', '0.05', name='noimg')
    with open(os.path.join(res['output'], 'fgsm.json')) as f:
        trained = json.load(f)
    weights, meta = load_weights(os.path.join(res['output'], 'last.safetensors'))
    assert meta['patchmix']['image_loss'] is False
    out = tmp_path / 'again'
    out.mkdir()
    assert robustness.main(['--checkpoint', os.path.join(res['output'], 'last.safetensors'), '--eps', '0.05',
                            '--val-subset', '40', '-b', '16', '--output', str(out)]) == 0
    assert 'evaluating its patch head' in capsys.readouterr().out
    with open(out / 'fgsm.json') as f:
        assert json.load(f) == trained
    # exported, its card says to predict with the patch head, and that call on the loaded model is the trainer's
    import timm
    from timm_patchmix import hub
    from timm_patchmix.engine.loop import PatchVote
    from timm_patchmix.hub.card import model_card
    folder = hub.export_folder(os.path.join(res['output'], 'last.safetensors'), str(tmp_path / 'hub'))
    card = open(os.path.join(folder, 'README.md')).read()
    assert '**Trained without the image loss**' in card and 'model.forward_patches(x).mean(1)' in card
    loaded = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    own, _ = hub.model_from_weights(os.path.join(res['output'], 'last.safetensors'))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.forward_patches(x).mean(1), PatchVote(own).eval()(x))
    with_image = dict(meta, patchmix=dict(meta['patchmix'], image_loss=True))
    assert 'without the image loss' not in model_card('u/r', meta['model'], with_image, None, None)


def test_num_classes_error_names_the_image_folder(tmp_path):
    from PIL import Image
    for split in ('train', 'validation'):
        for c in ('a', 'b', 'c'):
            os.makedirs(tmp_path / 'folder' / split / c)
            for i in range(2):
                Image.new('RGB', (32, 32), (40 * i, 0, 0)).save(tmp_path / 'folder' / split / c / f'{i}.png')
    with pytest.raises(SystemExit, match=f'--num-classes 10 does not match the 3 classes of the image folder '
                                         f'{tmp_path / "folder"}'):
        main(['--data-dir', str(tmp_path / 'folder'), '--num-classes', '10', '--epochs', '1', '-b', '2', '-j', '0',
              '--output', str(tmp_path / 'out')])


def test_amp_off_cuda_records_the_dtype_it_autocast_in(tmp_path, capsys):
    """--amp on the CPU autocasts in bfloat16 (see amp_setup); the run's records say so, not the flag's float16."""
    res = run(tmp_path, '--amp', '--epochs', '1')
    assert 'autocast in bfloat16' in capsys.readouterr().out
    args = yaml.safe_load(open(os.path.join(res['output'], 'args.yaml')))
    assert args['amp'] is True and args['amp_dtype'] == 'bfloat16'


def test_train_leaves_the_callers_generators_and_a_drawing_callback_changes_nothing(tmp_path):
    """train() seeds the global generators: the caller gets its streams back, and an on_step callback that draws
    from them does not change the run (its mixing and augmentation draw from per-epoch seeded generators; the
    check guards that the run never reads the global ones after a callback)."""
    import random
    import numpy as np
    from timm_patchmix.engine import train
    from timm_patchmix.train import parse_config

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))
    flags = TINY[:-1] + ['1', '--patchmix', '--output', str(tmp_path)]
    quiet = train(parse_config(flags + ['--experiment', 'quiet']))
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    expected = draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    drawn = train(parse_config(flags + ['--experiment', 'drawn']), on_step=lambda event: draws())
    assert draws() == expected
    a = load_file(os.path.join(quiet.output, 'last.safetensors'))
    b = load_file(os.path.join(drawn.output, 'last.safetensors'))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ctrl_c_exits_130_with_the_saved_epochs_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C (KeyboardInterrupt) in the second epoch: no traceback, exit status 130 and a line saying how to go
    on; the first epoch's files are whole, and --resume goes on from them to the run's end."""
    import timm_patchmix.train as train_cli
    real_train = train_cli.train

    def interrupted(cfg, **kw):
        def on_step(event):
            if event.updates >= 6:  # 64 images in batches of 16: 4 updates an epoch
                raise KeyboardInterrupt
        return real_train(cfg, on_step=on_step)
    monkeypatch.setattr(train_cli, 'train', interrupted)
    argv = TINY + ['--output', str(tmp_path), '--experiment', 'run', '--log-interval', '1000']
    assert train_cli.cli(argv) == 130
    err = capsys.readouterr().err
    assert err.startswith('interrupted: the epochs finished so far are saved') and 'Traceback' not in err
    assert '--resume <run folder>/state.safetensors' in err
    state = load_state(str(tmp_path / 'run' / 'state.safetensors'))
    assert state['meta']['epoch'] == 0
    monkeypatch.setattr(train_cli, 'train', real_train)
    res = main(argv + ['--resume', str(tmp_path / 'run' / 'state.safetensors')])
    assert [r['epoch'] for r in res['rows']] == [0, 1]

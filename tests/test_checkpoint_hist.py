"""``--checkpoint-hist N``: the N best epochs' weights kept as ``checkpoint-<epoch>.safetensors``, ranked as timm's
``CheckpointSaver`` ranks them, and the same files after a run stopped at any point of saving an epoch."""
import os
import random

import pytest
import torch
from safetensors.torch import load_file

import timm_patchmix  # noqa: F401
from timm_patchmix import checkpoint as ckpt_io
from timm_patchmix.checkpoint import CheckpointError, load_weights
from timm_patchmix.engine import TrainConfig, train
from timm_patchmix.engine.errors import TrainSetupError
from timm_patchmix.engine.records import CHECKPOINT_NAME, checkpoint_history
from timm_patchmix.train import parse_config

from test_cli_errors import expect_usage_error


def _ours(scores, n, metric):
    """The history after each epoch of ``scores``, epoch by epoch as a run keeps it; checks what each step drops."""
    rows = [{'eval_' + metric: s} for s in scores]
    kept = []
    for epoch in range(len(scores)):
        new, drop = checkpoint_history(rows[:epoch + 1], kept, epoch, n, metric)
        assert sorted(new + drop) == sorted(set(kept) | ({epoch} if epoch in new else set()))
        kept = new
    return kept


def _timms(folder, scores, n, decreasing):
    """timm's CheckpointSaver over the same scores: its history, best first, as epochs."""
    from timm.utils import CheckpointSaver
    model = torch.nn.Linear(2, 2)
    saver = CheckpointSaver(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=str(folder),
                            max_history=n, decreasing=decreasing)
    for epoch, score in enumerate(scores):
        saver.save_checkpoint(epoch, score)
    files = sorted(f for f in os.listdir(folder) if f.startswith('checkpoint-'))
    epochs = [int(os.path.basename(f)[len('checkpoint-'):-len('.pth.tar')]) for f, _ in saver.checkpoint_files]
    assert sorted(files) == sorted(f'checkpoint-{e}.pth.tar' for e in epochs)
    return epochs


@pytest.mark.parametrize('metric', ['top1', 'loss'])
@pytest.mark.parametrize('n', [1, 2, 3, 10])
def test_history_ranks_as_timms_checkpoint_saver(tmp_path, metric, n):
    rng = random.Random(n)
    for trial in range(15):
        # few distinct scores: many ties, which keep the earlier epoch
        scores = [rng.choice([10.0, 20.0, 30.0, 40.0]) for _ in range(rng.randint(1, 14))]
        folder = tmp_path / str(trial)
        folder.mkdir()
        assert _ours(scores, n, metric) == _timms(folder, scores, n, decreasing=metric == 'loss'), scores


def test_history_by_hand():
    rows = [{'eval_top1': s} for s in (50.0, 60.0, 50.0, 40.0, 70.0)]
    assert checkpoint_history(rows, [], 0, 0, 'top1') == ([], [])  # off
    assert checkpoint_history(rows[:3], [1, 0], 2, 2, 'top1') == ([1, 0], [])  # 50 ties epoch 0: not better
    assert checkpoint_history(rows[:3], [1], 2, 2, 'top1') == ([1, 2], [])  # room left
    assert checkpoint_history(rows, [1, 0], 4, 2, 'top1') == ([4, 1], [0])  # 70 displaces the worst
    assert checkpoint_history(rows, [1, 0], 4, 2, 'top1', exists=lambda e: e != 1) == ([4, 0], [])  # 1 is gone
    loss = [{'eval_loss': s} for s in (2.0, 1.0, 3.0)]
    assert checkpoint_history(loss, [1, 0], 2, 2, 'loss') == ([1, 0], [])  # a higher loss ranks last
    assert checkpoint_history(loss, [1, 0], 2, 3, 'loss') == ([1, 0, 2], [])


TINY = dict(model='resnet8_cifar', train_subset=64, val_subset=40, batch_size=16, workers=0, no_progress=True,
            device='cpu', epochs=5, checkpoint_hist=2)


def _files(folder):
    return sorted(f for f in os.listdir(folder) if f.startswith('checkpoint-'))


def _rows(folder):
    import csv
    with open(os.path.join(folder, 'summary.csv')) as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _same_tensors(a, b):
    a, b = load_file(a), load_file(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    out = train(TrainConfig(output=str(tmp_path_factory.mktemp('hist')), experiment='full', **TINY)).output
    return out


def test_a_run_keeps_the_best_epochs_as_summary_csv_ranks_them(uninterrupted):
    rows = _rows(uninterrupted)
    assert len(rows) == 5
    ranked = sorted(range(5), key=lambda e: (-rows[e]['eval_top1'], e))[:2]
    assert _files(uninterrupted) == sorted(CHECKPOINT_NAME.format(e) for e in ranked)
    for e in ranked:
        path = os.path.join(uninterrupted, CHECKPOINT_NAME.format(e))
        _, meta = load_weights(path)  # weights files like best and last: the epoch and its row in the metadata
        assert meta['epoch'] == e and meta['metrics']['eval_top1'] == rows[e]['eval_top1']
    # the best epoch's file is best.safetensors (top1 on 40 images is exact, so no rounding can reorder them)
    assert _same_tensors(os.path.join(uninterrupted, CHECKPOINT_NAME.format(ranked[0])),
                         os.path.join(uninterrupted, 'best.safetensors'))
    if 4 in ranked:
        assert _same_tensors(os.path.join(uninterrupted, CHECKPOINT_NAME.format(4)),
                             os.path.join(uninterrupted, 'last.safetensors'))
    state = ckpt_io.load_state(os.path.join(uninterrupted, 'state.safetensors'))
    assert state['meta']['checkpoints'] == ranked


class _Stop(Exception):
    pass


@pytest.mark.parametrize('where', ['before_state', 'before_own_file', 'before_removal'])
def test_a_run_stopped_while_saving_resumes_to_the_same_files(uninterrupted, tmp_path, monkeypatch, where):
    """Stopped while saving epoch 3: before its state, after the state but before its own checkpoint file, or after
    that file but before a displaced one is removed; the resumed run ends with the uninterrupted run's files, tensor
    for tensor (the state is written first: the resume writes the epoch's file from it and removes the files it
    no longer lists)."""
    rows = _rows(uninterrupted)
    kept_at_3 = sorted(range(4), key=lambda e: (-rows[e]['eval_top1'], e))[:2]
    displaced = set(sorted(range(3), key=lambda e: (-rows[e]['eval_top1'], e))[:2]) - set(kept_at_3)
    if where == 'before_removal' and not displaced:
        pytest.skip('epoch 3 displaced no kept epoch in this run')
    if where == 'before_own_file' and 3 not in kept_at_3:
        pytest.skip('epoch 3 is not kept in this run')
    real_remove, real_save_state, real_save_weights = os.remove, ckpt_io.save_state, ckpt_io.save_weights
    saved = []

    def remove(path, *a, **k):
        if where == 'before_removal' and os.path.basename(path).startswith('checkpoint-') and len(saved) == 4:
            raise _Stop(path)
        return real_remove(path, *a, **k)

    def save_state(path, model_state, optimizer, meta, *a, **k):
        if where == 'before_state' and meta['epoch'] == 3:
            raise _Stop(path)
        real_save_state(path, model_state, optimizer, meta, *a, **k)
        saved.append(meta['epoch'])

    def save_weights(path, *a, **k):
        if where == 'before_own_file' and os.path.basename(path) == CHECKPOINT_NAME.format(3):
            raise _Stop(path)
        return real_save_weights(path, *a, **k)

    monkeypatch.setattr(os, 'remove', remove)
    monkeypatch.setattr(ckpt_io, 'save_state', save_state)
    monkeypatch.setattr(ckpt_io, 'save_weights', save_weights)
    cfg = TrainConfig(output=str(tmp_path), experiment='stopped', **TINY)
    with pytest.raises(_Stop):
        train(cfg)
    monkeypatch.undo()
    out = os.path.join(tmp_path, 'stopped')
    assert [int(r['epoch']) for r in _rows(out)] == [0, 1, 2]  # summary.csv comes last
    assert saved == ([0, 1, 2] if where == 'before_state' else [0, 1, 2, 3])
    assert (CHECKPOINT_NAME.format(3) in _files(out)) == (where == 'before_removal')
    if where == 'before_removal':
        assert set(_files(out)) > {CHECKPOINT_NAME.format(e) for e in displaced}
    train(TrainConfig(output=str(tmp_path), experiment='stopped', resume=os.path.join(out, 'state.safetensors'),
                      **TINY))
    assert _files(out) == _files(uninterrupted)
    for name in _files(out) + ['best.safetensors', 'last.safetensors']:
        assert _same_tensors(os.path.join(out, name), os.path.join(uninterrupted, name)), name


def test_a_rerun_that_fails_writing_its_first_state_leaves_the_earlier_runs_files(tmp_path, monkeypatch):
    """A rerun into a folder (another seed) whose first state could not be written (a full disk) had already
    removed the earlier run's results.json and fgsm.json and its displaced history files and written its own
    checkpoint-0 over the earlier one's, which a resume of the earlier run then took for its own epoch 0. Nothing
    changes now before the state is written: every file is as the earlier run left it, byte for byte."""
    cfg = dict(TINY, epochs=2, checkpoint_hist=2, holdout=0.25, test_subset=24, fgsm=(0.1,))
    out = train(TrainConfig(output=str(tmp_path), experiment='run', **cfg)).output
    names = sorted(os.listdir(out))
    assert {'results.json', 'fgsm.json', CHECKPOINT_NAME.format(0), CHECKPOINT_NAME.format(1)} <= set(names)
    before = {n: open(os.path.join(out, n), 'rb').read() for n in names}
    real = ckpt_io.save_state

    def full_disk(path, *a, **k):
        raise OSError(28, 'No space left on device', path)

    monkeypatch.setattr(ckpt_io, 'save_state', full_disk)
    with pytest.raises(OSError, match='No space left on device'):
        train(TrainConfig(output=str(tmp_path), experiment='run', **dict(cfg, seed=5, checkpoint_hist=1)))
    monkeypatch.setattr(ckpt_io, 'save_state', real)
    assert sorted(os.listdir(out)) == names
    for n in names:
        assert open(os.path.join(out, n), 'rb').read() == before[n], n


def test_without_the_flag_no_file_of_that_name_is_touched(tmp_path):
    folder = tmp_path / 'plain'
    folder.mkdir()
    other = folder / CHECKPOINT_NAME.format(0)  # another run's, say
    other.write_bytes(b'kept as it is')
    train(TrainConfig(output=str(tmp_path), experiment='plain', **dict(TINY, epochs=1, checkpoint_hist=0)))
    assert other.read_bytes() == b'kept as it is' and _files(folder) == [CHECKPOINT_NAME.format(0)]


def test_a_resume_may_change_the_history_length(uninterrupted, tmp_path):
    """Without the flag a resume touches no file of the history and carries its list on; with a smaller N the next
    saved epoch keeps the N best of the kept epochs and itself, and removes the rest."""
    import shutil
    from timm_patchmix.checkpoint import load_state
    folder = tmp_path / 'full'
    shutil.copytree(uninterrupted, folder)
    state = str(folder / 'state.safetensors')
    kept = load_state(state)['meta']['checkpoints']
    before = {f: (folder / f).read_bytes() for f in _files(folder)}
    train(TrainConfig(output=str(tmp_path), resume=state, **dict(TINY, checkpoint_hist=0, epochs=6)))
    assert {f: (folder / f).read_bytes() for f in _files(folder)} == before
    assert load_state(state)['meta']['checkpoints'] == kept and len(_rows(folder)) == 6
    train(TrainConfig(output=str(tmp_path), resume=state, **dict(TINY, checkpoint_hist=1, epochs=7)))
    rows = _rows(folder)
    best = sorted(kept + [6], key=lambda e: (-rows[e]['eval_top1'], e))[0]  # epoch 5 ran without a history
    assert _files(folder) == [CHECKPOINT_NAME.format(best)]
    assert load_state(state)['meta']['checkpoints'] == [best]


def test_a_negative_length_is_a_usage_error(capsys):
    expect_usage_error(capsys, parse_config, ['--checkpoint-hist', '-1'], '-1', flag='--checkpoint-hist')


def test_a_state_with_a_bad_history_is_refused(uninterrupted, tmp_path):
    from timm_patchmix.checkpoint import load_state
    st = load_state(os.path.join(uninterrupted, 'state.safetensors'))
    for bad, message in (([7], r'checkpoints\[0\] must be an integer'), ([1, 1], 'distinct epochs'),
                         ('1', 'checkpoints must be a list')):
        path = str(tmp_path / 'bad.safetensors')
        meta = {k: v for k, v in st['meta'].items() if k not in ('optimizer', 'rng', 'kind')}
        meta['checkpoints'] = bad
        ckpt_io.save_state(path, st['model'], None, meta)
        with pytest.raises(CheckpointError, match=message):
            ckpt_io.load_state(path)


# --- best and last as the state names them ------------------------------------------------------------------------
def _epoch(path):
    from timm_patchmix.engine.records import _epoch_of
    return _epoch_of(path)


def test_a_resume_into_another_folder_brings_the_best_and_kept_files(uninterrupted, tmp_path):
    """Resumed under another --experiment, the new folder holds the state's best epoch's weights (copied: they were
    missing there, and a --holdout run then failed at its end), its last, the kept history files and the state."""
    from timm_patchmix.checkpoint import load_state
    state = os.path.join(uninterrupted, 'state.safetensors')
    before = load_state(state)['meta']
    res = train(TrainConfig(output=str(tmp_path), experiment='moved', resume=state, **dict(TINY, epochs=5)))
    moved = res.output
    assert moved != uninterrupted and len(_rows(moved)) == 5  # nothing left to train: the files alone
    b = before['best']['epoch']
    assert _epoch(os.path.join(moved, 'best.safetensors')) == b
    assert _same_tensors(os.path.join(moved, 'best.safetensors'), os.path.join(uninterrupted, 'best.safetensors'))
    assert _same_tensors(os.path.join(moved, 'last.safetensors'), os.path.join(uninterrupted, 'last.safetensors'))
    assert _files(moved) == _files(uninterrupted)
    # and the state, so that the new folder resumes (a finished run saves no epoch there to write one)
    with open(state, 'rb') as a, open(os.path.join(moved, 'state.safetensors'), 'rb') as b_:
        assert a.read() == b_.read()
    # into a folder that holds another run's files of the same epoch numbers: replaced by this run's
    other = train(TrainConfig(output=str(tmp_path), experiment='other', **dict(TINY, epochs=5, seed=3, lr=0.3)))
    train(TrainConfig(output=str(tmp_path), experiment='other', resume=state, **dict(TINY, epochs=5)))
    for name in ['best.safetensors', 'last.safetensors'] + _files(uninterrupted):
        assert _same_tensors(os.path.join(other.output, name), os.path.join(uninterrupted, name)), name


class _StopCopy(Exception):
    pass


def test_a_resume_into_another_folder_stopped_while_copying_leaves_no_state_there(
        uninterrupted, tmp_path, monkeypatch):
    """The state was copied into the new folder first: a resume stopped before the kept history files followed left
    a state naming files its folder lacked, and resuming from that folder dropped them from the history without a
    word. The state now comes last, so such a folder holds none, and the resume from the first folder, run again,
    ends with every file."""
    state = os.path.join(uninterrupted, 'state.safetensors')
    real = ckpt_io.atomic_copy
    copied = []

    def copy_once(src, dst, *a, **k):
        if copied:
            raise _StopCopy(dst)
        copied.append(dst)
        return real(src, dst, *a, **k)
    monkeypatch.setattr(ckpt_io, 'atomic_copy', copy_once)
    with pytest.raises(_StopCopy):
        train(TrainConfig(output=str(tmp_path), experiment='moved', resume=state, **dict(TINY, epochs=5)))
    moved = os.path.join(str(tmp_path), 'moved')
    assert len(copied) == 1 and not os.path.exists(os.path.join(moved, 'state.safetensors'))
    monkeypatch.setattr(ckpt_io, 'atomic_copy', real)
    train(TrainConfig(output=str(tmp_path), experiment='moved', resume=state, **dict(TINY, epochs=5)))
    assert _files(moved) == _files(uninterrupted)
    for name in ['best.safetensors', 'last.safetensors', 'state.safetensors'] + _files(uninterrupted):
        assert _same_tensors(os.path.join(moved, name), os.path.join(uninterrupted, name)), name


class _StopAtBest(Exception):
    pass


def test_a_run_stopped_after_its_state_restores_best_and_last_from_it(tmp_path, monkeypatch):
    """An earlier run (other seed and lr) left its epoch-0 files in the folder; a fresh run over it is stopped after
    its epoch-0 state but before its best/last files (the state is written first), then resumed with an allowed
    change (another --lr): best and last are written from the state's weights before training goes on, so neither
    the earlier run's files (of the same epoch number) nor a stopped epoch's pass for this run's."""
    real = ckpt_io.save_weights
    cfg = dict(TINY, epochs=1, checkpoint_hist=0)
    earlier = train(TrainConfig(output=str(tmp_path), experiment='run', **dict(cfg, seed=5, lr=0.3)))
    out = earlier.output

    def save_weights(path, state, meta=None, *a, **k):
        if os.path.basename(path) in ('best.safetensors', 'last.safetensors'):
            raise _StopAtBest(path)
        return real(path, state, meta, *a, **k)

    monkeypatch.setattr(ckpt_io, 'save_weights', save_weights)
    with pytest.raises(_StopAtBest):
        train(TrainConfig(output=str(tmp_path), experiment='run', **cfg))
    monkeypatch.undo()
    state = os.path.join(out, 'state.safetensors')
    st = ckpt_io.load_state(state)
    assert st['meta']['epoch'] == 0 and st['meta']['best']['epoch'] == 0
    before = load_file(os.path.join(out, 'last.safetensors'))  # the earlier run's, of epoch 0 too
    assert not all(torch.equal(before[k], st['model'][k]) for k in before)
    train(TrainConfig(output=str(tmp_path), resume=state, **dict(cfg, lr=0.5)))  # nothing left to train
    for name in ('best.safetensors', 'last.safetensors'):
        got = load_file(os.path.join(out, name))
        assert got.keys() == st['model'].keys() and all(torch.equal(got[k], st['model'][k]) for k in got), name
        assert load_weights(os.path.join(out, name))[1]['metrics'] == st['meta']['rows'][0]


def test_best_weights_that_are_gone_stop_a_holdout_resume_and_are_noted_otherwise(tmp_path, capsys):
    """A state whose best epoch is not its last, with best.safetensors gone: a --holdout resume (which tests those
    weights at its end; it failed there with a traceback) stops before anything is written; without --holdout a
    note says so and the run goes on."""
    cfg = dict(TINY, epochs=2, checkpoint_hist=0, holdout=0.25, test_subset=32)
    train(TrainConfig(output=str(tmp_path), experiment='ho', **cfg))
    out = os.path.join(tmp_path, 'ho')
    state = os.path.join(out, 'state.safetensors')
    st = ckpt_io.load_state(state)
    meta = {k: v for k, v in st['meta'].items() if k not in ('optimizer', 'rng', 'kind')}
    meta['best'] = dict(meta['best'], epoch=0, score=meta['rows'][0]['eval_top1'])  # the best epoch: not the last
    ckpt_io.save_state(state, st['model'], None, meta)
    os.remove(os.path.join(out, 'best.safetensors'))
    files = sorted(os.listdir(out))
    with pytest.raises(TrainSetupError, match=r'best\.safetensors should hold epoch 0, the best epoch the state '
                                              r'records, and is missing or unreadable; --holdout tests'):
        train(TrainConfig(output=str(tmp_path), resume=state, **dict(cfg, epochs=3)))
    assert sorted(os.listdir(out)) == files
    with pytest.raises(TrainSetupError, match=r'should hold epoch 0, the best epoch the state records'):
        train(TrainConfig(output=str(tmp_path), experiment='elsewhere', resume=state, **dict(cfg, epochs=3)))
    assert not os.path.exists(os.path.join(tmp_path, 'elsewhere')) or not os.listdir(tmp_path / 'elsewhere')
    cfg.update(holdout=0.0, test_subset=None)
    capsys.readouterr()
    res = train(TrainConfig(output=str(tmp_path), experiment='plain', **cfg))
    plain = ckpt_io.load_state(os.path.join(res.output, 'state.safetensors'))
    pm = {k: v for k, v in plain['meta'].items() if k not in ('optimizer', 'rng', 'kind')}
    pm['best'] = dict(pm['best'], epoch=0, score=-1.0)
    ckpt_io.save_state(os.path.join(res.output, 'state.safetensors'), plain['model'], None, pm)
    os.remove(os.path.join(res.output, 'best.safetensors'))
    train(TrainConfig(output=str(tmp_path), resume=os.path.join(res.output, 'state.safetensors'),
                      **dict(cfg, epochs=3)))
    assert 'best.safetensors should hold epoch 0' in capsys.readouterr().out
    assert _epoch(os.path.join(res.output, 'best.safetensors')) == 2  # epoch 2 scored better than -1


def test_with_the_flag_the_folders_history_files_are_the_states(tmp_path):
    """A run with --checkpoint-hist into a folder that holds an earlier run's history files (a rerun under the
    same --experiment) left them beside its own, passing for epochs of this run; now each saved epoch removes the
    history files its state does not list (files of other names are kept)."""
    folder = tmp_path / 'again'
    folder.mkdir()
    for e in (1, 3, 9):  # an earlier run's
        (folder / CHECKPOINT_NAME.format(e)).write_bytes(b'an earlier run')
    other = folder / 'checkpoint-01.safetensors'
    other.write_bytes(b'not a name this run writes')
    train(TrainConfig(output=str(tmp_path), experiment='again', **dict(TINY, epochs=2)))
    state = ckpt_io.load_state(str(folder / 'state.safetensors'))['meta']['checkpoints']
    assert sorted(state) == [0, 1] and _files(folder) == sorted(
        [CHECKPOINT_NAME.format(0), CHECKPOINT_NAME.format(1), 'checkpoint-01.safetensors'])
    assert other.read_bytes() == b'not a name this run writes'
    for e in (0, 1):  # this run's, written at its epochs
        _, meta = load_weights(str(folder / CHECKPOINT_NAME.format(e)))
        assert meta['epoch'] == e


def test_a_non_finite_evaluation_loss_ranks_last():
    """With --eval-metric loss, an epoch whose evaluation loss was NaN (an overflow) became best as the first epoch
    and stayed best, since no number is below NaN; --checkpoint-hist sorted on it as on a number. It now ranks
    below every finite loss, in both (a run now stops at such an epoch, below; a resumed run's records may hold
    one)."""
    from timm_patchmix.engine import records
    assert records.improves(float('nan'), None, 'loss')  # the first epoch is best while nothing else is
    assert records.improves(2.0, {'score': float('nan')}, 'loss')
    assert records.improves(2.0, {'score': float('inf')}, 'loss')
    assert not records.improves(float('nan'), {'score': 2.0}, 'loss')
    assert not records.improves(float('nan'), {'score': float('nan')}, 'loss')
    assert not records.improves(2.0, {'score': 2.0}, 'loss') and records.improves(1.0, {'score': 2.0}, 'loss')
    loss = [{'eval_loss': s} for s in (float('nan'), 3.0, float('inf'), 1.0)]
    assert checkpoint_history(loss, [0], 1, 2, 'loss') == ([1, 0], [])
    assert checkpoint_history(loss, [1, 0], 2, 2, 'loss') == ([1, 0], [])  # inf and NaN alike: the earlier stays
    assert checkpoint_history(loss, [1, 0], 3, 2, 'loss') == ([3, 1], [0])


def test_a_non_finite_evaluation_loss_stops_the_run_before_saving_its_epoch(tmp_path, monkeypatch):
    """An epoch whose evaluation loss is NaN (its last updates diverged: the training loss, computed before each
    update, was still finite) was saved as last/state and, at the last epoch, ended the run with status 0. It now
    stops the run like a non-finite training loss: that epoch saves nothing, the earlier files stay byte-identical."""
    from timm_patchmix.engine import NonFiniteLossError, run
    validate = run.validate
    calls, kept = [], {}

    def nan_at_second(model, loader, *args, **kwargs):
        ev = validate(model, loader, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # epoch 0's files are written by now
            kept.update({f: (folder / f).read_bytes() for f in os.listdir(folder)})
            return dict(ev, eval_loss=float('nan'))
        return ev

    folder = tmp_path / 'nan'
    monkeypatch.setattr(run, 'validate', nan_at_second)
    with pytest.raises(NonFiniteLossError, match='non-finite evaluation loss \\(nan\\) at the end of epoch 1') as e:
        train(TrainConfig(**dict(TINY, epochs=3, checkpoint_hist=1), eval_metric='loss', output=str(tmp_path),
                          experiment='nan'))
    assert e.value.evaluation and e.value.epoch == 1 and len(calls) == 2
    assert {'best.safetensors', 'last.safetensors', 'state.safetensors', 'summary.csv'} <= set(kept)
    assert {f: (folder / f).read_bytes() for f in os.listdir(folder)} == kept

"""GuidedPatchMix: guided samples follow the table, the requested fraction is met, train.py uses it."""
import math

import numpy as np
import pytest
import torch

import timm_patchmix  # noqa: F401
from timm_patchmix import split_target
from timm_patchmix.collate import FastCollateGuidedPatchMix
from timm_patchmix.data import PATCHSHAPES_CLASSES
from timm_patchmix.guided import GuidedPatchMix, MaskTable, MaskTableError, dataset_fingerprint
from timm_patchmix.train import main as train_main


def random_table(num_classes, n_pairs, seed=0, grid=(4, 4)):
    rng = np.random.default_rng(seed)
    pairs = set()
    while len(pairs) < n_pairs:
        i, j = sorted(rng.choice(num_classes, 2, replace=False).tolist())
        pairs.add((i, j))
    pairs = sorted(pairs)
    return MaskTable(grid, num_classes, [str(c) for c in range(num_classes)], 'fp', pairs,
                     [rng.random(grid) < 0.5 for _ in pairs], [0.1] * n_pairs, 0.1)


def test_guided_samples_follow_the_table_pixel_exact():
    table = random_table(10, 10, seed=1)
    mixer = GuidedPatchMix(table, guided_prob=0.6, random_prob=0.2)
    gen = torch.Generator().manual_seed(0)
    entries = {(i, j): m for (i, j), m in zip(table.pairs, table.masks)}
    seen = 0
    for _ in range(8):
        y = torch.randint(0, 10, (24,), generator=gen)
        x = torch.rand(24, 3, 8, 8, generator=gen)
        params, guided, extra = mixer.sample(y, generator=gen)
        y_src = torch.cat([y, torch.tensor(extra, dtype=y.dtype)])
        for i in guided.nonzero().flatten().tolist():
            ci, cd = int(y[i]), int(y_src[params.partner[i]])
            if (ci, cd) in entries:
                assert np.array_equal(params.mask[i].numpy(), entries[(ci, cd)])
            else:
                assert np.array_equal(params.mask[i].numpy(), ~entries[(cd, ci)])
            seen += 1
        mixer.memory.update(x, y)
        mem = [mixer.memory.pick(c) for c in extra]
        x_src = torch.cat([x, torch.stack(mem)]) if mem else x.clone()
        out, packed = mixer.mixer.apply(x.clone(), y, params, source=(x_src, y_src))
        for i in range(24):  # pixel semantics of PatchMix, 2x2 pixel cells
            for r in range(4):
                for c in range(4):
                    src = i if params.mask[i, r, c] else int(params.partner[i])
                    assert torch.equal(out[i, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2],
                                       x_src[src, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2])
        image_t, patch_t = split_target(packed[:24])
        assert torch.allclose(image_t.sum(1), torch.ones(24))
    assert seen > 40


@pytest.mark.parametrize('form', ['tensor', 'collate'])
def test_realised_guided_fraction_100_classes_batch_128(form):
    table = random_table(100, 100)
    gen = torch.Generator().manual_seed(0)
    requested = 0.5
    if form == 'tensor':
        mixer = GuidedPatchMix(table, guided_prob=requested, random_prob=0.25)
    else:
        collate = FastCollateGuidedPatchMix(table, guided_prob=requested, random_prob=0.25)
        mixer = collate.guided
    fractions, clean, rand = [], [], []
    for step in range(50):
        y = torch.randint(0, 100, (128,), generator=gen)
        if form == 'tensor':
            mixer(torch.rand(128, 3, 16, 16, generator=gen), y, generator=gen)
        else:
            imgs = torch.randint(0, 256, (128, 3, 16, 16), dtype=torch.uint8, generator=gen)
            out, packed = collate([(imgs[i].numpy(), int(y[i])) for i in range(128)])
            assert out.dtype == torch.uint8 and packed.shape == (128, 3 + 200 + 16)
        if step >= 5:  # once the class memory has seen most classes
            fractions.append(mixer.last_counts['guided'] / 128)
            clean.append(mixer.last_counts['clean'] / 128)
            rand.append(mixer.last_counts['random'] / 128)
    assert abs(np.mean(fractions) - requested) <= 0.02, np.mean(fractions)
    assert abs(np.mean(rand) - 0.25) <= 0.03 and abs(np.mean(clean) - 0.25) <= 0.03


def test_table_validation_against_the_run(tmp_path, capsys):
    fp = dataset_fingerprint('', PATCHSHAPES_CLASSES)
    t = random_table(10, 5)
    t.class_names, t.fingerprint = list(PATCHSHAPES_CLASSES), fp
    path = str(tmp_path / 'masks.json')
    t.save(path)
    with pytest.raises(MaskTableError, match='4x4 grid, this run uses 2x2'):
        GuidedPatchMix(path, grid=2)
    for grid in (2, (2, 2), [4, 2]):  # P or (rows, cols), as everywhere
        with pytest.raises(MaskTableError, match=f'4x4 grid, this run uses {"4x2" if grid == [4, 2] else "2x2"}'):
            MaskTable.load(path, grid=grid)
    assert MaskTable.load(path, grid=4).grid == MaskTable.load(path, grid=(4, 4)).grid == (4, 4)
    with pytest.raises(MaskTableError, match='another dataset'):
        GuidedPatchMix(path, fingerprint='0000')
    with pytest.raises(ValueError, match='sum to at most 1'):
        GuidedPatchMix(path, guided_prob=0.8, random_prob=0.5)
    common = ['--train-subset', '64', '--val-subset', '40', '-b', '16', '-j', '0', '--no-progress', '--epochs', '1',
              '--output', str(tmp_path), '--patchmix']
    for extra in ([], ['--patchmix-collate']):
        res = train_main(common + ['--patchmix-table', path, '--experiment', 'g' + ''.join(extra)] + extra)
        assert len(res['rows']) == 1
    with pytest.raises(SystemExit, match='searched for a 4x4 grid, this run uses 2x2'):
        train_main(common + ['--patchmix-table', path, '--patchmix-grid', '2', '--experiment', 'bad'])
    with pytest.raises(SystemExit) as e:  # a usage error: argparse's message, exit status 2
        train_main(common[:-1] + ['--patchmix-table', path, '--experiment', 'bad2'])
    assert e.value.code == 2 and 'add --patchmix' in capsys.readouterr().err
    open(path, 'w').write('{"schema_version": 1,')
    with pytest.raises(SystemExit, match='not valid JSON'):
        train_main(common + ['--patchmix-table', path, '--experiment', 'bad3'])


@pytest.mark.parametrize('value', ['10', True, 10.0, 0])
def test_the_run_values_a_table_is_checked_against_are_of_their_kind(tmp_path, value):
    """num_classes of another kind: '10' and True were compared with the table's 10 (an error saying "for 10
    classes, this run has 10"), 10.0 passed; a ValueError as PatchMix's, from the file and from a table object."""
    t = random_table(10, 5)
    path = str(tmp_path / 'masks.json')
    t.save(path)
    message = rf'num_classes must be a positive int, got {value!r}'
    for make in (lambda: MaskTable.load(path, num_classes=value), lambda: GuidedPatchMix(path, num_classes=value),
                 lambda: GuidedPatchMix(t, num_classes=value)):
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(ValueError, match='fingerprint must be a non-empty str'):
        GuidedPatchMix(path, fingerprint=t.fingerprint.encode())
    assert GuidedPatchMix(path, num_classes=np.int64(10)).table.num_classes == 10


def test_guided_bad_labels_and_memory_size_raise_value_errors():
    table = random_table(10, 5)
    mixer = GuidedPatchMix(table)
    x = torch.rand(3, 3, 8, 8)
    with pytest.raises(ValueError, match=r'labels must lie in \[0, 10\).*max 10'):
        mixer(x, torch.tensor([0, 1, 10]))
    with pytest.raises(ValueError, match=r'labels must lie in \[0, 10\).*min -1'):
        mixer(x, torch.tensor([-1, 1, 2]))
    with pytest.raises(ValueError, match='integer class indices, got dtype torch.float32'):
        mixer(x, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match='does not fit'):
        mixer(torch.rand(3, 3, 2, 8), torch.tensor([0, 1, 2]))
    for size in (0, -1, 1.5, True, np.int64(0), np.bool_(True)):
        with pytest.raises(ValueError, match='memory_size must be a positive int'):
            GuidedPatchMix(table, memory_size=size)
    assert GuidedPatchMix(table, memory_size=np.int64(3)).memory.size == 3  # numpy ints, as grid and num_classes
    for call in (lambda: mixer(x, None), lambda: mixer.sample(None)):
        with pytest.raises(ValueError, match='GuidedPatchMix needs class-index targets .* got None'):
            call()
    with pytest.raises(MaskTableError, match=f'searched on another dataset \\(fingerprint {table.fingerprint}, '
                                             f'this run other\\)'):
        GuidedPatchMix(table, fingerprint='other')
    collate = FastCollateGuidedPatchMix(table)
    imgs = np.zeros((3, 8, 8), np.uint8)
    with pytest.raises(ValueError, match='integer class indices'):
        collate([(imgs, 0.0), (imgs, 1.0)])
    with pytest.raises(ValueError, match='labels must lie'):
        collate([(imgs, 0), (imgs, 12)])
    for labels in ([0, 1, 2, 3], [0, 1]):  # more labels than images, and fewer
        with pytest.raises(ValueError, match=f'target batch size {len(labels)} does not match the image batch size 3'):
            mixer(x, torch.tensor(labels))
    for bad in (dict(guided_prob='0.5'), dict(random_prob=float('nan')), dict(guided_prob=-0.1)):
        with pytest.raises(ValueError, match='_prob must be a finite number in \\[0, 1\\]'):
            GuidedPatchMix(table, **bad)
    with pytest.raises(ValueError, match='must sum to at most 1'):
        GuidedPatchMix(table, guided_prob=0.6, random_prob=0.6)
    # nothing was half-done: the memory saw no image from the refused batches
    assert int(mixer.memory.count.sum()) == 0 and int(collate.guided.memory.count.sum()) == 0


@pytest.mark.parametrize('as_type', [list, np.asarray, torch.tensor])
def test_guided_takes_class_indices_as_patchmix_does(as_type):
    """Class indices as a list, a numpy array or a tensor give the same mixed batch and target."""
    table = random_table(10, 5)
    x = torch.rand(6, 3, 8, 8)
    labels = [0, 3, 5, 7, 3, 9]
    want = GuidedPatchMix(table)(x.clone(), torch.tensor(labels), torch.Generator().manual_seed(2))
    got = GuidedPatchMix(table)(x.clone(), as_type(labels), torch.Generator().manual_seed(2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_guided_partners_by_the_rules_and_uniform():
    """Each guided sample takes a uniform open option of its class, then a uniform other image of the option's
    class from the batch, else one from the memory; a sample whose only open option needs an image it alone is
    stays unguided."""
    # class 0: options (0, 1) and (0, 2); class 1: (1, 0); class 2: (2, 0); class 3: (3, 3) only
    g4 = np.zeros((2, 2), dtype=bool)
    table = MaskTable((2, 2), 4, list('abcd'), 'fp', [(0, 1), (0, 2), (3, 3)], [g4, ~g4, g4], [0.1] * 3, 0.1)
    mixer = GuidedPatchMix(table, guided_prob=1.0, random_prob=0.0)
    gen = torch.Generator().manual_seed(0)
    y = torch.tensor([0, 1, 1, 2, 2, 2, 0, 3])
    option_counts, partner_counts = {1: 0, 2: 0}, {}
    for _ in range(3000):
        params, guided, extra = mixer.sample(y, generator=gen)
        assert extra == [] and not guided[7]  # class 3 is alone in the batch and the memory is empty
        for i in guided.nonzero().flatten().tolist():
            j = int(params.partner[i])
            assert j != i and j < len(y)
            ci, cj = int(y[i]), int(y[j])
            assert (ci, cj) in ((0, 1), (0, 2), (1, 0), (2, 0))
            if i == 0:
                option_counts[cj] += 1
                partner_counts[j] = partner_counts.get(j, 0) + 1
    n = sum(option_counts.values())
    assert n > 2500 and abs(option_counts[1] / n - 0.5) < 0.04  # the two open options alike
    for j in (1, 2):  # partners of class 1 for sample 0: images 1 and 2 alike
        assert abs(partner_counts[j] / option_counts[1] - 0.5) < 0.05
    for j in (3, 4, 5):
        assert abs(partner_counts[j] / option_counts[2] - 1 / 3) < 0.05
    # with class 3 in the memory, sample 7 is guided with a memory partner, appended after the batch
    mixer.memory.update(torch.rand(1, 3, 4, 4), torch.tensor([3]))
    params, guided, extra = mixer.sample(y, generator=gen)
    assert guided[7] and int(params.partner[7]) == len(y) + extra.index(3) and extra.count(3) == 1
    # two images of class 3: each partners the other, never itself
    y2 = torch.tensor([3, 3])
    for _ in range(20):
        params, guided, extra = mixer.sample(y2, generator=gen)
        assert params.partner.tolist() == [1, 0] and guided.all() and extra == []


def _pair_table(**kw):
    return MaskTable((1, 2), 2, [], 'fp', [(0, 1)], [np.array([[1, 0]], bool)], [0.0], 0.0, **kw)


@pytest.mark.parametrize('first,second', [
    (torch.full((1, 1, 4, 4), 7.0), torch.full((2, 1, 4, 4), 3, dtype=torch.uint8)),   # another dtype
    (torch.full((1, 1, 4, 4), 7.0), torch.full((2, 1, 4, 4), 3.0, dtype=torch.bfloat16)),
    (torch.full((1, 1, 8, 8), 7.0), torch.full((2, 1, 6, 6), 3.0)),                      # another size
])
def test_remembered_images_of_another_dtype_or_size_are_no_partners(first, second):
    """The class memory holds a class-1 image from a batch of one dtype or size; a batch of class-0 images of
    another dtype or size finds no class-1 partner (the memory counts as empty), so it stays clean, and the
    memory then holds that batch's images."""
    gm = GuidedPatchMix(_pair_table(), guided_prob=1.0, random_prob=0.0)
    gm(first.clone(), torch.tensor([1]))
    assert gm.memory.has(1)
    out, packed = gm(second.clone(), torch.tensor([0, 0]))
    assert torch.equal(out, second) and gm.last_counts == {'guided': 0, 'clean': 2, 'random': 0}
    image_t, _ = split_target(packed)
    assert torch.equal(image_t, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    assert not gm.memory.has(1) and gm.memory.has(0) and gm.memory.images.dtype == second.dtype
    # the next class-1 batch of the new kind does find its partner in memory: a 3 from the remembered class 0
    out, _ = gm(torch.full((1, *second.shape[1:]), 9, dtype=second.dtype), torch.tensor([1]))
    assert gm.last_counts['guided'] == 1 and set(out.flatten().tolist()) == {3.0, 9.0}


def test_remembered_images_carry_no_autograd_history():
    """A batch autograd follows (a differentiable augmentation before the mixer) enters the class memory as plain
    images: later batches mixed with them neither require grad nor send gradients back into the old batch (its
    second backward through a freed graph failed, and each remembered graph stayed alive)."""
    gm = GuidedPatchMix(_pair_table(), guided_prob=1.0, random_prob=0.0)
    leaf = torch.full((2, 1, 4, 4), 7.0, requires_grad=True)
    gm(leaf * 1.0, torch.tensor([1, 1]))
    assert not gm.memory.images.requires_grad and gm.memory.images.grad_fn is None
    w = torch.nn.Parameter(torch.ones(()))
    for _ in range(2):
        out, _ = gm(torch.full((1, 1, 4, 4), 3.0), torch.tensor([0]))
        assert gm.last_counts['guided'] == 1 and set(out.flatten().tolist()) == {3.0, 7.0}
        assert not out.requires_grad
        (out * w).sum().backward()
    assert leaf.grad is None and float(w.grad) == 2 * (8 * 3.0 + 8 * 7.0)


def test_bad_labels_leave_a_memory_of_another_kind_as_it_was():
    gm = GuidedPatchMix(_pair_table(), guided_prob=1.0, random_prob=0.0)
    gm(torch.full((1, 1, 4, 4), 7.0), torch.tensor([1]))
    with pytest.raises(ValueError, match=r'target labels must lie in \[0, 2\)'):
        gm(torch.full((1, 1, 6, 6), 3.0), torch.tensor([5]))
    assert gm.memory.has(1) and gm.memory.images.shape[2:] == (1, 4, 4)


def test_a_table_built_in_python_is_checked_as_a_loaded_one(tmp_path):
    """A ``MaskTable`` made in Python gets the checks of :meth:`MaskTable.load` (errors name the field);
    numpy and torch values become plain ones; a path-like names a file."""
    bad = [(dict(pairs=[(0, 5)]), r'mask table: pairs\[0\]\.classes\[1\] must be an integer in \[0, 1\], got 5'),
           (dict(masks=[np.ones((1, 3), bool)]), r'pairs\[0\]\.mask\[0\] must be a list of 2'),
           (dict(masks=[np.ones((2, 2), bool)]), r'pairs\[0\]\.mask must be a list of 1'),
           (dict(scores=[]), r'pairs, masks and scores must be lists of one length'),
           (dict(grid=(0, 2)), r'grid must be \[rows, cols\] with positive integers'),
           (dict(pairs=[(0, 1), (1, 0)], masks=[np.ones((1, 2), bool)] * 2, scores=[0.0, 0.0]),
            r'pairs\[1\] repeats the class pair of pairs\[0\]'),
           (dict(search_args={'x': object()}), r'not a number, string, list or array')]
    for change, message in bad:
        fields = dict(grid=(1, 2), num_classes=2, class_names=[], fingerprint='fp', pairs=[(0, 1)],
                      masks=[np.array([[1, 0]], bool)], scores=[0.0], best_fitness=0.0)
        fields.update(change)
        with pytest.raises(MaskTableError, match=message):
            GuidedPatchMix(MaskTable(**fields))
    with pytest.raises(ValueError, match='table must be a MaskTable or the path of a mask table file, got dict'):
        GuidedPatchMix({'pairs': []})
    table = MaskTable((1, 2), 2, ['a', 'b'], 'fp', [(np.int64(0), np.int64(1))], [torch.tensor([[True, False]])],
                      [float('nan')], float('nan'))
    gm = GuidedPatchMix(table)
    assert gm.table.pairs == [(0, 1)] and type(gm.table.pairs[0][0]) is int
    assert np.array_equal(gm.table.masks[0], [[True, False]]) and math.isnan(gm.table.scores[0])
    path = tmp_path / 'masks.json'
    _pair_table().save(str(path))
    assert GuidedPatchMix(path).table.to_json() == GuidedPatchMix(str(path)).table.to_json() == _pair_table().to_json()


def test_a_failed_call_leaves_the_class_memory_as_it_was():
    """The batch was remembered before the mix, which can still refuse it (an inference tensor outside inference
    mode, a leaf that requires grad): the refused batch stayed in the memory, and a retry remembered it twice."""
    table = random_table(3, 2, seed=0, grid=(2, 2))
    mixer = GuidedPatchMix(table, guided_prob=0.0, random_prob=1.0, num_classes=3)
    mixer.memory.update(torch.full((1, 3, 4, 4), 1.0), torch.tensor([2]))

    def state(m):  # the remembered images (slots not yet written hold whatever torch.empty left there), counters
        return [m.images[c, :int(m.count[c])].clone() for c in range(3)], m.count.clone(), m.next.clone()

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and torch.equal(a[1], b[1]) and \
            torch.equal(a[2], b[2])
    before = state(mixer.memory)
    assert [len(i) for i in before[0]] == [0, 0, 1]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        inference = torch.full((2, 3, 4, 4), 7.0)
    leaf = torch.full((2, 3, 4, 4), 5.0, requires_grad=True)
    for bad in (inference, leaf):
        with pytest.raises(RuntimeError):
            mixer(bad, torch.tensor([0, 1]), gen)
        assert same(state(mixer.memory), before)
    # a batch of another size replaces the memory only once it mixes
    with torch.inference_mode():
        larger = torch.full((2, 3, 8, 8), 7.0)
    with pytest.raises(RuntimeError):
        mixer(larger, torch.tensor([0, 1]), gen)
    assert same(state(mixer.memory), before)
    with pytest.raises(ValueError, match='labels must lie'):
        mixer(torch.zeros(2, 3, 8, 8), torch.tensor([0, 5]), gen)
    assert same(state(mixer.memory), before)
    x = torch.stack([torch.full((3, 4, 4), 7.0), torch.full((3, 4, 4), 8.0)])
    mixer(x, torch.tensor([0, 1]), gen)  # a batch that mixes is remembered clean, as before
    assert mixer.memory.count.tolist() == [1, 1, 1]
    assert torch.equal(mixer.memory.images[0, 0], torch.full((3, 4, 4), 7.0))
    assert torch.equal(mixer.memory.images[1, 0], torch.full((3, 4, 4), 8.0))

"""table_generalisation: a table's genes rescored on the search's own image pairs (exactly the search's scores), on
fresh pairs of the same classes and against random masks; the refusals and the command line."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from timm_patchmix.data import PatchShapes, subset_indices
from timm_patchmix.grid import bits_to_mask, mask_to_bits
from timm_patchmix.search import Search, SearchConfig
from timm_patchmix.search.generalise import (OUTSIDE_SUBSET, UNUSED_BY_PAIR, GeneralisationError, _fresh_pairs,
                                             main as generalise_main, table_generalisation)
from timm_patchmix.search.inputs import ValidationData
from timm_patchmix.table import MaskTableError

from test_search import PYPATH, ROOT, make_checkpoint

FAST = dict(fresh_k=2, random_masks=2, seed=0)
SUBSET = 300


def tiny_search(ckpt, output, val_subset):
    """A search of three active pairs with K=2, run in memory; its table is saved to ``output/masks.json``."""
    cfg = SearchConfig(checkpoint=ckpt, output=str(output), population=6, generations=1, n_active=3, k=2,
                       val_subset=val_subset, eval_batch_size=64, seed=3, device='cpu', progress=False, plots=False)
    s = Search.from_checkpoint(cfg)
    table = s.run()
    os.makedirs(output, exist_ok=True)
    path = str(output / 'masks.json')
    table.save(path)
    return s, table, path


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp('ft') / 'ft.safetensors'))


@pytest.fixture(scope='module')
def searched(ckpt, tmp_path_factory):
    """A search on a fixed subset of 300 of the 1000 validation images, and its measurement."""
    s, table, path = tiny_search(ckpt, tmp_path_factory.mktemp('search'), SUBSET)
    return s, table, path, table_generalisation(ckpt, path, **FAST)


@pytest.fixture(scope='module')
def labels():
    return np.asarray(PatchShapes('validation').targets)


def _pair_index(s, pair):
    return int(np.flatnonzero((s.space.pairs == np.array(pair)).all(1))[0])


def test_chosen_search_equals_the_search_exactly(searched):
    s, table, _, res = searched
    assert len(res['genes']) == len(table.pairs) == 3
    assert res['recorded'] == {'genes_checked': 3, 'exact': True, 'max_abs_diff': 0.0,
                               'tolerance': res['recorded']['tolerance']}
    for g, e in enumerate(res['genes']):
        p = _pair_index(s, table.pairs[g])
        memo = s.scorer.lookup(np.array([p]), np.array([mask_to_bits(table.masks[g])]))[0]
        assert e['chosen_search'] == memo == table.scores[g] == e['recorded_score']
        assert e['classes'] == list(table.pairs[g]) and e['mask'] == table.masks[g].astype(int).tolist()
        # the search's own image pairs, as dataset indices of the validation split
        idx = subset_indices(range(1000), SUBSET)
        assert e['search_pairs']['a'] == [idx[i] for i in s.scorer.a_idx[p].tolist()]
        assert e['search_pairs']['b'] == [idx[i] for i in s.scorer.b_idx[p].tolist()]
    assert res['mean']['chosen_search'] == np.sum([e['chosen_search'] for e in res['genes']]) / 3
    assert res['fitness'] == 'min' and 'note' not in res and res['k'] == 2 and res['scored_on']['images'] == SUBSET


def test_gaps_and_retained_follow_their_definitions(searched):
    res = searched[3]
    for e in res['genes'] + [res['mean']]:
        for kind in ('patchmix', 'matched'):
            assert e['gap_search'][kind] == e['random_search'][kind] - e['chosen_search']
            assert e['gap_fresh'][kind] == e['random_fresh'][kind] - e['chosen_fresh']
            want = None if e['gap_search'][kind] == 0 else e['gap_fresh'][kind] / e['gap_search'][kind]
            assert e['retained'][kind] == want


def test_fresh_pairs_come_from_outside_the_scored_subset(searched, labels):
    res = searched[3]
    scored = set(subset_indices(range(1000), SUBSET))
    assert res['fresh_from'] == {'split': 'validation', 'images': 1000, 'scored_subset': SUBSET,
                                 'pools': {OUTSIDE_SUBSET: 3, UNUSED_BY_PAIR: 0}}
    for e in res['genes']:
        a, b = e['fresh_pairs']['a'], e['fresh_pairs']['b']
        assert len(a) == len(b) == FAST['fresh_k'] and e['fresh_pool'] == OUTSIDE_SUBSET
        assert (labels[a] == e['classes'][0]).all() and (labels[b] == e['classes'][1]).all()
        assert len(set(a)) == len(a) and len(set(b)) == len(b)
        assert not (set(a) | set(b)) & scored, 'no fresh image scored any gene of the search'


def test_fresh_pairs_avoid_the_pairs_images_without_a_subset(ckpt, tmp_path, labels):
    s, table, path = tiny_search(ckpt, tmp_path, None)
    res = table_generalisation(ckpt, path, **FAST)
    assert res['recorded']['exact'] and res['fresh_from']['scored_subset'] is None
    for g, e in enumerate(res['genes']):
        p = _pair_index(s, table.pairs[g])
        assert e['chosen_search'] == table.scores[g]
        used = set(s.scorer.a_idx[p].tolist()) | set(s.scorer.b_idx[p].tolist())  # the whole split: positions
        a, b = e['fresh_pairs']['a'], e['fresh_pairs']['b']
        assert e['fresh_pool'] == UNUSED_BY_PAIR and not (set(a) | set(b)) & used
        assert (labels[a] == e['classes'][0]).all() and (labels[b] == e['classes'][1]).all()


def test_fresh_pool_falls_back_then_fails():
    labels = np.array([0] * 6 + [1] * 6)
    whole = ValidationData('', '', 'validation', ['a', 'b'], labels, ds=None, data_meta={})
    subset = np.array([0, 1, 2, 3, 6, 7, 8, 9])  # two images of each class left outside
    used = np.array([0, 6])
    a, b, pool = _fresh_pairs(whole, (0, 1), 2, 0, subset, True, used)
    assert pool == OUTSIDE_SUBSET and set(a) == {4, 5} and set(b) == {10, 11}
    a, b, pool = _fresh_pairs(whole, (0, 1), 3, 0, subset, True, used)
    assert pool == UNUSED_BY_PAIR and not {0, 6} & (set(a) | set(b))
    assert (labels[a] == 0).all() and (labels[b] == 1).all()
    with pytest.raises(GeneralisationError, match='too few images .* lower --fresh-k'):
        _fresh_pairs(whole, (0, 1), 6, 0, subset, True, used)


def test_random_masks(searched):
    res = searched[3]
    cells = 16
    for e in res['genes']:
        gene_partner = cells - int(np.asarray(e['mask']).sum())
        assert e['partner_cells'] == gene_partner
        matched = bits_to_mask(np.array(e['random_masks']['matched']), 4, 4)
        assert matched.shape == (FAST['random_masks'], 4, 4)
        assert ((~matched).reshape(len(matched), -1).sum(1) == gene_partner).all()
        assert all(0 <= m < 1 << cells for m in e['random_masks']['patchmix'])


def test_deterministic_for_a_seed(ckpt, searched):
    path, res = searched[2], searched[3]
    again = table_generalisation(ckpt, path, **FAST)
    other = table_generalisation(ckpt, path, **dict(FAST, seed=1))
    strip = lambda r: {k: v for k, v in r.items() if k != 'seconds'}  # noqa: E731
    assert strip(again) == strip(res)
    import pathlib  # paths as pathlib.Path: the same (the table's was an AttributeError, the checkpoint's blamed it)
    assert strip(table_generalisation(pathlib.Path(ckpt), pathlib.Path(path), **FAST)) == strip(res)
    assert [e['fresh_pairs'] for e in other['genes']] != [e['fresh_pairs'] for e in res['genes']]
    assert [e['search_pairs'] for e in other['genes']] == [e['search_pairs'] for e in res['genes']]


def test_fitness_max_is_named_with_the_same_definitions(ckpt, searched, tmp_path):
    _, table, _, res = searched
    table.search_args = dict(table.search_args, fitness='max')
    path = str(tmp_path / 'max.json')
    table.save(path)
    got = table_generalisation(ckpt, path, **FAST)
    assert got['fitness'] == 'max' and "fitness 'max'" in got['note']
    assert got['genes'] == res['genes'] and got['mean'] == res['mean']


def test_a_table_that_keeps_the_easiest_genes_says_so(ckpt, tmp_path):
    """A loss-score search with fitness 'min' keeps the lowest cross-entropies, the easiest genes: its positive gaps
    say the chosen masks are easier than random ones, and the note now says so (it named fitness 'max' only)."""
    cfg = SearchConfig(checkpoint=ckpt, output=str(tmp_path), population=6, generations=1, n_active=3, k=2,
                       val_subset=SUBSET, eval_batch_size=64, seed=3, device='cpu', progress=False, plots=False,
                       score='loss')
    table = Search.from_checkpoint(cfg).run()
    path = str(tmp_path / 'loss.json')
    table.save(path)
    got = table_generalisation(ckpt, path, **FAST)
    assert got['score'] == 'loss' and got['fitness'] == 'min'
    assert ("fitness 'min' and the loss score: it keeps the lowest scores, the easiest genes. The definitions are "
            "the same, so a positive gap says the chosen masks score lower than random ones: easier") in got['note']


def test_tables_that_do_not_fit_are_refused(ckpt, searched, tmp_path):
    _, _, path, _ = searched
    other = make_checkpoint(str(tmp_path / 'other.safetensors'), seed=1)
    with pytest.raises(GeneralisationError, match='was not searched with .*other.safetensors.*recorded'):
        table_generalisation(other, path, **FAST)

    def edited(name, **changes):
        doc = dict(json.load(open(path)), **changes)
        out = str(tmp_path / name)
        json.dump(doc, open(out, 'w'))
        return out
    with pytest.raises(MaskTableError, match='another dataset'):
        table_generalisation(ckpt, edited('fp.json', dataset_fingerprint='0' * 16), **FAST)
    with pytest.raises(GeneralisationError, match='records no search_args'):
        table_generalisation(ckpt, edited('bare.json', search_args={}), **FAST)
    args = json.load(open(path))['search_args']
    args['scored_on'] = dict(args['scored_on'], sha256='0' * 64)
    with pytest.raises(GeneralisationError, match='scored on other images'):
        table_generalisation(ckpt, edited('on.json', search_args=args), **FAST)
    # the record's note is words about the images, which a version may change: the images are compared
    args = json.load(open(path))['search_args']
    args['scored_on'] = dict(args['scored_on'], note='as an earlier version worded it')
    assert table_generalisation(ckpt, edited('note.json', search_args=args), **FAST)['genes']
    with pytest.raises(GeneralisationError, match='lower --fresh-k'):
        table_generalisation(ckpt, path, fresh_k=200, random_masks=1)
    with pytest.raises(SystemExit, match='^error: .*was not searched with'):
        generalise_main(['--checkpoint', other, '--table', path, '--fresh-k', '2', '--random-masks', '1'])


@pytest.mark.parametrize('kwargs, message', [
    (dict(eval_batch_size=0), 'eval_batch_size must be an integer >= 1, got 0'),
    (dict(eval_batch_size=True), 'eval_batch_size must be an integer >= 1, got True'),
    (dict(device='meta'), "device: 'meta' holds no data to compute with"),
    (dict(device='bogus'), "device: not a torch device: 'bogus'"),
    (dict(device=0), 'device: must be a device name, got 0')])
def test_the_callers_own_arguments_are_named_as_such(ckpt, searched, kwargs, message):
    """eval_batch_size=0 was reported as the table's search_args that cannot be read, and the meta device or an
    unknown name came from torch; each names the argument now."""
    with pytest.raises(ValueError, match='^' + re.escape(message)) as e:
        table_generalisation(ckpt, searched[2], **FAST, **kwargs)
    assert not isinstance(e.value, GeneralisationError)  # (the table is not at fault)


@pytest.mark.slow
def test_cli_writes_the_json(ckpt, searched, tmp_path):
    path, res = searched[2], searched[3]
    out = tmp_path / 'result.json'
    proc = subprocess.run([sys.executable, '-m', 'timm_patchmix.search.generalise', '--checkpoint', ckpt,
                           '--table', path, '--fresh-k', '2', '--random-masks', '2', '--output', str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=PYPATH))
    assert proc.returncode == 0, proc.stderr
    assert 'retained' in proc.stdout and f'wrote {out}' in proc.stdout
    doc = json.load(open(out))
    assert doc['genes'] == json.loads(json.dumps(res['genes'])) and doc['mean'] == json.loads(json.dumps(res['mean']))
    assert not [f for f in os.listdir(tmp_path) if f != 'result.json'], 'written atomically, no temporary left'


def test_the_output_never_replaces_an_input_and_a_bad_device_is_a_usage_error(ckpt, searched, tmp_path, capsys):
    """--output naming the --table (or the --checkpoint) replaced it with the result; --device foo/meta was a
    traceback. Both now exit 2 before anything is read or written. The generalisation runs from inside a search's
    folder (it builds the search without --resume, which a search.py run there is refused)."""
    from timm_patchmix.search.generalise import main
    path = searched[2]
    before = open(path, 'rb').read()
    for name, target in (('table', path), ('checkpoint', ckpt)):
        with pytest.raises(SystemExit) as e:
            main(['--checkpoint', ckpt, '--table', path, '--output', target, '--fresh-k', '2', '--random-masks', '2'])
        assert e.value.code == 2 and f'argument --output: {target} is the --{name} this reads' in \
            capsys.readouterr().err
    assert open(path, 'rb').read() == before
    with pytest.raises(SystemExit) as e:
        main(['--checkpoint', ckpt, '--table', path, '--device', 'foo'])
    assert e.value.code == 2 and 'argument --device: not a torch device' in capsys.readouterr().err
    folder = tmp_path / 'in_a_search'
    folder.mkdir()
    (folder / 'search_state.safetensors').write_bytes(b'a search')
    cwd = os.getcwd()
    try:
        os.chdir(folder)
        assert table_generalisation(ckpt, path, **FAST)['mean'] == searched[3]['mean']
    finally:
        os.chdir(cwd)

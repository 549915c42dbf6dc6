"""The README's first command: the mixer demo writes its PNG and a JSON whose labels match the masks."""
import json
import os

from PIL import Image

from timm_patchmix.demo import main


def test_demo_writes_png_and_consistent_json(tmp_path):
    assert main(['--output', str(tmp_path), '--num', '4']) == 0
    img = Image.open(os.path.join(tmp_path, 'patchmix_samples.png'))
    assert img.size[0] > 300 and img.size[1] > 4 * 128
    rec = json.load(open(os.path.join(tmp_path, 'patchmix_samples.json')))
    assert len(rec['samples']) == 4
    for s in rec['samples']:
        kept = sum(map(sum, s['mask'])) / 16  # 32x32 image, equal 8x8 cells: lambda = kept cells / 16
        if s['label'] == s['partner_label']:
            assert s['target'] == {s['label']: 1.0}
        else:
            assert abs(s['target'].get(s['label'], 0.0) - kept) < 1e-6
            assert abs(s['target'].get(s['partner_label'], 0.0) - (1 - kept)) < 1e-6


def test_render_grid_draws_greyscale_and_refuses_what_it_cannot_draw():
    """Greyscale samples (Fashion-MNIST with --in-chans 1) are drawn with their pixels; a float batch or a mask of
    another grid is a ValueError naming the argument, not an error from inside PIL or an IndexError."""
    import numpy as np
    import pytest
    import torch
    from timm_patchmix.viz import render_grid
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 1, 8, 8), dtype=torch.uint8, generator=g)
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    t = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    picture = render_grid(x, x, x, mask, [0, 1], [0, 1], t, ['a', 'b'], (2, 2), scale=1)
    top = 18  # no title: the first row starts below the column heads
    tile = np.asarray(picture)[top:top + 8, :8]  # the first image, drawn without cell lines
    assert all(np.array_equal(tile[:, :, k], x[0, 0].numpy()) for k in range(3))
    with pytest.raises(ValueError, match=r'images must be uint8 \[N, 1 or 3, H, W\]'):
        render_grid(x.float(), x, x, mask, [0, 1], [0, 1], t, ['a', 'b'], (2, 2))
    with pytest.raises(ValueError, match=r'mask must be \[N, rows, cols\] = \[2, 4, 4\]'):
        render_grid(x, x, x, mask, [0, 1], [0, 1], t, ['a', 'b'], (4, 4))


def test_plot_pairs_and_guided_samples_refuse_nothing_to_draw(tmp_path):
    import pytest
    from types import SimpleNamespace
    from timm_patchmix.viz import plot_pairs, render_guided_samples
    with pytest.raises(ValueError, match='holds no class pairs'):
        plot_pairs(SimpleNamespace(pairs=[], masks=[], num_classes=2, class_names=['a', 'b'], search_args={}),
                   str(tmp_path / 'p.png'))
    with pytest.raises(ValueError, match='max_pairs must be an integer >= 1, got 0'):
        plot_pairs(SimpleNamespace(pairs=[(0, 1)]), str(tmp_path / 'p.png'), max_pairs=0)
    for n in (0, -1):
        with pytest.raises(ValueError, match=f'n must be an integer >= 1, got {n}'):
            render_guided_samples('unused.json', '', '', str(tmp_path / 'g.png'), n=n)
    assert not os.listdir(tmp_path)


def test_guided_samples_refuse_a_table_of_another_dataset(tmp_path):
    """A Fashion-MNIST table drawn on patchshapes captioned shapes with clothes' names; it is refused, as train.py
    refuses it, and nothing is written."""
    import pytest
    from timm_patchmix.table import MaskTableError
    from timm_patchmix.viz import render_guided_samples
    table = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs', 'fmnist3', 'masks.json')
    with pytest.raises(MaskTableError, match='was searched on another dataset'):
        render_guided_samples(table, '', '', str(tmp_path / 'g.png'), n=2)
    assert not os.listdir(tmp_path)


def test_guided_samples_of_a_folder_whose_validation_split_lacks_a_class(tmp_path):
    """The table's fingerprint is of the training split's classes, which train.py and the search use for every
    split: a validation folder without one of them draws under the table, as the pipeline draws it."""
    import numpy as np
    from PIL import Image
    from timm_patchmix.table import MaskTable, dataset_fingerprint
    from timm_patchmix.viz import render_guided_samples
    for split, classes in (('train', 'abc'), ('validation', 'ac')):
        for c in classes:
            os.makedirs(tmp_path / 'data' / split / c)
            for i in range(2):
                Image.new('RGB', (8, 8), (40 * i, 0, 0)).save(tmp_path / 'data' / split / c / f'{i}.png')
    table = MaskTable((2, 2), 3, ['a', 'b', 'c'], dataset_fingerprint('', ['a', 'b', 'c']), [(0, 2)],
                      [np.array([[True, False], [False, True]])], [0.5], 0.5)
    table.save(str(tmp_path / 'masks.json'))
    render_guided_samples(str(tmp_path / 'masks.json'), '', str(tmp_path / 'data'), str(tmp_path / 'g.png'), n=1)
    assert os.path.getsize(tmp_path / 'g.png') > 0


def test_guided_samples_take_a_class_the_validation_split_lacks_from_the_training_split(tmp_path, monkeypatch):
    """A search that scored the training split (the pipeline's --holdout) may pair a class the validation folder
    lacks: its image comes from the training split (a KeyError before)."""
    import numpy as np
    import torch
    from PIL import Image
    from timm_patchmix import viz
    from timm_patchmix.table import MaskTable, dataset_fingerprint
    colour = {'a': (200, 0, 0), 'b': (0, 200, 0), 'c': (0, 0, 200)}
    for split, classes in (('train', 'abc'), ('validation', 'ac')):
        for c in classes:
            os.makedirs(tmp_path / 'data' / split / c)
            Image.new('RGB', (8, 8), colour[c]).save(tmp_path / 'data' / split / c / '0.png')
    table = MaskTable((2, 2), 3, ['a', 'b', 'c'], dataset_fingerprint('', ['a', 'b', 'c']), [(0, 1)],
                      [np.array([[True, False], [False, True]])], [0.5], 0.5)
    table.save(str(tmp_path / 'masks.json'))
    drawn = []
    real = viz.render_grid
    monkeypatch.setattr(viz, 'render_grid', lambda images, partners, *a, **k: (
        drawn.append((images, partners)), real(images, partners, *a, **k))[1])
    viz.render_guided_samples(str(tmp_path / 'masks.json'), '', str(tmp_path / 'data'), str(tmp_path / 'g.png'), n=1)
    images, partners = drawn[0]
    assert torch.equal(images[0], torch.tensor(colour['a'], dtype=torch.uint8).view(3, 1, 1).expand(3, 8, 8))
    assert torch.equal(partners[0], torch.tensor(colour['b'], dtype=torch.uint8).view(3, 1, 1).expand(3, 8, 8))
    assert os.path.getsize(tmp_path / 'g.png') > 0


def _two_class_folder(root, sizes):
    """An image folder with a train and a validation split of classes ``a`` (red) and ``b`` (green), one image each,
    of ``sizes[c]`` (width, height)."""
    from PIL import Image
    colour = {'a': (200, 0, 0), 'b': (0, 200, 0)}
    for split in ('train', 'validation'):
        for c in 'ab':
            os.makedirs(root / split / c)
            Image.new('RGB', sizes[c], colour[c]).save(root / split / c / '0.png')
    return colour


def _two_class_table(path):
    import numpy as np
    from timm_patchmix.table import MaskTable, dataset_fingerprint
    MaskTable((2, 2), 2, ['a', 'b'], dataset_fingerprint('', ['a', 'b']), [(0, 1)],
              [np.array([[True, False], [False, True]])], [0.5], 0.5).save(str(path))


def test_guided_samples_of_images_of_several_sizes_are_drawn_at_the_input_size(tmp_path, monkeypatch):
    """An image folder's images differ in size: with a checkpoint's data config they are drawn as evaluation makes
    them (a stack of the raw images failed with a RuntimeError before, so the pipeline's guided phase could never
    run on such a folder); without one it is a ValueError naming the sizes, and nothing is written."""
    import pytest
    import torch
    from timm_patchmix import viz
    colour = _two_class_folder(tmp_path / 'data', {'a': (12, 8), 'b': (10, 10)})
    _two_class_table(tmp_path / 'masks.json')
    out = tmp_path / 'g.png'
    with pytest.raises(viz.GuidedSamplesError,
                       match=r'^render_guided_samples: the images drawn are of 2 sizes \(8x12, 10x10\)'):
        viz.render_guided_samples(str(tmp_path / 'masks.json'), '', str(tmp_path / 'data'), str(out), n=1)
    assert not out.exists()
    with pytest.raises(ValueError, match=r'^render_guided_samples: data_config must be a dict with input_size'):
        viz.render_guided_samples(str(tmp_path / 'masks.json'), '', str(tmp_path / 'data'), str(out), n=1,
                                  data_config={'interpolation': 'bicubic'})
    drawn = []
    real = viz.render_grid
    monkeypatch.setattr(viz, 'render_grid', lambda images, partners, mixed, *a, **k: (
        drawn.append((images, partners, mixed)), real(images, partners, mixed, *a, **k))[1])
    viz.render_guided_samples(str(tmp_path / 'masks.json'), '', str(tmp_path / 'data'), str(out), n=1,
                              data_config={'input_size': (3, 6, 6), 'interpolation': 'bilinear', 'crop_pct': 1.0})
    images, partners, mixed = drawn[0]
    red, green = (torch.tensor(colour[c], dtype=torch.uint8).view(3, 1, 1).expand(3, 6, 6) for c in 'ab')
    assert torch.equal(images[0], red) and torch.equal(partners[0], green)
    keep = torch.tensor([[1, 1, 1, 0, 0, 0]] * 3 + [[0, 0, 0, 1, 1, 1]] * 3, dtype=torch.bool)  # the mask's cells
    assert torch.equal(mixed[0], torch.where(keep, red, green))
    assert out.stat().st_size > 0


def test_guided_samples_refuse_an_image_file_that_cannot_be_read(tmp_path):
    """timm's image dataset answers a file it cannot open with the next item, of another class: the picture would
    caption a class-b image as class a. It is a ValueError naming the file, and nothing is written."""
    import pytest
    from timm_patchmix.viz import GuidedSamplesError, render_guided_samples
    _two_class_folder(tmp_path / 'data', {'a': (8, 8), 'b': (8, 8)})
    bad = tmp_path / 'data' / 'validation' / 'a' / '0.png'
    bad.write_text('not an image')
    _two_class_table(tmp_path / 'masks.json')
    with pytest.raises(GuidedSamplesError, match=r'^render_guided_samples: .*validation/a/0\.png \(class 0\) could '
                                                 r'not be read as an image'):
        render_guided_samples(str(tmp_path / 'masks.json'), '', str(tmp_path / 'data'), str(tmp_path / 'g.png'), n=1)
    assert not (tmp_path / 'g.png').exists()


def test_the_pipeline_names_a_picture_it_cannot_draw_in_one_line(monkeypatch, capsys):
    """The guided-samples picture's refusal (an unreadable image file, say) ended the pipeline in a traceback; it
    is an `error:` line and exit status 1, as the search's refusal of the same file is."""
    from timm_patchmix import pipeline
    from timm_patchmix.viz import GuidedSamplesError

    def refuse(argv):
        raise GuidedSamplesError('render_guided_samples: x.png (class 0) could not be read as an image')
    monkeypatch.setattr(pipeline, 'main', refuse)
    assert pipeline.cli([]) == 1
    assert capsys.readouterr().err == 'error: render_guided_samples: x.png (class 0) could not be read as an image\n'


def test_a_number_of_samples_no_picture_holds_is_a_usage_error(tmp_path, capsys):
    """--num 100000 built every image at once and was killed for memory (22 GB); it now exits 2 naming the bound
    before anything is built or written."""
    import pytest
    from timm_patchmix.demo import MAX_SAMPLES
    with pytest.raises(SystemExit) as e:
        main(['--output', str(tmp_path / 'out'), '--num', str(MAX_SAMPLES + 1)])
    assert e.value.code == 2 and f'argument --num: must be an integer in [1, {MAX_SAMPLES}]' in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()
    with pytest.raises(SystemExit) as e:  # a seed torch's generator cannot take (it was a traceback)
        main(['--output', str(tmp_path / 'out'), '--seed', str(2 ** 64)])
    assert e.value.code == 2 and 'argument --seed: must be an integer in [-2**63, 2**64 - 2**32]' in \
        capsys.readouterr().err
    assert main(['--output', str(tmp_path / 'out'), '--num', '3']) == 0

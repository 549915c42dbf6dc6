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

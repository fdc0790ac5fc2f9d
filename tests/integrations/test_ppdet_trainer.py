"""PaddleDetection's Trainer with BackwardGraphDetCallback: YOLOv3 on a quarter-width
MobileNetV1, random weights, trained on four synthetic 64x64 images (COCO format).

Runs in the venv `make test` builds for PaddleDetection (``.venv-det``: paddledet
2.6.0 needs scikit-learn==1.3.2 with numpy==1.23.5); skipped where ppdet is not
installed. Oracle: param.grad read by the optimizer right before it applies it.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ppdet")

import paddle  # noqa: E402
from PIL import Image  # noqa: E402

from paddleviz_hooks import BackwardGraph  # noqa: E402
from paddleviz_hooks.integrations.ppdet import BackwardGraphDetCallback  # noqa: E402

ANCHORS = "[[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119], [116, 90], [156, 198], [373, 326]]"
MASKS = "[[6, 7, 8], [3, 4, 5], [0, 1, 2]]"

CONFIG = """
use_gpu: false
log_iter: 1
save_dir: {tmp}/output
snapshot_epoch: 1000
print_flops: false
metric: COCO
num_classes: 2
epoch: 1
worker_num: 0
architecture: YOLOv3
norm_type: bn
YOLOv3: {{backbone: MobileNet, neck: YOLOv3FPN, yolo_head: YOLOv3Head, post_process: BBoxPostProcess}}
MobileNet: {{scale: 0.25, feature_maps: [4, 6, 13], with_extra_blocks: false, extra_block_filters: []}}
YOLOv3Head: {{anchors: {anchors}, anchor_masks: {masks}, loss: YOLOv3Loss}}
YOLOv3Loss: {{ignore_thresh: 0.7, downsample: [32, 16, 8], label_smooth: false}}
BBoxPostProcess:
  decode: {{name: YOLOBox, conf_thresh: 0.005, downsample_ratio: 32, clip_bbox: true}}
  nms: {{name: MultiClassNMS, keep_top_k: 10, score_threshold: 0.01, nms_threshold: 0.45, nms_top_k: 100}}
LearningRate:
  base_lr: 0.001
  schedulers:
  - !PiecewiseDecay {{gamma: 0.1, milestones: [100], use_warmup: false}}
OptimizerBuilder:
  optimizer: {{momentum: 0.9, type: Momentum}}
  regularizer: {{factor: 0.0005, type: L2}}
TrainDataset: !COCODataSet
  {{image_dir: images, anno_path: ann.json, dataset_dir: {tmp}/data, data_fields: [image, gt_bbox, gt_class, is_crowd]}}
TrainReader:
  inputs_def: {{num_max_boxes: 4}}
  sample_transforms:
    - Decode: {{}}
    - Resize: {{target_size: [64, 64], keep_ratio: false, interp: 2}}
  batch_transforms:
    - NormalizeBox: {{}}
    - PadBox: {{num_max_boxes: 4}}
    - BboxXYXY2XYWH: {{}}
    - NormalizeImage: {{mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225], is_scale: true}}
    - Permute: {{}}
    - Gt2YoloTarget: {{anchor_masks: {masks}, anchors: {anchors}, downsample_ratios: [32, 16, 8]}}
  batch_size: 2
  shuffle: false
  drop_last: true
  use_shared_memory: false
"""


def _dataset(root: str, n: int = 4) -> None:
    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(root, "images"))
    images, anns = [], []
    for i in range(n):
        name = f"{i}.jpg"
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(os.path.join(root, "images", name))
        images.append({"id": i + 1, "file_name": name, "width": 64, "height": 64})
        anns.append({"id": i + 1, "image_id": i + 1, "category_id": 1 + i % 2, "bbox": [8, 8, 32, 24],
                     "area": 768, "iscrowd": 0})
    with open(os.path.join(root, "ann.json"), "w") as f:
        json.dump({"images": images, "annotations": anns,
                   "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]}, f)


def test_yolov3_training_is_captured_with_every_parameter(tmp_path):
    from ppdet.core.workspace import load_config
    from ppdet.engine import Trainer

    _dataset(str(tmp_path / "data"))
    path = tmp_path / "yolo.yml"
    path.write_text(CONFIG.format(tmp=tmp_path, anchors=ANCHORS, masks=MASKS))
    paddle.seed(0)
    trainer = Trainer(load_config(str(path)), mode="train")
    applied = []
    step = trainer.optimizer.step

    def seen_step():  # the oracle: param.grad as the update applies it
        applied.append({id(p): float(np.linalg.norm(p.grad.numpy().astype("float64")))
                        for p in trainer.model.parameters() if p.grad is not None})
        return step()

    trainer.optimizer.step = seen_step
    cb = BackwardGraphDetCallback(trainer, str(tmp_path / "vdl"), every=1, verbose=0, visualdl=False,
                                  formats=("json",))
    trainer.register_callbacks([cb])
    trainer.train()
    assert cb.recorder.captured_steps == [1, 2] and len(applied) == 2
    print(f"YOLOv3-MobileNetV1(0.25): {len(applied[0])} parameters with a gradient of "
          f"{len(list(trainer.model.parameters()))}")
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for i, f in enumerate(sorted(glob.glob(os.path.join(cb.recorder.run_dir, "step_*.json")))):
        g = BackwardGraph.from_json(Path(f).read_text(encoding="utf-8"))
        assert set(g.params()) == {names[k] for k in applied[i]}  # every parameter with a gradient
        assert len(g.params()) > 100
        for k, v in applied[i].items():
            assert g.meta["applied_grads"][names[k]] == pytest.approx(v, rel=1e-6, abs=1e-12)
    assert trainer.optimizer.step is seen_step  # the trainer's optimizer is as it was
    assert not trainer.model._forward_pre_hooks

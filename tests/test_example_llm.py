"""examples/train_llm_recompute.py: recompute + gradient accumulation, recorded whole and unchanged."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from paddleviz_hooks import BackwardGraph

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_llm_recompute.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_llm_recompute", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_llm_example_records_every_micro_batch_and_parameter_and_changes_nothing(tmp_path, example):
    kw = dict(steps=3, every=2, accumulate=2, batch=2, seq=6, vocab=32, dim=16, layers=2, verbose=0)
    losses, weights, rec = example.train(log_dir=str(tmp_path), **kw)
    base_losses, base_weights, _ = example.train(log_dir=None, **kw)
    assert losses == base_losses
    assert weights.keys() == base_weights.keys()
    for k in weights:
        assert np.array_equal(weights[k], base_weights[k]), k

    assert rec.captured_steps == [1, 2]
    model = example.TinyLM(32, 16, 2)
    names = {n for n, _ in model.named_parameters()}
    assert len(names) == 2 + 2 * 7 + 1
    run = tmp_path / "backward_graph"
    for step in (1, 2):
        for i, suffix in enumerate(("", "_b2"), start=1):
            g = BackwardGraph.from_json((run / f"step_{step:06d}{suffix}.json").read_text())
            assert g.meta["backward"]["role"] == f"micro-batch {i} of 2"
            assert set(g.params()) == names  # the recomputed blocks' parameters too
            assert all(m.norm is not None and m.norm > 0 for m in g.params().values())
            assert g.meta["nested"] == 2  # both blocks' backwards stitched in
            assert {f"blocks.{b}.mlp.down" for b in (0, 1)} <= {n.layer for n in g.nodes}
            assert (run / f"step_{step:06d}{suffix}.png").exists()

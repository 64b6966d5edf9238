"""Warm starts (dflashkit.training.warm_start): a drafter deepened or widened computes what it computed before."""

from __future__ import annotations

import pytest
import torch

from tests.training.test_trainer import make_trainer, tiny_corpus, trained_and_saved


def test_init_with_more_layers_deepens_the_drafter_without_changing_what_it_computes(tmp_path):
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.errors import InvalidInputError
    from dflashkit.training.warm_start import deepened
    from tests.conftest import tiny_target

    model = tiny_target("llama")
    seqs = tiny_corpus(model, 8, seed=3, new_tokens=12)
    first = trained_and_saved(tmp_path, model, seqs)
    deeper = make_trainer(tmp_path / "b", model, [*seqs], init_drafter=str(tmp_path / "d"), num_layers=4, steps=4)
    assert deeper.drafter.config.num_hidden_layers == 4
    same = make_trainer(tmp_path / "s", model, [*seqs], init_drafter=str(tmp_path / "d"), num_layers=None)
    assert same.drafter.config.num_hidden_layers == same.cfg.num_layers == 2  # no --layers: the init's depth
    assert make_trainer(tmp_path / "n", model, [*seqs], num_layers=None).drafter.config.num_hidden_layers == 3
    fresh = make_trainer(tmp_path / "f", model, [*seqs], num_layers=4)  # a new 4-layer drafter reads other layers
    assert fresh.drafter.config.target_layer_ids != first.drafter.config.target_layer_ids
    assert deeper.drafter.config.target_layer_ids == first.drafter.config.target_layer_ids  # the init's are kept
    old, new = load_drafter(tmp_path / "d", dtype=torch.float32).eval(), deeper.drafter.eval()
    torch.manual_seed(0)
    hidden = model.config.hidden_size
    features = torch.randn(1, 12, len(old.config.target_layer_ids) * hidden)
    block = torch.randn(1, 4, hidden)
    with torch.no_grad():
        want = old(block, torch.arange(12, 16), old.context_key_values(features, torch.arange(12)))
        got = new(block, torch.arange(12, 16), new.context_key_values(features, torch.arange(12)))
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the new layers start as identities
    before = {k: v.clone() for k, v in deeper.drafter.state_dict().items()}
    deeper.run(resume=False, progress=False)
    for name in ("layers.2.self_attn.o_proj.weight", "layers.3.mlp.down_proj.weight"):  # they do learn
        assert not torch.equal(deeper.drafter.state_dict()[name], before[name]), name
    with pytest.raises(InvalidInputError, match="deepen"):
        deepened(deeper.drafter, 2)


def test_init_with_more_target_layers_widens_the_fusion_without_changing_what_it_computes(tmp_path):
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.errors import InvalidInputError
    from dflashkit.training.warm_start import widened
    from tests.conftest import tiny_target

    model = tiny_target("llama")
    seqs = tiny_corpus(model, 8, seed=3, new_tokens=12)
    first = trained_and_saved(tmp_path, model, seqs)
    assert first.drafter.config.target_layer_ids == [1, 3]
    wider = make_trainer(
        tmp_path / "b", model, [*seqs], init_drafter=str(tmp_path / "d"), target_layer_ids=[1, 2, 3], steps=4
    )
    assert wider.drafter.config.target_layer_ids == [1, 2, 3]
    old, new = load_drafter(tmp_path / "d", dtype=torch.float32).eval(), wider.drafter.eval()
    torch.manual_seed(0)
    h = model.config.hidden_size
    f1, f2, f3 = (torch.randn(1, 12, h) for _ in range(3))
    block = torch.randn(1, 4, h)
    with torch.no_grad():
        want = old(block, torch.arange(12, 16), old.context_key_values(torch.cat((f1, f3), -1), torch.arange(12)))
        got = new(block, torch.arange(12, 16), new.context_key_values(torch.cat((f1, f2, f3), -1), torch.arange(12)))
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the new layer's columns start at zero
    wider.run(resume=False, progress=False)
    assert wider.drafter.fc.weight[:, h : 2 * h].abs().max() > 0  # ... and learn
    with pytest.raises(InvalidInputError, match="not the shape of this run"):  # dropping a layer: refused
        make_trainer(tmp_path / "c", model, [*seqs], init_drafter=str(tmp_path / "d"), target_layer_ids=[1, 2])
    with pytest.raises(InvalidInputError, match="cannot widen"):
        widened(old, [1, 1, 3])

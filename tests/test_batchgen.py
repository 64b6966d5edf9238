"""Batched regeneration equals per-prompt transformers generate (greedy), rows leaving the batch as they end."""

from __future__ import annotations

import pytest
import torch

from dflashkit.batchgen import generate_batch
from dflashkit.sampling import SamplingParams

from conftest import tiny_target

EOS = 2


def _alone(model, ids, max_new_tokens, eos):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


@pytest.mark.parametrize("arch,compact_fraction", [("llama", None), ("qwen2", None), ("qwen3", None),
                                                   ("llama", 0.3), ("llama", 1.0)])
def test_greedy_batch_equals_each_prompt_alone(arch, compact_fraction):
    """Rows leave the batch as they end (None on a CPU), once 30% have ended, or never (1.0): same tokens."""
    model = tiny_target(arch, tie_word_embeddings=False)  # a tied tiny model greedily repeats its last token
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (9,), generator=g)]
    # Declare as "eos" the token whose first occurrences in unstopped continuations fall at the most different
    # steps, so that rows end (and leave the batch) at different steps.
    free = generate_batch(model, prompts, max_new_tokens=20, eos_ids=[0], pad_id=0)
    eos = max(range(4, 96), key=lambda t: len({row.index(t) for row in free if t in row[:-1]}))
    batched = generate_batch(model, prompts, max_new_tokens=20, eos_ids=[eos], pad_id=0,
                             compact_fraction=compact_fraction)
    assert len({len(r) for r in batched}) > 2, "the test needs rows that end at different steps"
    for ids, got in zip(prompts, batched):
        assert got == _alone(model, ids, 20, eos)


def test_sampling_is_seeded_and_stops_at_eos():
    model = tiny_target("llama")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(temperature=1.0, top_p=0.9)
    a = generate_batch(model, prompts, max_new_tokens=15, eos_ids=[EOS], pad_id=0, sampling=params,
                       generator=torch.Generator().manual_seed(3))
    b = generate_batch(model, prompts, max_new_tokens=15, eos_ids=[EOS], pad_id=0, sampling=params,
                       generator=torch.Generator().manual_seed(3))
    assert a == b
    for row in a:
        assert 1 <= len(row) <= 15 and EOS not in row[:-1]

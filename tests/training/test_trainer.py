"""Training pieces against element-wise references, and small end-to-end runs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflashkit.errors import InvalidInputError
from dflashkit.training.losses import (
    block_hidden,
    block_targets,
    position_weights,
    row_argmax,
    sample_anchors,
    training_attention_mask,
    weighted_block_loss,
)


def reference_mask(anchors, keep, seq_len, B):
    """The mask predicate written out element by element (SpecForge's convention, PR #473 strictness)."""
    S, N = anchors.shape
    out = torch.zeros(S, 1, N * B, seq_len + N * B, dtype=torch.bool)
    for s in range(S):
        for q in range(N * B):
            b = q // B
            if not keep[s, b]:
                continue  # padding blocks see nothing
            for j in range(seq_len + N * B):
                if j < seq_len:
                    out[s, 0, q, j] = j < anchors[s, b]  # context strictly before the anchor
                else:
                    out[s, 0, q, j] = (j - seq_len) // B == b  # own block, bidirectional; no other block
    return out


@pytest.mark.parametrize("seq_len,B", [(1, 2), (5, 4), (20, 4), (33, 8)])
def test_mask_equals_elementwise_predicate(seq_len, B):
    g = torch.Generator().manual_seed(seq_len)
    loss_mask = torch.rand(3, seq_len, generator=g) > 0.3
    loss_mask[0] = False  # a sequence with no valid anchor: all padding blocks
    anchors, keep = sample_anchors(loss_mask, 4, g)
    got = training_attention_mask(anchors, keep, seq_len, B)
    assert torch.equal(got, reference_mask(anchors, keep, seq_len, B))
    assert not keep[0].any()


def test_anchor_sampler_respects_the_loss_mask():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        L = int(torch.randint(2, 40, (1,), generator=g))
        loss_mask = torch.rand(4, L, generator=g) > 0.4
        anchors, keep = sample_anchors(loss_mask, 8, g)
        for s in range(4):
            valid = {i for i in range(L - 1) if loss_mask[s, i] and loss_mask[s, i + 1]}
            chosen = anchors[s][keep[s]].tolist()
            assert set(chosen) <= valid and len(set(chosen)) == len(chosen) == min(len(valid), anchors.shape[1])
            assert chosen == sorted(chosen)
            assert (anchors[s][~keep[s]] == 0).all()


def test_anchor_sampler_is_uniform():
    loss_mask = torch.ones(1, 11, dtype=torch.bool)  # 10 valid anchors (0..9)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(11)
    for _ in range(2000):
        a, _ = sample_anchors(loss_mask, 3, g)
        counts[a[0]] += 1
    assert counts[10] == 0
    assert (counts[:10] / 2000 - 0.3).abs().max() < 0.05  # each valid anchor drawn with p = 3/10


def test_position_weights_values():
    w = position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    assert abs(float(w.sum()) - 6.63) < 0.01  # the paper's table for γ=7, B=16
    assert torch.allclose(position_weights(8, 4.0)[-1], torch.tensor(math.exp(-6 / 4)))


def test_loss_equals_naive_weighted_mean_including_cut_blocks():
    torch.manual_seed(0)
    S, L, B, V, gamma = 2, 12, 4, 7, 3.0
    ids = torch.randint(0, V, (S, L))
    lengths = torch.tensor([12, 7])  # the second sequence ends early: its late blocks are cut
    loss_mask = torch.zeros(S, L, dtype=torch.bool)
    loss_mask[0, 3:] = True
    loss_mask[1, 2:7] = True
    loss_mask[0, 8] = False  # an unsupervised hole inside the response: later positions still count
    anchors, keep = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(3))
    labels, weights = block_targets(ids, loss_mask, lengths, anchors, keep, B, gamma)
    logits = torch.randn(S, anchors.shape[1], B - 1, V)
    num = den = 0.0
    for s in range(S):
        for n in range(anchors.shape[1]):
            for k in range(1, B):
                p = int(anchors[s, n]) + k
                if not keep[s, n] or p >= int(lengths[s]) or not loss_mask[s, p]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                ce = float(F.cross_entropy(logits[s, n, k - 1][None], ids[s, p][None]))
                num, den = num + w * ce, den + w
                assert labels[s, n, k - 1] == ids[s, p]
    assert den > 0
    assert abs(float(weighted_block_loss(logits, labels, weights)) - num / den) < 1e-5


def test_dpace_weights_equal_a_naive_computation(monkeypatch):
    """D-PACE: w_k = Σ_{j>=k} Π_{i<=j} s_i with s_i = (1-α) q_i + α, and s = 0 where an offset has no label (it can
    never be accepted, so nothing after it in the block counts); the label probabilities in row chunks."""
    import dflashkit.training.trainer as train
    from dflashkit.training.losses import acceptance_weights, block_cross_entropy

    def label_probabilities(logits, labels):  # the drafter's probability of each label, as loss_on derives it
        return torch.exp(-block_cross_entropy(logits, labels).detach())

    torch.manual_seed(0)
    S, N, K, V, alpha = 2, 3, 5, 9, 0.3
    logits = torch.randn(S, N, K, V)
    labels = torch.randint(0, V, (S, N, K))
    valid = torch.rand(S, N, K) > 0.25
    monkeypatch.setattr(train, "LOSS_CHUNK_ROWS", 4)  # 30 rows in chunks of 4
    q = label_probabilities(logits, labels)
    assert torch.allclose(q, logits.softmax(-1).gather(-1, labels[..., None])[..., 0], atol=1e-6)
    w = acceptance_weights(q, valid, alpha)
    for s in range(S):
        for n in range(N):
            for k in range(K):
                want = 0.0
                if valid[s, n, k]:
                    for j in range(k, K):
                        prefix = 1.0
                        for i in range(j + 1):
                            prefix *= (1 - alpha) * float(q[s, n, i]) + alpha if valid[s, n, i] else 0.0
                        want += prefix
                assert abs(float(w[s, n, k]) - want) < 1e-5, (s, n, k)
    assert (w[~valid] == 0).all() and (w[valid] > 0).any()
    x = logits.clone().requires_grad_()
    weighted_block_loss(x, labels, acceptance_weights(label_probabilities(x, labels), valid, alpha)).backward()
    y = logits.clone().requires_grad_()
    weighted_block_loss(y, labels, w).backward()
    assert torch.equal(x.grad, y.grad)  # the weights carry no gradient: the loss is CE under fixed weights


def test_training_with_dpace_weights_learns(tmp_path):
    from dflashkit.training.trainer import TrainConfig
    from tests.conftest import tiny_target

    model = tiny_target("llama")
    seqs = tiny_corpus(model, 8, seed=3, new_tokens=12)
    with pytest.raises(InvalidInputError, match="loss_weighting"):
        TrainConfig(data_dir="", out_dir="", loss_weighting="cumulative")
    with pytest.raises(InvalidInputError, match="dpace_alpha"):
        TrainConfig(data_dir="", out_dir="", loss_weighting="dpace", dpace_alpha=1.5)
    trainer = make_trainer(tmp_path / "a", model, [*seqs], loss_weighting="dpace", steps=40)
    first, _ = trainer.loss_on(trainer.train_seqs[:4], spread=False)
    trainer.run(resume=False, progress=False)
    last, _ = trainer.loss_on(trainer.train_seqs[:4], spread=False)
    first, last = float(first.detach()), float(last.detach())
    assert math.isfinite(first) and last < 0.8 * first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_and_the_accuracy_in_row_chunks_equal_them_in_one_piece(dtype, monkeypatch):
    """The loss runs over the logits in chunks of rows (and the accuracy's argmax too): the same loss, gradient
    and argmax as over all rows at once, with rows that do not divide into chunks and ties in bf16."""
    import dflashkit.training.trainer as train

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7, 11).to(dtype)  # 105 rows
    logits[0, 0, 0, 4] = logits[0, 0, 0, 9] = logits[0, 0, 0].max() + 1  # a tie: the first index wins
    labels = torch.randint(0, 11, (3, 5, 7))
    weights = torch.rand(3, 5, 7)
    results = {}
    for chunk in (8, 1000):
        monkeypatch.setattr(train, "LOSS_CHUNK_ROWS", chunk)
        x = logits.clone().requires_grad_()
        loss = weighted_block_loss(x, labels, weights)
        loss.backward()
        results[chunk] = (loss.detach(), x.grad, row_argmax(x))
    (l1, g1, a1), (l2, g2, a2) = results[8], results[1000]
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert torch.equal(a1, a2) and torch.equal(a1, logits.float().argmax(-1)) and a1[0, 0, 0] == 4


def test_loss_chunks_are_small_on_a_cpu_and_large_elsewhere():
    from dflashkit.training.losses import DEVICE_LOSS_CHUNK_ROWS, LOSS_CHUNK_ROWS, loss_chunk_rows

    assert loss_chunk_rows(torch.zeros(2, 3)) == LOSS_CHUNK_ROWS == 256
    assert loss_chunk_rows(torch.zeros(2, 3, device="meta")) == DEVICE_LOSS_CHUNK_ROWS >= 64 * LOSS_CHUNK_ROWS


# ---- end to end on a tiny random target ---------------------------------------------------------------


def tiny_corpus(model, n: int, seed: int, new_tokens: int = 40):
    """Prompts of random tokens with the target's own greedy continuations (regenerated by the target)."""
    from dflashkit.decoding.loop import DecodeOptions, decode
    from dflashkit.target.adapter import TargetAdapter
    from dflashkit.training.dataset import TrainingSequence
    from tests.conftest import VOCAB

    g = torch.Generator().manual_seed(seed)
    target = TargetAdapter(model)
    seqs = []
    for _ in range(n):
        prompt = torch.randint(3, VOCAB, (6,), generator=g).tolist()
        out = [t for s in decode(target, None, prompt, DecodeOptions(max_new_tokens=new_tokens)) for t in s.tokens]
        seqs.append(TrainingSequence(prompt + out, len(prompt)))
    return seqs


class FakeTokenizer:
    pad_token_id = 0
    eos_token_id = None


def make_trainer(tmp_path, model, seqs, **overrides):
    from dflashkit.training.trainer import TrainConfig, Trainer

    cfg = TrainConfig(
        data_dir="",
        out_dir=str(tmp_path),
        num_layers=2,
        block_size=4,
        gamma=4.0,
        anchors_per_seq=16,
        seqs_per_step=4,
        steps=120,
        lr=3e-3,
        eval_every=0,
        checkpoint_every=10,
        draft_vocab_size=None,
        eval_prompts=4,
        max_seq_len=64,
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return Trainer(cfg, model, FakeTokenizer(), sequences=seqs, log=lambda *_: None)


def before_step(trainer, done: int, action) -> None:
    """Call `action()` when `trainer` begins the step after its `done`-th (an interruption at a chosen point)."""
    real_step = trainer.train_step

    def step(batch_iter):
        if trainer.step == done:
            action()
        return real_step(batch_iter)

    trainer.train_step = step


def process_dies() -> None:
    raise KeyboardInterrupt  # the process dies between checkpoints


def test_tiny_training_raises_tau(tmp_path):
    from tests.conftest import tiny_target

    torch.manual_seed(0)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 44, seed=0)
    trainer = make_trainer(tmp_path, model, seqs)
    tau_before = trainer.estimate_tau(max_new_tokens=32)
    trainer.run(resume=False, progress=False)
    tau_after = trainer.estimate_tau(max_new_tokens=32)
    assert tau_after > tau_before + 0.5, (tau_before, tau_after)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def test_a_compile_failure_falls_back_to_eager_training(tmp_path, monkeypatch):
    """--compile where torch.compile cannot build (e.g. no C++ compiler): the step is redone eagerly, the run says
    so once and goes on without it."""
    from tests.conftest import tiny_target

    calls = []

    def broken_compile(module, **kwargs):
        def run(*args):
            calls.append(1)
            raise RuntimeError("no C++ compiler found\nmore detail")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    model = tiny_target("llama")
    messages = []
    trainer = make_trainer(tmp_path, model, tiny_corpus(model, 8, seed=4, new_tokens=12), compile=True)
    trainer.log = messages.append
    batches = iter([trainer.train_seqs[:4]] * 3)
    first = trainer.train_step(batches)
    trainer.train_step(batches)
    assert calls == [1] and not trainer.compiled
    assert messages == ["torch.compile failed (RuntimeError: no C++ compiler found); training without it"]
    assert first["step"] == 1 and math.isfinite(first["loss"]) and trainer.step == 2


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor needs a C++ compiler on a CPU")
def test_compiled_training_computes_the_eager_loss(tmp_path):
    """With --compile the step's forward runs through inductor: the loss and gradients of the eager forward up
    to float rounding."""
    from tests.conftest import tiny_target

    model = tiny_target("llama")
    seqs = tiny_corpus(model, 6, seed=5, new_tokens=12)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        trainer = make_trainer(tmp_path / str(compiled), model, seqs, compile=compiled, precision="fp32")
        loss, _ = trainer.loss_on(trainer.train_seqs[:3])
        loss.backward()
        assert trainer.compiled == compiled
        results.append((loss.detach(), trainer.drafter.fc.weight.grad.clone()))
    (l1, g1), (l2, g2) = results
    assert torch.allclose(l1, l2, rtol=1e-4) and torch.allclose(g1, g2, rtol=1e-3, atol=1e-6)


def test_every_trainable_parameter_gets_a_gradient(tmp_path):
    """The learned mask vector included: it was once cut off by a detach of the whole block embedding and
    stayed at its initial value through every training run."""
    from tests.conftest import tiny_target

    model = tiny_target("llama")
    trainer = make_trainer(tmp_path, model, tiny_corpus(model, 6, seed=3, new_tokens=12))
    assert trainer.drafter.mask_embedding is not None and trainer.drafter.mask_embedding.requires_grad
    loss, _ = trainer.loss_on(trainer.train_seqs[:3])
    loss.backward()
    missing = [
        n
        for n, p in trainer.drafter.named_parameters()
        if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)
    ]
    assert missing == []
    assert model.get_input_embeddings().weight.grad is None  # the target's table stays frozen
    before = trainer.drafter.mask_embedding.detach().clone()
    trainer.opt.step()
    assert not torch.equal(before, trainer.drafter.mask_embedding.detach())


def test_stop_signal_checkpoints_the_step_in_progress(tmp_path):
    """SIGINT/SIGTERM during training: the current step finishes, is checkpointed, and the run resumes there."""
    import os
    import signal

    from tests.conftest import tiny_target

    model = tiny_target("llama")
    seqs = tiny_corpus(model, 12, seed=2, new_tokens=16)
    trainer = make_trainer(tmp_path / "run", model, seqs, steps=8, checkpoint_every=100)
    before_step(trainer, 4, lambda: os.kill(os.getpid(), signal.SIGTERM))  # arrives in the middle of step 5
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        trainer.run(resume=False, progress=False)
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 5  # no checkpoint was due before step 100: the stop saved it
    resumed = make_trainer(tmp_path / "run", model, seqs, steps=8, checkpoint_every=100)
    assert resumed.resume() and resumed.step == 5


def test_resume_continues_with_the_same_state(tmp_path):
    from tests.conftest import tiny_target

    model = tiny_target("qwen3")
    seqs = tiny_corpus(model, 12, seed=1, new_tokens=16)
    straight = make_trainer(tmp_path / "a", model, seqs, steps=6, checkpoint_every=3)
    straight.run(resume=False, progress=False)

    first = make_trainer(tmp_path / "b", model, seqs, steps=6, checkpoint_every=3)
    before_step(first, 4, process_dies)
    with pytest.raises(KeyboardInterrupt):
        first.run(resume=False, progress=False)
    first_state = torch.load(tmp_path / "b" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert first_state["step"] == 3
    resumed = make_trainer(tmp_path / "b", model, seqs, steps=6, checkpoint_every=3)
    assert resumed.resume() and resumed.step == 3
    state_a = first_state["optimizer"]["state"]
    state_b = resumed.opt.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for i in state_a:
        torch.testing.assert_close(state_a[i]["exp_avg"], state_b[i]["exp_avg"])
    resumed.run(resume=False, progress=False)
    for (name, p), q in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        torch.testing.assert_close(p, q, msg=f"{name} differs after resume")


def test_lr_schedule_warms_up_then_decays_to_zero_over_the_given_total():
    from dflashkit.training.trainer import TrainConfig, lr_at

    cfg = TrainConfig(data_dir="", out_dir="unused", steps=1000, lr=1e-3, warmup_ratio=0.1)
    assert lr_at(0, cfg, 50) == pytest.approx(1e-3 / 5) and lr_at(4, cfg, 50) == pytest.approx(1e-3)  # 5 warmup steps
    assert lr_at(49, cfg, 50) < 2e-5 and lr_at(27, cfg, 50) == pytest.approx(5e-4, rel=0.05)  # half-way down
    assert lr_at(49, cfg) == pytest.approx(5e-4) and lr_at(999, cfg) == lr_at(999, cfg, 1000)  # default: cfg.steps


class FakeClock:
    """dflashkit.training.trainer's `time`: perf_counter moves only when a test step says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def clocked_steps(trainer, clock: FakeClock, seconds_per_step) -> None:
    """Each training step of `trainer` takes seconds_per_step(step) on `clock`."""
    real_step = trainer.train_step

    def step(batch_iter):
        clock.now += seconds_per_step(trainer.step)
        return real_step(batch_iter)

    trainer.train_step = step


def costly_features(trainer, clock: FakeClock, monkeypatch, seconds_per_sequence: float) -> None:
    """The target's features for `trainer` cost seconds_per_sequence per sequence computed, on `clock`."""
    features = trainer.target.features

    def slow_features(rows):
        clock.now += rows.shape[0] * seconds_per_sequence
        return features(rows)

    monkeypatch.setattr(trainer.target, "features", slow_features)


def test_a_time_budget_sizes_the_schedule_to_the_measured_step_rate(tmp_path, monkeypatch):
    """--time-budget: after the first steps the schedule's length is fixed to what fits the rest of the budget at the
    measured rate (here 1 s per step, 40 s: 39 steps), and the cosine decay ends on the last one."""
    import dflashkit.training.trainer
    from tests.conftest import tiny_target

    clock = FakeClock()
    monkeypatch.setattr(dflashkit.training.trainer, "time", clock)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 12, seed=3, new_tokens=16)
    # before the measurement the schedule is --steps long (here its warmup: 3 steps), then as measured
    trainer = make_trainer(tmp_path / "run", model, seqs, steps=60, time_budget_s=40.0, warmup_ratio=0.05)
    clocked_steps(trainer, clock, lambda step: 1.0)
    trainer.run(resume=False, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    # the rate is measured from step 3 on (the feature cache full: 11 sequences, 4 per step), over >= 5 steps and
    # >= 4 s (10% of the budget): at step 8, 8 + int(0.97 x 32) = 39
    assert trainer.total_steps == 39 and [r["step"] for r in log] == list(range(1, 40))
    assert log[-1]["lr"] < 0.01 * trainer.cfg.lr and max(r["lr"] for r in log) == pytest.approx(trainer.cfg.lr)
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 39 and state["total_steps"] == 39
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()


def test_a_spent_time_budget_stops_with_a_checkpoint_that_resumes_the_same_schedule(tmp_path, monkeypatch):
    """Steps that slow down after the measurement: the run stops when the budget is spent (checkpointed, the
    drafter written), and the same command resumes with the schedule's length unchanged."""
    import dflashkit.training.trainer
    from tests.conftest import tiny_target

    clock = FakeClock()
    monkeypatch.setattr(dflashkit.training.trainer, "time", clock)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 12, seed=4, new_tokens=16)
    trainer = make_trainer(tmp_path / "run", model, seqs, steps=60, time_budget_s=40.0, checkpoint_every=100)
    clocked_steps(trainer, clock, lambda step: 1.0 if step < 8 else 3.0)  # measured at 1 s, then 3 s per step
    trainer.run(resume=False, progress=False)
    # 39 steps planned at step 8 (t = 8 s); then 3 s per step: the budget ends at step 19 (t = 41 s)
    assert trainer.total_steps == 39 and trainer.step == 19
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 19 and state["total_steps"] == 39
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()
    lr_at_stop = json.loads((tmp_path / "run" / "train_log.jsonl").read_text().splitlines()[-1])["lr"]
    resumed = make_trainer(tmp_path / "run", model, seqs, steps=60, time_budget_s=40.0, checkpoint_every=100)
    clocked_steps(resumed, clock, lambda step: 1.0)
    resumed.run(resume=True, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert resumed.step == 39 and [r["step"] for r in log] == list(range(1, 40))  # 20 more steps fit in 40 s
    assert log[19]["lr"] < lr_at_stop and log[-1]["lr"] < 0.01 * resumed.cfg.lr  # the same decay, continued


def test_a_time_budget_measures_the_rate_once_the_feature_cache_is_full(tmp_path, monkeypatch):
    """A CPU run's first epoch computes the features (slow steps); the steps after it set the schedule."""
    import dflashkit.training.trainer
    from tests.conftest import tiny_target

    clock = FakeClock()
    monkeypatch.setattr(dflashkit.training.trainer, "time", clock)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 12, seed=5, new_tokens=16)
    trainer = make_trainer(tmp_path / "run", model, seqs, steps=200, time_budget_s=60.0)
    assert trainer.store is not None and len(trainer.store) == 11  # 11 training sequences: 3 steps an epoch
    clocked_steps(trainer, clock, lambda step: 5.0 if step < 3 else 1.0)  # first epoch: 5 s a step
    trainer.run(resume=False, progress=False)
    # measured from step 3 (t = 15 s) to step 8 (t = 20 s): 1 step/s, so 8 + int(0.97 x 40) = 46 (the first epoch's
    # rate, 0.2 steps/s, would have planned 15)
    assert trainer.total_steps == 46 and trainer.step == 46
    # a budget half spent before the cache is full: fixed then, at the rate since the first step
    clock = FakeClock()
    monkeypatch.setattr(dflashkit.training.trainer, "time", clock)
    trainer = make_trainer(tmp_path / "run2", model, seqs, steps=200, time_budget_s=20.0)
    clocked_steps(trainer, clock, lambda step: 5.0 if step < 3 else 1.0)
    trainer.run(resume=False, progress=False)
    assert trainer.total_steps == trainer.step == 2 + int(0.97 * (2 / 10) * 10)  # at step 2, t = 10 s


def test_a_budget_half_spent_while_the_cache_fills_leaves_the_compiling_steps_out_of_its_rate(tmp_path, monkeypatch):
    """--compile: the first two steps compile (20 s each here). With the cache still filling at half the budget, the
    plan takes the step rate after them (1 s a step without its features), not one that counts the compiling."""
    import dflashkit.training.trainer
    from tests.conftest import tiny_target

    clock = FakeClock()
    monkeypatch.setattr(dflashkit.training.trainer, "time", clock)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 40, seed=6, new_tokens=16)
    trainer = make_trainer(tmp_path / "run", model, seqs, steps=200, time_budget_s=100.0)
    assert len(trainer.store) == 36  # 9 steps an epoch at 4 sequences
    costly_features(trainer, clock, monkeypatch, seconds_per_sequence=1.0)
    clocked_steps(trainer, clock, lambda step: 20.0 if step < 2 else 1.0)
    trainer.run(resume=False, progress=False)
    # half the budget is gone at step 3 (t = 2 x (20 + 4) + 1 + 4 = 53 s): 1 step/s since step 2 without the
    # features, 24 sequences' features (24 s) to come: 3 + int(0.97 x (100 - 53 - 24)) = 25 steps (counting the
    # compiling steps: 3 steps in 41 s of step work, 0.07 steps/s, would have planned 4), and they fit: t = 99 s
    assert trainer.total_steps == trainer.step == 25 and clock.now - 1000.0 == pytest.approx(99.0)


def test_a_budget_half_spent_while_the_cache_fills_plans_the_rest_at_the_cached_rate(tmp_path, monkeypatch):
    """Features that cost 1 s per sequence, steps 1 s without them: at half the budget (step 2, 8 of 11 sequences
    cached) the plan counts the 3 features still to compute and the steps at 1 s each, not the 5 s filling steps."""
    import dflashkit.training.trainer
    from tests.conftest import tiny_target

    clock = FakeClock()
    monkeypatch.setattr(dflashkit.training.trainer, "time", clock)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 12, seed=5, new_tokens=16)
    trainer = make_trainer(tmp_path / "run", model, seqs, steps=200, time_budget_s=20.0)
    costly_features(trainer, clock, monkeypatch, seconds_per_sequence=1.0)
    clocked_steps(trainer, clock, lambda step: 1.0)
    trainer.run(resume=False, progress=False)
    # at step 2, t = 10 s: 2 steps in 10 - 8 s of step work (1 step/s), 3 sequences' features (3 s) still to come:
    # 2 + int(0.97 x (10 - 3)) = 8 steps (the filling steps' rate, 0.2 steps/s, would have planned 3), and they fit:
    # step 3 takes 1 + 3 s, steps 4-8 1 s each, t = 19 s
    assert trainer.total_steps == trainer.step == 8 and clock.now - 1000.0 == pytest.approx(19.0)
    assert bool(trainer.store.filled.all())


def test_cached_features_give_the_same_loss(tmp_path):
    from tests.conftest import tiny_target

    model = tiny_target("llama")
    seqs = tiny_corpus(model, 6, seed=2, new_tokens=12)
    losses = []
    for cache, folder in ((False, "plain"), (True, "cached"), (True, "cached")):  # uncached, fill, read back
        trainer = make_trainer(tmp_path / folder, model, [*seqs], cache_features=cache)
        trainer.gen.manual_seed(5)
        if cache and len(losses) == 2:
            filled = [trainer.store.has(i) for i in range(len(trainer.train_seqs))]
            assert filled[:3] == [True] * 3 and not any(filled[3:])
        loss, _ = trainer.loss_on(trainer.train_seqs[:3])
        losses.append(float(loss.detach()))
        if cache:
            trainer.store.commit()
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) and losses[1] == pytest.approx(losses[2], abs=1e-6)


def test_cli_data_then_train_then_generate(tmp_path, monkeypatch, capsys):
    import dflashkit.target.loading
    from dflashkit.cli.main import main
    from dflashkit.training import sources as data
    from dflashkit.training.evalsets import available_sets
    from tests.training.test_sources import EVAL, make_model, make_tokenizer, word_prompts, write_jsonl

    torch.set_num_threads(1)
    monkeypatch.setattr(
        dflashkit.target.loading,
        "load_target",
        lambda name=None, *, dtype=torch.bfloat16, device="cpu", progress=False, quantize=None: (
            make_model(dtype),
            make_tokenizer(),
        ),
    )
    monkeypatch.setattr(data, "evaluation_prompts", lambda: EVAL)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in word_prompts(24, seed=1)])
    d, out = tmp_path / "data", tmp_path / "run"
    assert (
        main(
            [
                "data",
                "--out",
                str(d),
                "--sources",
                f"jsonl:{src}",
                "--num-prompts",
                "24",
                "--max-new-tokens",
                "12",
                "--batch-size",
                "8",
                "--no-progress",
                "--min-chars",
                "1",
            ]
        )
        == 0
    )
    (d / "prompts.jsonl").unlink()  # training reads meta.json and the shards: a folder packed without the list trains
    train_args = [
        "train",
        "--data",
        str(d),
        "--out",
        str(out),
        "--layers",
        "1",
        "--block-size",
        "4",
        "--steps",
        "4",
        "--anchors",
        "4",
        "--seqs-per-step",
        "4",
        "--eval-every",
        "2",
        "--checkpoint-every",
        "2",
        "--draft-vocab",
        "0",
    ]
    assert main(train_args) == 0
    assert capsys.readouterr().out.strip().endswith("drafter")
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert (
        [r["step"] for r in log] == [1, 2, 3, 4]
        and "tau" in log[1]
        and len(log[1]["heldout_acc"]) == 3
        and log[1]["heldout_loss"] > 0
        and len(log[0]["acc"]) == 3
    )
    assert main(train_args) == 0  # finished run: resumes at step 4 and only re-saves the drafter
    assert "resumed at step 4" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "tell me about the sea",
                "--drafter",
                str(out / "drafter"),
                "--max-new-tokens",
                "6",
                "--compare-ar",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["block_size"] == 4 and result["speculative"]
    distilled = tmp_path / "run-distilled"  # the same with the target's distribution as soft labels
    eval_sets = ["--eval-sets", "mt-bench", "--eval-set-prompts", "2"] if "mt-bench" in available_sets() else []
    assert (
        main(
            [
                *train_args[:4],
                str(distilled),
                *train_args[5:],
                "--distill-topk",
                "6",
                "--distill-weight",
                "0.7",
                "--loss-weighting",
                "dpace",
                "--dpace-alpha",
                "0.4",
                *eval_sets,
            ]
        )
        == 0
    )
    log = [json.loads(x) for x in (distilled / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["soft_loss"] > 0 and (distilled / "soft-labels" / "meta.json").is_file()
    config = json.loads((distilled / "run_config.json").read_text())["config"]
    assert (config["loss_weighting"], config["dpace_alpha"]) == ("dpace", 0.4)
    if eval_sets:  # τ on MT-Bench prompts at each evaluation, beside the held-out training prompts' τ
        assert [set(r.get("tau_sets", {})) for r in log] == [set(), {"mt-bench"}, set(), {"mt-bench"}]
        assert all(r["tau_sets"]["mt-bench"] >= 1.0 for r in log if "tau_sets" in r)
    recorded = json.loads((out / "run_config.json").read_text())  # settings and machine, for model cards
    assert recorded["config"]["steps"] == 4 and recorded["config"]["block_size"] == 4 and recorded["machine"]
    assert (out / "features").is_dir()  # auto on the CPU: features cached; off: a target pass every step, no store
    uncached = tmp_path / "run-uncached"
    assert main([*train_args[:4], str(uncached), *train_args[5:], "--distill-topk", "6", "--feature-cache", "off"]) == 0
    assert (uncached / "drafter" / "model.safetensors").is_file()
    assert not (uncached / "features").exists() and not (uncached / "soft-labels").exists()


def test_load_sequences_from_several_folders(tmp_path):
    from dflashkit.training import sources as data
    from dflashkit.training.dataset import load_sequences
    from tests.training.test_sources import make_model, make_tokenizer, word_prompts

    model, tok = make_model(), make_tokenizer()
    for name, seed in (("a", 1), ("b", 2)):
        data.regenerate(
            model, tok, word_prompts(4, seed=seed), tmp_path / name, batch_size=4, max_new_tokens=6, progress=False
        )

    def plain(seqs):
        return [(s.input_ids, s.num_prompt) for s in seqs]

    a, b = load_sequences(tmp_path / "a", 64), load_sequences(tmp_path / "b", 64)
    both = load_sequences(f"{tmp_path / 'a'},{tmp_path / 'b'}", 64)
    assert a and b and plain(both) == plain(a) + plain(b)
    assert [s.source for s in both] == [0] * len(a) + [1] * len(b)
    again = load_sequences(f"{tmp_path / 'a'},{tmp_path / 'b'},{tmp_path / 'a'}", 64)
    assert plain(again) == plain(a) + plain(b)  # repeats used once
    with pytest.raises(data.DataError):
        load_sequences(f"{tmp_path / 'a'},{tmp_path / 'missing'}", 64)


def test_init_from_a_trained_drafter_keeps_weights_and_draft_vocabulary(tmp_path):
    from dflashkit.drafter.checkpoint import load_drafter, save_drafter
    from dflashkit.errors import IncompatibleDrafterError, InvalidInputError
    from tests.conftest import tiny_target

    model = tiny_target("llama")
    seqs = tiny_corpus(model, 8, seed=3, new_tokens=12)
    first = make_trainer(tmp_path / "a", model, [*seqs], steps=3, draft_vocab_size=40)
    first.run(resume=False, progress=False)
    save_drafter(first.drafter, tmp_path / "d")
    more = tiny_corpus(model, 8, seed=9, new_tokens=12)  # other data: its own top-40 would differ
    second = make_trainer(tmp_path / "b", model, [*more], init_drafter=str(tmp_path / "d"), draft_vocab_size=40)
    assert second.drafter.config.draft_vocab == first.drafter.config.draft_vocab
    saved = load_drafter(tmp_path / "d", dtype=torch.float32)
    assert saved.config.context_window == first.cfg.max_seq_len  # it never trained on longer contexts
    for (name, p), q in zip(saved.state_dict().items(), second.drafter.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    with pytest.raises(InvalidInputError, match="num_hidden_layers"):  # fewer layers than the drafter: refused
        make_trainer(tmp_path / "c", model, [*more], init_drafter=str(tmp_path / "d"), num_layers=1)
    with pytest.raises(IncompatibleDrafterError):
        make_trainer(tmp_path / "e", tiny_target("llama", seed=7), [*more], init_drafter=str(tmp_path / "d"))


def trained_and_saved(tmp_path, model, seqs):
    """A 2-layer drafter trained for 3 steps and saved to tmp_path / "d" (what --init continues from)."""
    from dflashkit.drafter.checkpoint import save_drafter

    first = make_trainer(tmp_path / "a", model, [*seqs], steps=3)
    first.run(resume=False, progress=False)
    save_drafter(first.drafter, tmp_path / "d")
    return first


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


def test_trainer_records_the_data_it_used(tmp_path):
    import json

    from dflashkit.training import sources as data
    from dflashkit.training.trainer import TrainConfig, Trainer
    from tests.training.test_sources import make_model, make_tokenizer, word_prompts

    model, tok = make_model(), make_tokenizer()
    for name, n in (("a", 5), ("b", 3)):
        data.regenerate(
            model, tok, word_prompts(n, seed=n), tmp_path / name, batch_size=8, max_new_tokens=6, progress=False
        )
    cfg = TrainConfig(
        data_dir=f"{tmp_path / 'a'},{tmp_path / 'b'}",
        out_dir=str(tmp_path / "run"),
        num_layers=1,
        block_size=4,
        draft_vocab_size=None,
        max_seq_len=64,
    )
    trainer = Trainer(cfg, model, tok, log=lambda *_: None)
    used = json.loads((tmp_path / "run" / "data_used.json").read_text())
    assert [u["folder"] for u in used] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert sum(u["sequences"] for u in used) == len(trainer.eval_seqs) + len(trainer.train_seqs)
    assert all(u["sequences"] > 0 and u["response_tokens"] >= 2 * u["sequences"] for u in used)


def test_several_answers_to_a_prompt_are_kept_once_each(monkeypatch):
    """Sampled regenerations give a prompt several answers: each distinct one trains; repeats and prefixes of a
    kept answer do not; a longer answer replaces the prefix it extends."""
    from dflashkit.training import sources as data
    from dflashkit.training.dataset import load_sequences

    folders = {
        "a": [{"prompt_ids": [1, 2], "response_ids": [5, 6, 7]}, {"prompt_ids": [3], "response_ids": [8, 9]}],
        "b": [
            {"prompt_ids": [1, 2], "response_ids": [5, 6, 7]},  # the same answer again
            {"prompt_ids": [1, 2], "response_ids": [5, 6]},  # a prefix of it (shorter length limit)
            {"prompt_ids": [1, 2], "response_ids": [6, 6, 6]},  # another (sampled) answer
            {"prompt_ids": [3], "response_ids": [8, 9, 10, 11]},
        ],  # extends a kept answer
    }
    monkeypatch.setattr(data, "load_shards", lambda folder, **_: iter(folders[Path(folder).name]))
    seqs = load_sequences("a,b", 64)
    assert [(s.input_ids, s.num_prompt, s.source) for s in seqs] == [
        ([1, 2, 5, 6, 7], 2, 0),
        ([1, 2, 6, 6, 6], 2, 1),
        ([3, 8, 9, 10, 11], 1, 0),
    ]


def test_held_out_prompts_never_train_with_another_answer(tmp_path):
    from dflashkit.training.dataset import TrainingSequence
    from dflashkit.training.trainer import TrainConfig, Trainer
    from tests.conftest import tiny_target, word_tokenizer

    seqs = [TrainingSequence([4, 5, 6, 7, 8, 9], 2), TrainingSequence([10, 11, 12, 13], 1)] * 6
    seqs += [TrainingSequence([4, 5, 20, 21, 22], 2)]  # another answer to the first (held-out) prompt
    cfg = TrainConfig(
        data_dir="unused", out_dir=str(tmp_path / "run"), steps=1, eval_prompts=1, num_layers=1, block_size=4
    )
    trainer = Trainer(cfg, tiny_target("llama"), word_tokenizer(), sequences=seqs, log=lambda *a: None)
    held_out = {tuple(s.input_ids[: s.num_prompt]) for s in trainer.eval_seqs}
    assert held_out == {(4, 5)}
    assert trainer.train_seqs and all(tuple(s.input_ids[: s.num_prompt]) not in held_out for s in trainer.train_seqs)


# ---- distillation: the target's own distribution as soft labels ---------------------------------------


def test_soft_targets_and_loss_equal_a_naive_computation():
    from dflashkit.training.losses import soft_block_loss, soft_block_targets

    torch.manual_seed(1)
    S, L, B, V, K = 2, 10, 4, 9, 3
    full = torch.randn(S, L, V).log_softmax(-1)  # the target's log-probabilities after each position
    top = full.topk(K, -1)
    anchors = torch.tensor([[0, 3, 5], [1, 2, 6]])
    column_of = torch.tensor([0, 1, 2, 3, 4, 5, -1, -1, -1])  # a draft vocabulary of the first 6 tokens
    columns, probs = soft_block_targets(top.indices, top.values, anchors, B, column_of)
    logits = torch.randn(S, 3, B - 1, 6)
    weights = torch.rand(S, 3, B - 1) * (torch.rand(S, 3, B - 1) > 0.2)
    num = den = 0.0
    for s in range(S):
        for n in range(3):
            for k in range(1, B):
                row = min(int(anchors[s, n]) + k - 1, L - 1)  # the prediction of the token at anchor+k
                p = {int(t): math.exp(float(lp)) for t, lp in zip(top.indices[s, row], top.values[s, row]) if t < 6}
                total = sum(p.values())
                logq = logits[s, n, k - 1].log_softmax(-1)
                ce = -sum(v / total * float(logq[t]) for t, v in p.items()) if total else 0.0
                if total:
                    assert float(probs[s, n, k - 1].sum()) == pytest.approx(1.0, abs=1e-6)
                w = float(weights[s, n, k - 1])
                num, den = num + w * ce, den + w
    assert float(soft_block_loss(logits, columns, probs, weights)) == pytest.approx(num / den, abs=1e-5)


def test_top_logprobs_are_the_target_distribution(tmp_path):
    from dflashkit.target.adapter import TargetAdapter
    from tests.conftest import tiny_target

    model = tiny_target("llama")
    target = TargetAdapter(model, [1, 3])
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    feats, top_ids, top_lp = target.features_and_top_logprobs(ids, 5, chunk=4)  # chunks that cut a sequence
    torch.testing.assert_close(feats, target.features(ids))
    with torch.no_grad():
        full = model(ids).logits.float().log_softmax(-1)
    expect = full.topk(5, -1)
    assert torch.equal(top_ids, expect.indices)
    torch.testing.assert_close(top_lp, expect.values, rtol=1e-5, atol=1e-5)
    # only the rows asked for (a training batch's: those whose next token carries loss); the others carry no mass
    positions = torch.rand(2, 7, generator=torch.Generator().manual_seed(1)) < 0.5
    _, some_ids, some_lp = target.features_and_top_logprobs(ids, 5, chunk=4, positions=positions)
    assert torch.equal(some_ids[positions], top_ids[positions])
    torch.testing.assert_close(some_lp[positions], top_lp[positions], rtol=1e-5, atol=1e-5)
    assert (some_ids[~positions] == 0).all() and torch.isneginf(some_lp[~positions]).all()
    _, none_ids, none_lp = target.features_and_top_logprobs(ids, 5, positions=torch.zeros(2, 7, dtype=torch.bool))
    assert none_ids.shape == (2, 7, 5) and torch.isneginf(none_lp).all()


def test_soft_labels_only_where_loss_is_read_leave_the_loss_and_gradients_unchanged(tmp_path):
    """The trainer computes soft labels only at rows whose next token carries loss: the loss and the gradients
    equal those with soft labels at every row (fp32), with and without the feature cache."""
    from tests.conftest import tiny_target

    torch.manual_seed(0)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 12, seed=3)
    for cached in (False, True):
        results = []
        for every_row in (True, False):
            torch.manual_seed(1)  # the same drafter initialisation for both
            trainer = make_trainer(
                tmp_path / f"{cached}-{every_row}",
                model,
                [*seqs],
                distill_topk=8,
                cache_features=cached,
                precision="fp32",
            )
            if every_row:  # the old behaviour: no loss mask reaches the target, so every row gets soft labels
                inner = trainer.batch_features
                trainer.batch_features = lambda batch, ids, loss_mask=None, inner=inner: inner(batch, ids)
            trainer.gen.manual_seed(5)
            loss, info = trainer.loss_on(trainer.train_seqs[:4])
            loss.backward()
            grads = [p.grad.clone() for p in trainer.drafter.parameters() if p.grad is not None]
            results.append((float(loss.detach()), info["soft_loss"], grads))
        (loss_all, soft_all, grads_all), (loss_some, soft_some, grads_some) = results
        assert soft_all > 0 and loss_some == pytest.approx(loss_all, rel=1e-6, abs=1e-6)
        assert soft_some == pytest.approx(soft_all, rel=1e-6, abs=1e-6)
        assert len(grads_all) == len(grads_some) > 0
        for a, b in zip(grads_all, grads_some):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_distillation_trains_caches_its_soft_labels_and_raises_tau(tmp_path):
    from tests.conftest import tiny_target

    torch.manual_seed(0)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 44, seed=0)
    losses = []
    for folder in ("plain", "cached"):  # soft labels computed, then read back from OUT/soft-labels
        trainer = make_trainer(tmp_path / folder, model, [*seqs], distill_topk=8, cache_features=folder == "cached")
        trainer.gen.manual_seed(5)
        loss, info = trainer.loss_on(trainer.train_seqs[:3])
        losses.append(float(loss.detach()))
        assert 0 < info["soft_loss"] and 0 < info["hard_loss"]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert trainer.soft_store is not None and trainer.soft_store.num_filled == 3
    tau_before = trainer.estimate_tau(max_new_tokens=32)
    trainer.run(resume=False, progress=False)
    assert tau_before + 0.5 < trainer.estimate_tau(max_new_tokens=32)
    log = [json.loads(line) for line in (tmp_path / "cached" / "train_log.jsonl").read_text().splitlines()]
    assert {"hard_loss", "soft_loss"} <= set(log[-1]) and log[-1]["soft_loss"] < log[0]["soft_loss"]
    with pytest.raises(Exception, match="distillation"):
        make_trainer(tmp_path / "bad", model, seqs, distill_topk=4, distill_weight=1.5)


def test_block_hidden_is_each_block_run_alone_over_the_context_before_its_anchor():
    """The teacher-forced hidden states training scores: block n (its anchor token, then masks, at positions
    anchor..anchor+B-1) sees exactly the injected context of positions < anchor; from features or their context."""
    from dflashkit.target.adapter import TargetAdapter
    from tests.conftest import tiny_drafter, tiny_target

    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=4)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    features = target.features(ids)  # [1, 20, F]
    anchors, keep = torch.tensor([[2, 9, 15]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        got = block_hidden(drafter, ids, anchors, keep, target.embed_tokens, features=features)  # [1, 3, 3, H]
        context = drafter.context_key_values(features, torch.arange(20))
        assert torch.equal(block_hidden(drafter, ids, anchors, keep, target.embed_tokens, context=context), got)
        for n, a in enumerate(anchors[0].tolist()):
            block = torch.full((1, 4), drafter.config.mask_token_id)
            block[0, 0] = ids[0, a]
            alone = drafter(
                drafter.embed(block, target.embed_tokens),
                torch.arange(a, a + 4),
                drafter.context_key_values(features[:, :a], torch.arange(a)),
            )[0, 1:]
            torch.testing.assert_close(got[0, n], alone, rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidInputError, match="features"):
        block_hidden(drafter, ids, anchors, keep, target.embed_tokens)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"gamma": 0.0}, "gamma"),
        ({"gamma": float("nan")}, "gamma"),
        ({"gamma": -3.0}, "gamma"),
        ({"lr": -1.0}, "lr"),
        ({"warmup_ratio": 5.0}, "warmup_ratio"),
        ({"draft_vocab_size": -1}, "draft_vocab_size"),
        ({"block_size": 1}, "block_size"),
        ({"steps": 0}, "steps"),
        ({"target_layer_ids": []}, "target_layer_ids"),
        ({"distill_weight": 2.0}, "distill_weight"),
        ({"precision": "fp16"}, "precision"),
        ({"eval_sets": ["gsm8k"]}, "eval_sets"),
        ({"eval_sets": []}, "eval_sets"),
        ({"time_budget_s": 0.0}, "time_budget_s"),
        ({"time_budget_s": float("inf")}, "time_budget_s"),
    ],
)
def test_train_config_refuses_settings_that_train_nothing_useful(tmp_path, overrides, field):
    """A NaN loss (gamma 0), a negative rate...: refused before anything runs or is written."""
    from dflashkit.errors import InvalidInputError
    from dflashkit.training.trainer import TrainConfig

    with pytest.raises(InvalidInputError, match=field):
        TrainConfig(data_dir="", out_dir=str(tmp_path / "run"), **overrides)
    assert not (tmp_path / "run").exists()


def test_train_cli_bad_flags_fail_before_loading(tmp_path, capsys, monkeypatch):
    import dflashkit.target.loading
    from dflashkit.cli.main import main

    monkeypatch.setattr(dflashkit.target.loading, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "prompts.jsonl").write_text('{"prompt": "hi"}\n')  # prompts but no answers: nothing to train on
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run")]) == 2
    assert "no training data" in capsys.readouterr().err
    (data / "meta.json").write_text("{}")
    (tmp_path / "a-file").write_text("x")
    for flags, message in (
        (["--target-layers", "abc"], "--target-layers"),
        (["--gamma", "0"], "gamma"),
        (["--lr", "-1"], "lr"),
        (["--out", str(tmp_path / "a-file")], "is a file"),
        (["--time-budget", "0"], "time_budget_s"),
    ):
        out = [] if "--out" in flags else ["--out", str(tmp_path / "run")]
        assert main(["train", "--data", str(data), *out, *flags]) == 2
        assert message in capsys.readouterr().err, flags


def test_batches_padded_to_a_multiple_train_the_same(tmp_path, monkeypatch):
    """A GPU pads a batch to a multiple of 16 positions (fewer distinct shapes): with the same anchors the loss and
    the gradients equal those of the unpadded batch (fp32, distilled, with data parallel's trimming too)."""
    from dflashkit.training import trainer as train_module
    from dflashkit.training.dataset import collate, padded_length
    from tests.conftest import tiny_target

    torch.manual_seed(0)
    model = tiny_target("llama")
    seqs = tiny_corpus(model, 12, seed=4)
    ids, mask, lengths = collate(seqs[:3], 0, 16)
    longest = int(lengths.max())
    assert ids.shape[1] % 16 == 0 and 0 < ids.shape[1] - longest < 16 and not mask[:, longest:].any()
    assert padded_length(17, 16) == 32 and padded_length(32, 16) == 32 and padded_length(5, 1) == 5
    real_sampler = train_module.sample_anchors

    def same_anchors(loss_mask, num_anchors, generator=None):  # drawn over the unpadded width either way
        width = int(loss_mask.any(0).nonzero().max()) + 1
        return real_sampler(loss_mask[:, :width], num_anchors, generator)

    monkeypatch.setattr(train_module, "sample_anchors", same_anchors)
    results = []
    for multiple in (1, 16):
        torch.manual_seed(1)
        trainer = make_trainer(tmp_path / str(multiple), model, [*seqs], distill_topk=8, precision="fp32")
        trainer.pad_multiple = multiple
        trainer.gen.manual_seed(5)
        loss, info = trainer.loss_on(trainer.train_seqs[:4])
        loss.backward()
        grads = [p.grad.clone() for p in trainer.drafter.parameters() if p.grad is not None]
        results.append((float(loss.detach()), grads))
    (loss_1, grads_1), (loss_16, grads_16) = results
    assert loss_16 == pytest.approx(loss_1, rel=1e-6, abs=1e-6) and len(grads_1) == len(grads_16) > 0
    for a, b in zip(grads_1, grads_16):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

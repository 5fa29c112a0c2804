"""The embedded backend: SmolLM2-135M-Instruct on CPU, in process, sampled by hand.

Generation runs in a worker thread behind ``trio.CapacityLimiter(1)`` (one generation at a
time; torch uses ``threads`` intra-op threads). It is cancellable: cancelling
:meth:`TransformersBackend.complete` sets a flag the thread checks between tokens, so the
thread stops within one forward pass (and the next request waits for it).

Sampling is done here, not by ``generate()``, so we know exactly which distribution each token
was drawn from. Per step, on float32 logits: repetition penalty (over prompt and output, as
vLLM does), temperature, top-k, top-p, min-p, in that order. The token is drawn from the
softmax of the processed logits, and its returned logprob is ``log_softmax(processed)[id]``:
the logprob of the distribution actually sampled from (vLLM's ``processed_logprobs``). With
``temperature == 0`` the token is the argmax and the logprob is taken at temperature 1 after
the same filters.

Generation stops at ``max_tokens`` (``length``), at a stop id (``params.stop_token_ids`` plus
the tokenizer's EOS, as vLLM; the stop token is returned, ``stop``), or on cancel (``abort``).
A KV cache is used across the tokens of a turn and, when the next prompt extends the previous
one (the next turn of the same rollout), across turns too.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

import rolloutd.daemon.llm._embedded as _embedded
from rolloutd.daemon.llm.base import BackendRejected, BackendUnavailable, Completion, SamplingParams
from rolloutd.daemon.llm.weights import load_weights


@dataclass
class _Result:
    ids: list[int]
    logprobs: list[float]
    finish: str
    cached: int
    seconds: float


def process_logits(logits: Any, params: SamplingParams, seen: Any) -> Any:
    """The processed logits the token is sampled from (float32, -inf where filtered)."""
    import torch

    x = logits.float().clone()
    if params.repetition_penalty != 1.0 and seen.numel():
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if params.temperature > 0:
        x = x / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = (cum - probs) > params.top_p  # keep the smallest set whose mass reaches top_p
        drop[0] = False
        x = x.clone()
        x[order[drop]] = float("-inf")
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return x


def cache_keyword(model: Any) -> str:
    """The name of ``model.forward``'s KV-cache argument: ``cache`` since transformers 5.x
    renamed ``past_key_values`` (the old name warns), ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The KV cache of a forward pass's output, under either name (see ``cache_keyword``)."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


class _Generator:
    """The model and its prefix cache; only ever used by one thread at a time."""

    def __init__(self, model: Any, eos_ids: Sequence[int]) -> None:
        self.model = model
        self._cache_kw = cache_keyword(model)
        self.eos_ids = set(eos_ids)
        self._cache_ids: list[int] = []
        self._past: Any = None
        self._seeds = random.Random()

    def _prefill(self, prompt: list[int]) -> tuple[Any, int]:
        import torch

        common = 0
        for a, b in zip(self._cache_ids, prompt, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        past = None
        if self._past is not None and common > 0:
            try:
                held = int(self._past.get_seq_length())
                if held != len(self._cache_ids):
                    raise ValueError("cache and ids disagree")
                if held > common:
                    self._past.crop(-(held - common))  # negative: remove that many (all versions)
                past = self._past
            except (AttributeError, ValueError):
                common = 0
        else:
            common = 0
        self._past = None
        self._cache_ids = []
        inp = torch.tensor([prompt[common:]], dtype=torch.long)
        out = self.model(input_ids=inp, **{self._cache_kw: past}, use_cache=True)
        self._past = returned_cache(out)
        self._cache_ids = list(prompt)
        return out.logits[0, -1], common

    def generate(
        self, prompt: list[int], params: SamplingParams, max_tokens: int, cancel: threading.Event
    ) -> _Result:
        import torch

        t0 = time.monotonic()
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else self._seeds.getrandbits(63))
        stops = self.eos_ids | set(params.stop_token_ids)
        ids: list[int] = []
        lps: list[float] = []
        finish = "length"
        with torch.inference_mode():
            logits, cached = self._prefill(prompt)
            seen = torch.tensor(prompt, dtype=torch.long)
            while len(ids) < max_tokens:
                if cancel.is_set():
                    finish = "abort"
                    break
                x = process_logits(logits, params, seen)
                if params.temperature == 0:
                    tid = int(torch.argmax(x))
                    logp = torch.log_softmax(process_logits(logits, params.model_copy(update={"temperature": 1.0}), seen), -1)
                else:
                    logp = torch.log_softmax(x, dim=-1)
                    tid = int(torch.multinomial(logp.exp(), 1, generator=gen))
                ids.append(tid)
                lps.append(float(logp[tid]))
                if tid in stops:
                    finish = "stop"
                    break
                if len(ids) >= max_tokens:
                    break
                seen = torch.cat([seen, torch.tensor([tid])])
                out = self.model(input_ids=torch.tensor([[tid]]), **{self._cache_kw: self._past}, use_cache=True)
                self._past = returned_cache(out)
                self._cache_ids.append(tid)
                logits = out.logits[0, -1]
        return _Result(ids, lps, finish, cached, time.monotonic() - t0)


def prompt_logprobs(model: Any, prompt: list[int], top: int) -> list[list[tuple[int, float, int]] | None]:
    """vLLM's ``prompt_logprobs`` from one forward pass over ``prompt`` (no cache): per
    position, ``None`` for the first token, else ``(id, logprob, rank)`` of the prompt token
    followed by the ``top`` most likely ids (raw logprobs, as vLLM's default
    ``raw_logprobs``; rank 1 is the most likely)."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt], dtype=torch.long), use_cache=False)
        logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)  # row i predicts prompt[i+1]
        result: list[list[tuple[int, float, int]] | None] = [None]
        targets = torch.tensor(prompt[1:], dtype=torch.long)
        chosen = logp.gather(1, targets[:, None])[:, 0]
        ranks = (logp > chosen[:, None]).sum(dim=1) + 1
        top_vals, top_ids = (torch.topk(logp, top, dim=-1) if top > 0 else (None, None))
        for i in range(len(prompt) - 1):
            entry = [(int(targets[i]), float(chosen[i]), int(ranks[i]))]
            if top_vals is not None and top_ids is not None:
                entry += [(int(t), float(v), r + 1) for r, (t, v) in
                          enumerate(zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True))
                          if int(t) != entry[0][0]]
            result.append(entry)
    return result


def default_threads() -> int:
    """Half the cores, 1 to 4. Measured on a 2-core machine shared with other work: 2 torch
    threads made a forward pass up to 10x slower than 1 (OpenMP threads spin while the other
    core is busy); 1 thread also leaves a core for the Trio thread."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


class TransformersBackend:
    """The embedded SmolLM2 (CPU). Loads on first use or on :meth:`load`."""

    kind = "transformers"

    def __init__(self, *, threads: int | None = None, name: str = f"transformers:{_embedded.MODEL_NAME}") -> None:
        self.name = name
        self.url: str | None = None
        self.threads = threads or default_threads()
        self._gen: _Generator | None = None
        self._load_lock = trio.Lock()
        self._limiter = trio.CapacityLimiter(1)
        self.max_model_len = 8192

    async def load(self) -> None:
        """Load (converting and caching on the very first run, ~30 s) the model and tokenizer."""
        async with self._load_lock:
            if self._gen is None:
                self._gen = await trio.to_thread.run_sync(self._load_sync, limiter=self._limiter)

    def _load_sync(self) -> _Generator:
        model = _embedded.load_model(threads=self.threads)
        tok = _embedded.load_tokenizer()
        cfg_len = getattr(model.config, "max_position_embeddings", None)
        if isinstance(cfg_len, int):
            self.max_model_len = cfg_len
        eos = tok.eos_token_id
        return _Generator(model, [eos] if isinstance(eos, int) else [])

    async def complete(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, max_tokens: int
    ) -> Completion:
        if not prompt_ids:
            raise BackendRejected(f"{self.name}: empty prompt")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise BackendRejected(
                f"{self.name}: prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds "
                f"the context ({self.max_model_len})"
            )
        await self.load()
        assert self._gen is not None
        cancel = threading.Event()
        fn = partial(self._gen.generate, list(prompt_ids), params, max_tokens, cancel)
        try:
            result = await trio.to_thread.run_sync(fn, limiter=self._limiter, abandon_on_cancel=True)
        except trio.Cancelled:
            cancel.set()  # the thread stops at its next token; the limiter waits for it
            raise
        except RuntimeError as exc:  # a torch failure: this backend is not usable
            raise BackendUnavailable(f"{self.name}: {exc}") from exc
        return Completion(
            token_ids=result.ids,
            logprobs=result.logprobs,
            finish_reason=result.finish,
            backend=self.name,
            cached_tokens=result.cached,
            extra={"generation_s": result.seconds},
        )

    async def prompt_logprobs(self, prompt_ids: Sequence[int], top: int = 0) -> list[list[tuple[int, float, int]] | None]:
        """The prompt's own logprobs (see :func:`prompt_logprobs`): one forward pass, under the
        generation limiter, leaving the generation's KV cache as it was."""
        await self.load()
        gen = self._gen
        assert gen is not None
        fn = partial(prompt_logprobs, gen.model, list(prompt_ids), top)
        try:
            return await trio.to_thread.run_sync(fn, limiter=self._limiter)
        except RuntimeError as exc:
            raise BackendUnavailable(f"{self.name}: {exc}") from exc

    async def reload_weights(self, path: str, *, partial: bool = False, version: int | None = None) -> dict[str, Any]:
        """Weight sync (:class:`~rolloutd.daemon.llm.weights.Reloadable`): copy the safetensors under
        ``path`` into the model (after the current generation, under the same limiter) and drop
        the KV cache the old weights computed. ``version`` is not recorded here (the pool keeps
        the policy version)."""
        await self.load()
        gen = self._gen
        assert gen is not None

        def _reload() -> dict[str, Any]:
            result = load_weights(gen.model, path, partial=partial)
            gen._past, gen._cache_ids = None, []
            return result

        return await trio.to_thread.run_sync(_reload, limiter=self._limiter)

    async def health(self) -> bool:
        await trio.lowlevel.checkpoint()
        return True

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()

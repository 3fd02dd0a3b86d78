"""What a request asks for (:class:`SamplingParams`) and what the engine reports per step (:class:`RequestOutput`)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from ..checks import is_int

# The device samples in float32: a temperature below its smallest normal number cannot divide logits exactly (it
# rounds to a subnormal or to 0), and its limit, T -> 0, is greedy; one above its largest finite number is that number.
_F32_TINY = 2.0 ** -126
_F32_MAX = (2 - 2.0 ** -23) * 2.0 ** 127


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    Args:
        max_new_tokens: tokens to generate at most (>= 1); reserved in the KV cache at admission.
        temperature: 0 is greedy (argmax); > 0 samples from ``softmax(logits / temperature)``. Sampling runs in
            float32: a temperature below float32's smallest normal number (about 1.2e-38) is greedy, the limit it
            means, and one above float32's largest is that largest.
        top_k: keep the ``top_k`` most likely tokens before sampling (0: all; more than the vocabulary: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (1.0: all). The most
            likely token is always kept, so ``top_p`` near 0 (even below float32's resolution) is greedy.
        seed: makes sampling reproducible: a draw is a pure function of (seed, the token's position, the logits), so
            the same seed, prompt and parameters give the same tokens whenever the logits are the same bits. A batch
            can round a logit differently from the same request run alone (its matrix products add in another
            order), and where a top-k / top-p cutoff or a near tie falls between, that can change a token. None
            draws a seed from the engine's own generator.
        stop_token_ids: generation stops after any of these tokens (it is returned, finish reason "stop").
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self):
        if not is_int(self.max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int, got {type(self.max_new_tokens).__name__}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.temperature, numbers.Real) or isinstance(self.temperature, bool):
            raise TypeError(f"temperature must be a float, got {type(self.temperature).__name__}")
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature}")
        if not is_int(self.top_k):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k), got {self.top_k}")
        if not isinstance(self.top_p, numbers.Real) or isinstance(self.top_p, bool):
            raise TypeError(f"top_p must be a float, got {type(self.top_p).__name__}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"seed must be None or an int, got {type(self.seed).__name__}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise TypeError(f"stop_token_ids must be a sequence of ints, got "
                            f"{type(self.stop_token_ids).__name__}") from None
        for t in stops:
            if not is_int(t):
                raise TypeError(f"stop_token_ids must hold ints, got {type(t).__name__} {t!r}")
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "temperature", min(float(self.temperature), _F32_MAX))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax: temperature 0 (or below float32's smallest normal), or top_k 1."""
        return self.temperature < _F32_TINY or self.top_k == 1


@dataclass
class RequestOutput:
    """One request's progress, as :meth:`Engine.step` reports it.

    ``new_token_ids``: tokens generated since the last output of this request; ``token_ids``: every token generated so
    far (the prompt excluded); ``finished`` with ``finish_reason`` "stop" (a stop token, included), "length"
    (``max_new_tokens`` reached) or "abort" (:meth:`Engine.abort`). ``text``: the decoded ``token_ids`` of a finished
    request, when the engine has a tokenizer."""

    request_id: int
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    text: str | None = None

"""Request checks that every engine makes beyond `Engine.validate`, with vLLM's rules and wording:
prompt ids must lie in the vocabulary, and prompt + max_tokens must fit the context (a request that
cannot finish is refused up front rather than cut short)."""

from __future__ import annotations

from ..protocol import EngineError, GenerateRequest


def check_token_ids(request: GenerateRequest, vocab_size: int) -> None:
    for token in request.prompt_token_ids:
        if not 0 <= token < vocab_size:
            raise EngineError(f"prompt token id {token} is outside the vocabulary [0, {vocab_size})")


def check_context(request: GenerateRequest, max_context: int) -> None:
    prompt, wanted = len(request.prompt_token_ids), request.sampling.max_tokens
    if prompt + wanted > max_context:
        raise EngineError(
            f"this model's maximum context length is {max_context} tokens, but {prompt + wanted} "
            f"were requested ({prompt} in the prompt, {wanted} to generate); "
            "shorten the prompt or lower max_tokens"
        )

"""What a generation engine takes and returns: a ``GenerationRequest`` (the harmony prompt
text for local models, the chat messages for endpoints), the ``SamplingParams`` every engine
samples with (the eval's and GRPO's), and one ``Generation`` per request
(``generation.engines``, ``generation.endpoint``)."""

from __future__ import annotations

from dataclasses import dataclass

from core.parsing import ParsedResponse, ResponseFormat, parse_response


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples a response: what the eval's ``SamplingSettings`` and GRPO's
    ``RolloutConfig`` give every engine.

    Attributes:
        temperature: Softmax temperature; 0 is greedy (the eval's engines).
        top_p: Nucleus mass: keep the smallest prefix of tokens whose probability reaches it.
        max_tokens: New tokens at most per response.
    """

    temperature: float
    top_p: float
    max_tokens: int


@dataclass(frozen=True)
class GenerationRequest:
    """One response to generate.

    Attributes:
        key: Identifies the response in logs and errors (``<question id>#<sample>``).
        prompt: The harmony prompt text, ending with ``<|start|>assistant``.
        messages: The same prompt as chat messages ``[system, user]``.
        seed: Seed for this request, where the engine takes one per request.
    """

    key: str
    prompt: str
    messages: tuple[dict[str, str], ...]
    seed: int


@dataclass(frozen=True)
class Generation:
    """What an engine returned for one request.

    Attributes:
        text: The response text: decoded with special tokens (HF, vLLM), or the message
            ``content`` (endpoints). ``None`` when the request failed.
        reasoning: Reasoning an endpoint returned separately (``reasoning_content`` or
            ``reasoning``), else ``None``.
        finish_reason: ``stop``, ``length``, or the server's value.
        completion_tokens: New tokens, when known.
        latency_s: Seconds spent on the request (for batched engines: the batch's time
            divided evenly).
        attempts: Requests sent (1 + retries).
        error: Why no response came back, else ``None``.
    """

    text: str | None
    reasoning: str | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    latency_s: float = 0.0
    attempts: int = 1
    error: str | None = None

    @property
    def failed(self) -> bool:
        """The engine gave no response."""
        return self.error is not None

    def parsed(self) -> ParsedResponse:
        """The response split into reasoning and final answer.

        A separately returned reasoning is the analysis channel and ``text`` the answer, as
        it is: text that looks like a channel marker (``analysis…``, ``assistantfinal``) is
        words of the answer, never structure; a ``length`` finish with a final answer marks
        it truncated.
        """
        if self.error is not None:
            return ParsedResponse(ResponseFormat.EMPTY, None, None)
        cut = self.finish_reason == "length"
        if self.reasoning is not None and self.reasoning.strip():
            final = self.text.strip() if self.text and self.text.strip() else None
            return ParsedResponse(
                ResponseFormat.HARMONY,
                reasoning=self.reasoning.strip(),
                final=final,
                analysis_blocks=1,
                truncated=cut or final is None,
            )
        parsed = parse_response(self.text)
        if cut and parsed.final is not None and not parsed.truncated:
            parsed = ParsedResponse(
                parsed.format, parsed.reasoning, parsed.final, parsed.analysis_blocks, True
            )
        return parsed

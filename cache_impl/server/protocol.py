"""OpenAI-compatible request bodies and error responses.

Request models type every field OpenAI's API or vLLM's (`vllm/entrypoints/openai/*/protocol.py`)
defines that clients send, as vLLM types it, also those kvgate ignores (`user: 5` is a 400 naming
`user`); only fields neither defines are ignored. A known field of the wrong type or out of the range vLLM
accepts (`vllm/sampling_params.py`: top_p in (0, 1], penalties in [-2, 2], ...)
is a 400 that names it; so is a value the embedded engine cannot honour
(`logprobs: true`, `n: 2`, a penalty, a stop string, tools), rather than an answer that
ignores it; such a field is accepted only absent, null, empty or at its neutral value.
`null` for a field with a default means the default, as OpenAI's clients send it. A
temperature below vLLM's `_SAMPLING_EPS` is greedy decoding, as in vLLM; a seed is in
the range torch's generators take.
Errors follow OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import reprlib
from typing import Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cache_impl.engine.tokenizer import ChatMessage

RequestModel = TypeVar("RequestModel", bound=BaseModel)


class ApiError(Exception):
    """An error answered to the client as OpenAI does; never a 500 for a client's mistake."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers  # of the response, e.g. Connection: close

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


SAMPLING_EPS = 1e-5  # vllm/sampling_params.py: a temperature below it means greedy decoding
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes


def expect_object(body: object) -> dict:
    """A decoded JSON body that must be an object: a 400 for any other JSON value."""
    if not isinstance(body, dict):
        raise ApiError(400, f"expected a JSON object as the request body, found {type(body).__name__}")
    return body


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # ignored: the usage comes once, in the last chunk


class _GenerationFields(BaseModel):
    # strict: JSON true is not an integer, "1" is not a number
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)           # 0 or -1: every token
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logprobs: Union[None, bool, int] = Field(default=None, ge=0)  # chat: a boolean; completions: a count
    seed: Optional[int] = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(default=1, ge=1)
    # accepted only when they ask for nothing (see _UNSUPPORTED), but typed: `stop: 5` is a wrong type
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    min_tokens: Optional[int] = Field(default=None, ge=0)
    ignore_eos: Optional[bool] = None             # true: generate to max_tokens past end-of-text (vLLM's)
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict[str, object]] = None
    use_beam_search: Optional[bool] = None
    priority: Optional[int] = None
    cache_salt: Optional[str] = None
    # ignored whatever their value: they ask for nothing the embedded engine would do otherwise
    user: Optional[str] = None
    request_id: Optional[str] = None
    include_stop_str_in_output: Optional[bool] = None  # no stop strings are taken
    skip_special_tokens: Optional[bool] = None          # special tokens are never text here (vLLM: true)
    spaces_between_special_tokens: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: object) -> object:
        """OpenAI's clients send `"temperature": null` for "not set": a field with a default takes it."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, value: float) -> float:
        return 0.0 if value < SAMPLING_EPS else value  # as vLLM: 1e-300 would overflow the softmax

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """A 400 naming the first field whose valid value the engine would have to ignore."""
        for name, (neutral, why) in _UNSUPPORTED.items():
            if name not in type(self).model_fields:
                continue  # a field of the other endpoint (echo, best_of: completions; top_logprobs: chat)
            value = getattr(self, name)
            if _is_one_of(value, neutral) or (name in _SAMPLING_ONLY and self.temperature == 0):
                continue  # greedy decoding takes the top token whatever top_p, top_k, min_p say (as vLLM)
            raise ApiError(400, f"{name}: {why}; expected {' or '.join(map(_json_literal, neutral))}, "
                                f"found {_json_literal(value)}", param=name, code="unsupported_value")


# field: (the values that ask for nothing the engine lacks, what it lacks)
_UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "n": ((1,), "the embedded engine returns one choice per request"),
    "best_of": ((None, 1), "the embedded engine returns one choice per request"),
    "logprobs": ((None, False), "the embedded engine does not return log probabilities"),
    "top_logprobs": ((None, 0), "the embedded engine does not return log probabilities"),
    "echo": ((False,), "the embedded engine does not echo the prompt"),
    "presence_penalty": ((0,), "the embedded engine applies no penalties"),
    "frequency_penalty": ((0,), "the embedded engine applies no penalties"),
    "repetition_penalty": ((1,), "the embedded engine applies no penalties"),
    "top_p": ((1,), "the embedded engine samples from every token (temperature only)"),
    "top_k": ((0, -1), "the embedded engine samples from every token (temperature only)"),
    "min_p": ((0,), "the embedded engine samples from every token (temperature only)"),
    "stop": ((None, "", []), "the embedded engine stops only at its end-of-text token or max_tokens"),
    "stop_token_ids": ((None, []), "the embedded engine stops only at its end-of-text token or max_tokens"),
    "min_tokens": ((None, 0), "the embedded engine stops at its end-of-text token whenever it comes"),
    "logit_bias": ((None, {}), "the embedded engine applies no logit bias"),
    "response_format": ((None, {}, {"type": "text"}), "the embedded engine generates free text only"),
    "suffix": ((None, ""), "the embedded engine does not insert text"),
    "tools": ((None, []), "the embedded engine does not call tools"),
    "tool_choice": ((None, "none", "auto"), "the embedded engine does not call tools"),
    "functions": ((None, []), "the embedded engine does not call functions"),
    "function_call": ((None, "none", "auto"), "the embedded engine does not call functions"),
    "use_beam_search": ((None, False), "the embedded engine does not search beams"),
    "priority": ((None, 0), "the embedded engine serves requests first come, first served"),
    "cache_salt": ((None, ""), "the embedded engine does not scope its cache by a request's salt (kvgate's "
                               "connector inside vLLM does)"),
}
_SAMPLING_ONLY = {"top_p", "top_k", "min_p"}


def _is_one_of(value: object, choices: tuple[object, ...]) -> bool:
    """`value in choices`, where a boolean is not a number (logprobs 0 asks for log probabilities, false does not)."""
    return any(value is c if isinstance(c, bool) or c is None or isinstance(value, bool) else value == c
               for c in choices)


def _json_literal(value: object) -> str:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    text = repr(value) if number else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."  # whatever the client sent


class CompletionRequest(_GenerationFields):
    prompt: Union[str, list[int], list[str]]
    best_of: Optional[int] = Field(default=None, ge=1)
    echo: bool = False
    suffix: Optional[str] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, object]]] = None
    tool_choice: Union[None, str, dict[str, object]] = None
    parallel_tool_calls: Optional[bool] = None  # asks for nothing while tools are refused
    functions: Optional[list[dict[str, object]]] = None  # the deprecated form of tools
    function_call: Union[None, str, dict[str, object]] = None


def chat_tokens(tokenizer, messages: list[Message]) -> list[int]:
    """The prompt tokens of validated chat messages (a developer message counts as the system's)."""
    turns = [ChatMessage("system" if m.role == "developer" else m.role, m.text()) for m in messages]
    return tokenizer.apply_chat_template(turns)


def parse_request(model: type[RequestModel], body: object) -> RequestModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    try:
        return model.model_validate(expect_object(body))
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p))
        found = "nothing" if first["type"] == "missing" else _SHORT.repr(first.get("input"))
        raise ApiError(400, f"{param}: {first['msg']} (found {found})", param=param or None,
                       code=_error_code(first["type"])) from None


def _error_code(pydantic_type: str) -> str:
    """missing_field, invalid_type (a string for a number, `stop: 5`) or invalid_value (out of range)."""
    if pydantic_type == "missing":
        return "missing_field"
    return "invalid_type" if pydantic_type.endswith("_type") else "invalid_value"


_SHORT = reprlib.Repr()  # bounded in length and depth, whatever the client sent
_SHORT.maxstring = _SHORT.maxother = 80


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a Union that failed ("str", "list[int]"); those are not field names."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)

"""OpenAI-compatible request bodies and error responses.

Request models accept the fields kvgate uses and ignore other OpenAI fields
(`user`, `top_p`, ...), but a known field of the wrong type or range is a
400 that names it. Errors follow OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """An error answered to the client as OpenAI does; never a 500 for a client's mistake."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _GenerationFields(BaseModel):
    # strict: JSON true is not an integer, "1" is not a number
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(default=1, ge=1, le=1)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationFields):
    prompt: Union[str, list[int], list[str]]


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


def parse_request(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"expected a JSON object as the request body, found {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p))
        found = "nothing" if first["type"] == "missing" else repr(first.get("input"))[:80]
        raise ApiError(400, f"{param}: {first['msg']} (found {found})", param=param or None,
                       code="missing_field" if first["type"] == "missing" else "invalid_value") from None


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a Union that failed ("str", "list[int]"); those are not field names."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)

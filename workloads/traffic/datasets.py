"""Deterministic workloads as data: a YAML spec and a seed build a `Workload`.

How it works: docs/methods/measurement.md (workloads/traffic/datasets.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Mapping, Optional, Protocol, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, ValidationError, model_validator
from tokenizers import Tokenizer

from cache_impl.engine.tokenizer import TOKENIZER_ID as BYTE_TOKENIZER_ID
from kvcore.settings import (
    MAX_CONTEXT_TOKENS,
    ConfigError,
    ContextTokens,
    Count,
    field_path,
    format_validation_error,
    load_yaml_file,
)
from workloads.traffic.requests import Workload, WorkloadRequest

# Tokens per hash id in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512

# A workload is built whole (its texts, every request's messages) before a load sends it, and the sizing model
# keys every prompt: what one pass over it may hold. A billion prompt tokens take hours to send even at 100k
# tokens/s, and a minute or two to build; beyond that a mistyped size would only run the machine out of memory.
MAX_WORKLOAD_REQUESTS = 1_000_000
MAX_WORKLOAD_PROMPT_TOKENS = 1_000_000_000
# a trace's measured requests without a `limit`: at most this many (each block replays its own slice, and the
# workload is built whole first: a trace of a million lines would hold a gigabyte and more for nothing)
MAX_TRACE_REQUESTS = 100_000
# a trace's timestamps: milliseconds from its start, at most about 300 years (Infinity, 1e308: refused, as NaN is)
MAX_TRACE_TIMESTAMP_MS = 1e13


# --------------------------------------------------------------------------- text sizing

# Common short lowercase English words; inside running text (with the leading
# space they then get) each is a single token in the usual BPE vocabularies.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is it you that he was for on are with as his they be at one have this from or
    had by not but what some we can out other were all there when up use your how said an each she
    which do their time if will way about many then them write would like so these her long make
    thing see him two has look more day could go come did number sound no most people my over know
    water than call first who may down side been now find any new work part take get place made live
    where after back little only round man year came show every good me give our under name very
    through just form great think say help low line turn cause much mean before move right boy old
    too same tell does set three want air well also play small end put home read hand port large
    spell add even land here must big high such follow act why ask men change went light kind off
    need house picture try us again animal point mother world near build self earth father head
    stand own page should country found answer school grow study still learn plant cover food sun
    four between state keep eye never last let thought city tree cross farm hard start might story
    saw far sea draw left late run while press close night real life few north open seem next white
    begin got walk example ease paper group always music those both mark often letter until mile
    river car feet care second book carry took science eat room friend began idea fish stop once
    base hear horse cut sure watch color face wood main enough plain girl usual young ready above
    ever red list though feel talk bird soon body dog family direct leave song measure door product
    black short class wind happen ship area half rock order fire south problem piece told knew pass
    since top whole king space heard best hour better true during hundred five step early hold west
    ground reach fast sing listen six table travel less morning ten simple several toward war lay
    against pattern slow center love person money serve appear road map rain rule pull cold notice
    voice energy hunt bed brother egg ride cell believe perhaps pick sudden count square reason
    length art subject region size vary settle speak weight general ice matter circle pair include
    divide felt grand ball yet wave drop heart present heavy dance engine arm wide sail forest sit
    race window store summer train sleep prove leg wall catch mount wish sky board joy winter sat
    written wild kept glass grass cow job edge sign visit past soft fun bright gas weather month
    million bear finish happy hope flower strange gone trade trip office receive row mouth exact
    symbol least trouble shout except wrote seed tone join suggest clean break lady yard rise
    bad blow oil touch grew cent mix team wire cost lost brown wear garden equal sent choose
    fell fit flow fair bank collect save control ear else quite broke case middle son lake
    moment scale loud spring observe child nation milk speed method organ pay age section dress
    cloud quiet stone tiny climb cool design poor lot
    """.split()
)


def _rng(seed: int | str) -> random.Random:
    """A generator seeded from a string (stable across processes, unlike `hash()`)."""
    return random.Random(f"kvgate-text:{seed}")


class TextSizer(Protocol):
    """Makes texts of a given size in a tokenizer's tokens, and counts them back."""

    name: str

    def text(self, n_tokens: int, seed: int | str) -> str:
        """A deterministic text of exactly `n_tokens` tokens; equal seeds give equal texts."""
        ...

    def tokens(self, text: str) -> list[str]:
        """`text` cut into the tokens this sizer counts (their concatenation is `text`)."""
        ...


class ByteSizer:
    """Texts for kvgate's embedded engine (tokenizer `kvgate-byte-v1`: one token per byte).

    A text of n tokens is n printable ASCII characters (lowercase words and
    spaces, cut at exactly n), so sizes are exact and concatenations add up.
    """

    name = "byte"

    def text(self, n_tokens: int, seed: int | str) -> str:
        rng, pieces, length = _rng(seed), [], 0
        while length < n_tokens:
            batch = [w + " " for w in rng.choices(WORDS, k=max(16, (n_tokens - length) // 4))]
            pieces.extend(batch)
            length += sum(map(len, batch))
        return "".join(pieces)[:n_tokens]

    def tokens(self, text: str) -> list[str]:
        return list(text)


class WordSizer:
    """Texts for tokenizers kvgate does not know: one token per word.

    A text of n tokens is n common lowercase English words, each followed by a
    space. This approximates BPE tokenizers (GPT, Llama, Qwen, ...), where
    common short words are single tokens; a real tokenizer may count a few
    more or fewer (a trailing space, for instance).
    """

    name = "word"

    def text(self, n_tokens: int, seed: int | str) -> str:
        return "".join(w + " " for w in _rng(seed).choices(WORDS, k=n_tokens))

    def tokens(self, text: str) -> list[str]:
        return re.findall(r"[^ ]* |[^ ]+$", text)


MAX_SIZING_ROUNDS = 64     # words added to a sized text at most this many times (each adds n words or more)


class TokenizerSizer:
    """Texts sized in a real tokenizer's tokens: a `tokenizer.json` (Hugging Face `tokenizers`), or a model
    directory holding one (or, with `transformers` installed, any tokenizer it loads from the directory).

    A text of n tokens is lowercase words encoded and cut after the n-th token (prompt tokens, the
    tokenizer's added specials left out); at a cut between words, as here, BPE tokenizers count it again
    as n tokens. `tokens` splits a text at its tokens' start offsets, so the pieces add up to the text.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._encode = _load_encoder(self.path)
        self.name = f"tokenizer {self.path}"
        self._probe()

    def _probe(self) -> None:
        """Sized prompts need a tokenizer that turns words into tokens: one that fails on them (a WordLevel vocabulary
        without an unknown token) or makes nothing of them (a normalizer that deletes every character) is refused
        here, at load, not in the middle of a gate."""
        sample = "".join(w + " " for w in WORDS[:32])
        try:
            tokens = len(self._starts(sample))
        except Exception as error:          # the library raises plain Exceptions for text it cannot encode
            raise TokenizerError(f"expected a tokenizer that encodes plain words, found {self.path} failing on them "
                                 f"({str(error).splitlines()[0][:200]})") from None
        if tokens < 8:
            raise TokenizerError(f"expected a tokenizer that turns words into tokens, found {self.path} making "
                                 f"{tokens} token{'s' if tokens != 1 else ''} of 32 words")

    def text(self, n_tokens: int, seed: int | str) -> str:
        if n_tokens <= 0:
            return ""
        rng, text = _rng(seed), ""
        for _ in range(MAX_SIZING_ROUNDS):      # bounded: a tokenizer that stops making tokens cannot loop forever
            words = rng.choices(WORDS, k=max(16, n_tokens))
            text += "".join(w + " " for w in words)
            starts = self._starts(text)
            if len(starts) > n_tokens:
                return text[: starts[n_tokens]]
        raise TokenizerError(f"expected a tokenizer that makes {n_tokens} tokens of some text, found {self.path} "
                             f"making {len(starts)} of {len(text):,} characters")

    def tokens(self, text: str) -> list[str]:
        starts = self._starts(text)
        if not starts:
            return [text] if text else []
        bounds = [0, *starts[1:], len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]

    def _starts(self, text: str) -> list[int]:
        return [start for start, _ in self._encode(text)]


def _load_encoder(path: Path) -> Callable[[str], list[tuple[int, int]]]:
    """text -> each token's (start, end) character offsets, by the tokenizer at `path`; TokenizerError when it
    cannot be read."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:          # the library raises plain Exceptions for a malformed file
            raise TokenizerError(f"expected a tokenizer.json that Hugging Face tokenizers reads, found {file} "
                                 f"refused ({str(error).splitlines()[0][:200]})") from None
        return lambda text: tokenizer.encode(text, add_special_tokens=False).offsets
    if path.is_dir():
        try:
            from transformers import AutoTokenizer  # deferred: optional: transformers is not a dependency
        except ImportError:
            raise TokenizerError(f"expected a tokenizer.json in {path} (or transformers installed, to load the "
                                 "directory's tokenizer), found neither") from None
        try:
            slow = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as error:
            raise TokenizerError(f"expected a tokenizer transformers loads from {path}, found it refused "
                                 f"({str(error).splitlines()[0][:200]})") from None
        return lambda text: slow(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if path.exists():
        raise TokenizerError(f"expected a tokenizer.json or a model directory, found neither (a device, a FIFO or "
                             f"another special file): {path}")
    raise TokenizerError(f"expected a tokenizer.json or a model directory, found no such file or directory: {path}")


class TokenizerError(ValueError):
    """A target's tokenizer could not be loaded (the message says what was expected and found)."""


def is_tokenizer_path(value: str) -> bool:
    """Whether a target's `tokenizer` names a file or directory (else it is an id: kvgate-byte-v1, or a name
    kvgate cannot load, sized in words)."""
    return value.startswith(("/", "./", "../", "~")) or value.endswith(".json") or Path(value).expanduser().exists()


_SIZERS: dict[str, TextSizer] = {}


def sizer_for(tokenizer: str | None) -> TextSizer:
    """The sizer of a target's `tokenizer`: `ByteSizer` for kvgate's byte tokenizer, `TokenizerSizer` for a
    tokenizer file or model directory (loaded once; TokenizerError when it cannot be), `WordSizer` (an
    approximation: one token per word) for none or an id kvgate cannot load."""
    if tokenizer == BYTE_TOKENIZER_ID:
        return ByteSizer()
    if tokenizer is None or not is_tokenizer_path(tokenizer):
        return WordSizer()
    path = str(Path(tokenizer).expanduser().resolve())
    if path not in _SIZERS:
        _SIZERS[path] = TokenizerSizer(Path(path))
    return _SIZERS[path]


CHAT_FRAMING_TOKENS = 8     # room a one-message prompt leaves for the chat template's own tokens


def context_request(context_tokens: int, request_id: str, tokenizer: str | None, max_tokens: int,
                    purpose: str) -> WorkloadRequest:
    """One user message sized so that, with the chat template's framing, the prompt fills `context_tokens`, its
    text drawn from "<purpose>/<request_id>": G2's requests at each context length, and the pre-flight's prefill
    probe at its own lengths."""
    text = sizer_for(tokenizer).text(max(1, context_tokens - CHAT_FRAMING_TOKENS), f"{purpose}/{request_id}")
    return WorkloadRequest(request_id, request_id, 0, ({"role": "user", "content": text},), max_tokens,
                           context_tokens)


# --------------------------------------------------------------------------- specs


class _Strict(BaseModel):
    """Settings: unknown keys and wrong types are errors (no "3" for 3); values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Spec(_Strict):
    """Settings common to every workload kind."""

    name: Optional[str] = Field(default=None, description="the workload's name (default: its kind)")

    def extent(self) -> Optional[tuple[int, str, int, str, int]]:
        """What building it makes: (requests, how they are counted, the longest prompt in tokens, where it is,
        prompt tokens over all requests); None when only its file knows (a trace: check_trace reads it)."""
        return None

    @model_validator(mode="after")
    def _a_run_can_send_it(self) -> "_Spec":
        extent = self.extent()
        if extent is None:
            return self
        requests, counted, longest, where, total = extent
        if requests > MAX_WORKLOAD_REQUESTS:
            raise ValueError(f"expected at most {MAX_WORKLOAD_REQUESTS:,} requests ({counted}), found {requests:,}")
        if longest > MAX_CONTEXT_TOKENS:
            raise ValueError(f"expected prompts of at most {MAX_CONTEXT_TOKENS:,} tokens (the longest context models "
                             f"serve), found {longest:,} tokens {where}")
        if total > MAX_WORKLOAD_PROMPT_TOKENS:
            raise ValueError(f"expected at most {MAX_WORKLOAD_PROMPT_TOKENS:,} prompt tokens over all requests (the "
                             f"workload is built whole before it is sent), found {total:,}")
        return self


class MultiRoundQASpec(_Spec):
    """`users` conversations of `rounds` rounds over a shared system prompt and a per-user document."""

    kind: Literal["multi_round_qa"] = Field(description="workload kind")
    users: Count = Field(ge=1, description="conversations (sessions), one per user")
    rounds: Count = Field(ge=1, description="requests per conversation")
    system_prompt_tokens: ContextTokens = Field(
        default=0, ge=0, description="system prompt shared by all users; 0: none"
    )
    document_tokens: ContextTokens = Field(ge=0, description="per-user document, sent in the first user message")
    question_tokens: ContextTokens = Field(ge=1, description="the user's message of each round")
    answer_tokens: ContextTokens = Field(ge=1, description="synthetic assistant answer kept in the history")
    output_tokens: Optional[ContextTokens] = Field(
        default=None, ge=1, description="max_tokens per request (default: answer_tokens)"
    )
    order: Literal["interleaved", "sequential"] = Field(
        default="interleaved",
        description="interleaved: load users take the users' turns round-robin, so between two rounds of a "
        "conversation every other user has a turn and the whole history must stay cached (LMCache's multi-round "
        "QA); sequential: a load user runs one conversation's rounds back to back",
    )

    def extent(self) -> tuple[int, str, int, str, int]:
        # round r (from 0): system + document + (r + 1) questions + r answers
        opening, turn = self.system_prompt_tokens + self.document_tokens, self.question_tokens + self.answer_tokens
        last = opening + self.rounds * turn - self.answer_tokens
        per_user = (
            self.rounds * opening + turn * self.rounds * (self.rounds - 1) // 2 + self.rounds * self.question_tokens
        )
        return self.users * self.rounds, "users × rounds", last, "in the last round", self.users * per_user


class LongDocQASpec(_Spec):
    """`documents` long documents, each asked `questions_per_document` independent questions."""

    kind: Literal["long_doc_qa"] = Field(description="workload kind")
    documents: Count = Field(ge=1, description="distinct documents")
    document_tokens: ContextTokens = Field(ge=1, description="size of each document")
    questions_per_document: Count = Field(ge=1, description="questions asked about each document")
    question_tokens: ContextTokens = Field(ge=1, description="size of each question")
    system_prompt_tokens: ContextTokens = Field(
        default=0, ge=0, description="system prompt shared by all requests; 0: none"
    )
    output_tokens: ContextTokens = Field(ge=1, description="max_tokens per request")
    order: Literal["grouped", "interleaved"] = Field(
        default="interleaved",
        description="interleaved: question 0 of every document, then question 1, ...; grouped: all questions of "
        "document 0, then document 1, ...",
    )

    def extent(self) -> tuple[int, str, int, str, int]:
        requests = self.documents * self.questions_per_document
        prompt = self.system_prompt_tokens + self.document_tokens + self.question_tokens
        return requests, "documents × questions_per_document", prompt, "in each request", requests * prompt


class SharedPrefixSpec(_Spec):
    """`groups` × `prompts_per_group` prompts; the prompts of a group share a prefix, each has its own suffix."""

    kind: Literal["shared_prefix"] = Field(description="workload kind")
    groups: Count = Field(ge=1, description="distinct prefixes")
    prompts_per_group: Count = Field(ge=1, description="prompts sharing each prefix")
    prefix_tokens: ContextTokens = Field(ge=0, description="size of the shared prefix")
    suffix_tokens: ContextTokens = Field(ge=1, description="size of each prompt's own suffix")
    output_tokens: ContextTokens = Field(ge=1, description="max_tokens per request")
    order: Literal["grouped", "interleaved"] = Field(
        default="interleaved",
        description="interleaved: prompt 0 of every group, then prompt 1, ...; grouped: group 0's prompts, "
        "then group 1's",
    )

    def extent(self) -> tuple[int, str, int, str, int]:
        requests, prompt = self.groups * self.prompts_per_group, self.prefix_tokens + self.suffix_tokens
        return requests, "groups × prompts_per_group", prompt, "in each request", requests * prompt


_T = TypeVar("_T")


class LengthDistribution(_Strict):
    """Lengths drawn per request, rounded to whole tokens and clipped to [min, max].

    fixed: always `mean`; uniform: an integer in [min, max]; normal: mean and
    std; lognormal: a log-normal whose lengths have this mean and std.
    """

    distribution: Literal["fixed", "uniform", "normal", "lognormal"] = Field(description="the length distribution")
    mean: Optional[float] = Field(default=None, gt=0, le=MAX_CONTEXT_TOKENS,
                                  description="mean length (fixed, normal, lognormal)")
    std: Optional[float] = Field(default=None, ge=0, le=MAX_CONTEXT_TOKENS,
                                 description="standard deviation (normal, lognormal)")
    min: ContextTokens = Field(default=1, ge=1, description="smallest length")
    max: Optional[ContextTokens] = Field(default=None, ge=1, description="largest length (required for uniform)")

    @model_validator(mode="after")
    def _complete(self) -> "LengthDistribution":
        needs = {"fixed": ("mean",), "uniform": ("max",), "normal": ("mean", "std"), "lognormal": ("mean", "std")}
        for key in needs[self.distribution]:
            if getattr(self, key) is None:
                raise ValueError(f"expected '{key}' for distribution '{self.distribution}', found nothing")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"expected max >= min ({self.min}), found max {self.max}")
        if (self.distribution == "fixed"
                and not self.min <= round(self._set(self.mean, "mean")) <= (self.max or math.inf)):
            raise ValueError(f"expected a fixed mean within [min, max], found {self.mean}")
        return self

    @property
    def upper(self) -> int:
        """The longest length it gives, as a bound: `max`, else the mean and three standard deviations."""
        return self.max if self.max is not None else round(self._set(self.mean, "mean") + 3 * (self.std or 0))

    def _set(self, value: Optional[_T], key: str) -> _T:
        """`value`, the field `key` this distribution needs: set, as `_complete` checked (the checker cannot see it)."""
        if value is None:
            raise ValueError(f"expected '{key}' for distribution '{self.distribution}', found nothing")
        return value

    def sample(self, rng: random.Random) -> int:
        """One length from `rng`."""
        value: float
        if self.distribution == "fixed":
            value = self._set(self.mean, "mean")
        elif self.distribution == "uniform":
            value = rng.randint(self.min, self._set(self.max, "max"))
        elif self.distribution == "normal":
            value = rng.gauss(self._set(self.mean, "mean"), self._set(self.std, "std"))
        else:
            mean, std = self._set(self.mean, "mean"), self._set(self.std, "std")
            sigma2 = math.log1p((std / mean) ** 2)
            value = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
        return int(min(max(round(value), self.min), self.max or math.inf))


class RandomSpec(_Spec):
    """`requests` independent prompts of random text (no reuse), lengths drawn from distributions."""

    kind: Literal["random"] = Field(description="workload kind")
    requests: Count = Field(ge=1, description="number of requests")
    input_tokens: LengthDistribution = Field(description="prompt length distribution")
    output_tokens: LengthDistribution = Field(description="max_tokens distribution")

    def extent(self) -> tuple[int, str, int, str, int]:
        longest = self.input_tokens.upper
        return self.requests, "requests", longest, "at input_tokens' upper end", self.requests * longest


class TraceSpec(_Spec):
    """Replay of a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length, hash_ids).

    The trace's first `warmup_requests` requests are the warm-up (priming sends them, arrivals
    dropped); the `limit` requests after them are measured, their arrivals counted from the first
    of them. Priming never sends a measured request, so a measured hit is the trace's own reuse.
    """

    kind: Literal["trace"] = Field(description="workload kind")
    path: Optional[Path] = Field(
        default=None, strict=False,
        description="the trace file, JSONL (relative: to the spec file's folder); required: in the config or "
        "with `kvgate run --trace FILE`")
    warmup_requests: Count = Field(
        default=0, ge=0, description="the trace's first N requests warm the targets up (priming) and are never "
        "measured; 0: no warm-up")
    limit: Optional[Count] = Field(default=None, ge=1, description="measure only the N requests after the warm-up")
    block_tokens: ContextTokens = Field(
        default=MOONCAKE_BLOCK_TOKENS, ge=1, description="tokens per hash id in the trace"
    )
    time_scale: float = Field(default=1.0, gt=0, description="arrival_s = timestamp / 1000 * time_scale")
    length_scale: float = Field(
        default=1.0, gt=0, description="scales input, output and block sizes together (reuse structure kept)"
    )
    max_output_tokens: Optional[ContextTokens] = Field(
        default=None, ge=1, description="cap on max_tokens after scaling"
    )


WorkloadSpec = Union[MultiRoundQASpec, LongDocQASpec, SharedPrefixSpec, RandomSpec, TraceSpec]
SPEC_TYPES = (MultiRoundQASpec, LongDocQASpec, SharedPrefixSpec, RandomSpec, TraceSpec)
_SPECS: dict[str, type[WorkloadSpec]] = {
    "multi_round_qa": MultiRoundQASpec, "long_doc_qa": LongDocQASpec, "shared_prefix": SharedPrefixSpec,
    "random": RandomSpec, "trace": TraceSpec,
}


def load_spec(source: Union[str, Path, Mapping[str, Any], WorkloadSpec], root: str = "workload") -> WorkloadSpec:
    """Validate a workload spec from a YAML file or a mapping.

    A bad spec raises `ConfigError` naming the field path (under `root`; "" for paths relative to the spec), what
    was expected and what was found. A relative trace `path` in a file is taken relative to that file's folder.
    """
    if isinstance(source, _Spec):
        return source
    base = None
    if isinstance(source, (str, Path)):
        base = Path(source).parent
        source = load_yaml_file(source, root or "workload")
    if not isinstance(source, Mapping):
        raise ConfigError(f"{root + ': ' if root else ''}expected a mapping, found {source!r}")
    kind = source.get("kind")
    if kind is None:
        raise ConfigError(f"{field_path(root, ('kind',))}: expected a value (required), found nothing")
    if not isinstance(kind, str) or kind not in _SPECS:
        raise ConfigError(f"{field_path(root, ('kind',))}: expected one of {', '.join(map(repr, _SPECS))}, "
                          f"found {kind!r}")
    try:
        spec = _SPECS[kind].model_validate(dict(source))
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, root)) from None
    if isinstance(spec, TraceSpec) and base is not None and spec.path is not None and not spec.path.is_absolute():
        spec = spec.model_copy(update={"path": base / spec.path})
    return spec


def _workload_field(value: Any) -> WorkloadSpec:
    """A config's workload section validated where it is loaded: a mapping (or a spec already validated), its
    errors named under the section's own path."""
    if isinstance(value, SPEC_TYPES):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping (a workload spec: workloads/specs/), found {value!r}")
    try:
        return load_spec(value, root="")
    except ConfigError as error:
        raise ValueError(str(error)) from None


# A settings model's workload field (gates.yaml's g3.workload, g4.workload): the spec, typed at load.
WorkloadField = Annotated[WorkloadSpec, PlainValidator(_workload_field),
                          PlainSerializer(lambda spec: spec.model_dump(mode="json"))]


# --------------------------------------------------------------------------- builders


def build_workload(
    spec: Union[WorkloadSpec, Mapping[str, Any], str, Path], sizer: TextSizer, seed: int = 0
) -> Workload:
    """The workload a spec describes, with texts made by `sizer` from `seed` (same inputs, same workload)."""
    spec = load_spec(spec)
    builders: dict[str, Callable[[Any, TextSizer, int], tuple]] = {
        "multi_round_qa": _multi_round_qa, "long_doc_qa": _long_doc_qa, "shared_prefix": _shared_prefix,
        "random": _random, "trace": _trace,
    }
    sessions = builders[spec.kind](spec, sizer, seed)
    if spec.kind == "trace":
        return Workload(name=spec.name or spec.kind, sessions=sessions[spec.warmup_requests:], trace=True,
                        warmup=sessions[:spec.warmup_requests])
    interleaved = spec.kind == "multi_round_qa" and spec.order == "interleaved"
    return Workload(name=spec.name or spec.kind, sessions=sessions, interleaved=interleaved)


def _message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _request(request_id: str, session_id: str, turn: int, messages: list[dict], max_tokens: int,
             sizer: TextSizer, arrival_s: Optional[float] = None) -> WorkloadRequest:
    """A request; prompt_tokens is counted from the message contents by the sizer."""
    return WorkloadRequest(
        request_id=request_id, session_id=session_id, turn=turn,
        messages=tuple(dict(m) for m in messages), max_tokens=max_tokens,
        prompt_tokens=sum(len(sizer.tokens(m["content"])) for m in messages), arrival_s=arrival_s,
    )


def _system(sizer: TextSizer, n_tokens: int, seed: int, kind: str) -> list[dict]:
    """The shared system message, or none when its size is 0."""
    return [_message("system", sizer.text(n_tokens, f"{seed}/{kind}/system"))] if n_tokens else []


def _order(outer: int, inner: int, order: str) -> list[tuple[int, int]]:
    """(outer, inner) index pairs: outer-major when grouped, inner-major when interleaved."""
    if order == "grouped":
        return [(o, i) for o in range(outer) for i in range(inner)]
    return [(o, i) for i in range(inner) for o in range(outer)]


def _multi_round_qa(spec: MultiRoundQASpec, sizer: TextSizer, seed: int) -> tuple:
    """One session per user; round r = [system, user: doc + q0, assistant: a0, ..., user: q_r]."""
    kind, sessions = spec.kind, []
    system = _system(sizer, spec.system_prompt_tokens, seed, kind)
    for user in range(spec.users):
        document = sizer.text(spec.document_tokens, f"{seed}/{kind}/document/{user}")
        history, session = list(system), []
        for rnd in range(spec.rounds):
            question = sizer.text(spec.question_tokens, f"{seed}/{kind}/question/{user}/{rnd}")
            history.append(_message("user", document + question if rnd == 0 else question))
            session.append(_request(f"user-{user}/round-{rnd}", f"user-{user}", rnd, history,
                                    spec.output_tokens or spec.answer_tokens, sizer))
            history.append(_message("assistant", sizer.text(spec.answer_tokens, f"{seed}/{kind}/answer/{user}/{rnd}")))
        sessions.append(tuple(session))
    return tuple(sessions)


def _long_doc_qa(spec: LongDocQASpec, sizer: TextSizer, seed: int) -> tuple:
    """One single-request session per (document, question) pair, in the spec's order."""
    kind = spec.kind
    system = _system(sizer, spec.system_prompt_tokens, seed, kind)
    documents = [sizer.text(spec.document_tokens, f"{seed}/{kind}/document/{d}") for d in range(spec.documents)]
    sessions = []
    for doc, q in _order(spec.documents, spec.questions_per_document, spec.order):
        question = sizer.text(spec.question_tokens, f"{seed}/{kind}/question/{doc}/{q}")
        rid = f"doc-{doc}/question-{q}"
        sessions.append((_request(rid, rid, 0, [*system, _message("user", documents[doc] + question)],
                                  spec.output_tokens, sizer),))
    return tuple(sessions)


def _shared_prefix(spec: SharedPrefixSpec, sizer: TextSizer, seed: int) -> tuple:
    """One single-request session per prompt: [user: group prefix + own suffix]."""
    kind = spec.kind
    prefixes = [sizer.text(spec.prefix_tokens, f"{seed}/{kind}/prefix/{g}") for g in range(spec.groups)]
    sessions = []
    for group, p in _order(spec.groups, spec.prompts_per_group, spec.order):
        suffix = sizer.text(spec.suffix_tokens, f"{seed}/{kind}/suffix/{group}/{p}")
        rid = f"group-{group}/prompt-{p}"
        messages = [_message("user", prefixes[group] + suffix)]
        sessions.append((_request(rid, rid, 0, messages, spec.output_tokens, sizer),))
    return tuple(sessions)


def _random(spec: RandomSpec, sizer: TextSizer, seed: int) -> tuple:
    """One single-request session per prompt of fresh random text; lengths from the spec's distributions."""
    lengths = random.Random(f"kvgate-lengths:{seed}/random")
    sessions = []
    for i in range(spec.requests):
        n_in, n_out = spec.input_tokens.sample(lengths), spec.output_tokens.sample(lengths)
        rid = f"request-{i}"
        sessions.append((_request(rid, rid, 0, [_message("user", sizer.text(n_in, f"{seed}/random/prompt/{i}"))],
                                  n_out, sizer),))
    return tuple(sessions)


# --------------------------------------------------------------------------- trace replay


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Union[str, Path], limit: Optional[int] = None) -> list[TraceRecord]:
    """The first `limit` records (all when None) of a Mooncake trace; a malformed line raises ConfigError."""
    records: list[TraceRecord] = []
    try:
        with open(path, "rb") as lines:
            for number, raw in enumerate(lines, 1):
                if limit is not None and len(records) >= limit:
                    break
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise ConfigError(f"{path}:{number}: expected UTF-8 text, found byte "
                                      f"0x{raw[error.start]:02x} at column {error.start + 1}") from None
                if line.strip():
                    records.append(_trace_record(line, f"{path}:{number}"))
    except OSError as error:
        raise ConfigError(f"workload.path: expected a readable trace file, found {error}") from None
    return records


def _trace_record(line: str, where: str) -> TraceRecord:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: expected a JSON object, found {error}") from None
    checks = {
        "timestamp": (f"a number in 0..{MAX_TRACE_TIMESTAMP_MS:.0e} (ms)",
                      lambda v: type(v) in (int, float) and 0 <= v <= MAX_TRACE_TIMESTAMP_MS),
        "input_length": ("an integer >= 1", lambda v: type(v) is int and v >= 1),
        "output_length": ("an integer >= 0", lambda v: type(v) is int and v >= 0),
        "hash_ids": ("a list of integers", lambda v: isinstance(v, list) and all(type(h) is int for h in v)),
    }
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, found {row!r}")
    for key, (expected, ok) in checks.items():
        if not ok(row.get(key)):
            raise ConfigError(f"{where}: {key}: expected {expected}, found {row.get(key)!r}")
    return TraceRecord(row["timestamp"], row["input_length"], row["output_length"], tuple(row["hash_ids"]))


def scaled_block_tokens(spec: TraceSpec) -> int:
    """Tokens per hash id after `length_scale` (rounded, at least 1)."""
    return max(1, round(spec.block_tokens * spec.length_scale))


def _scaled_input(record: TraceRecord, block: int, scaled_block: int) -> int:
    """The input length scaled by scaled_block / block, keeping the record's number of blocks.

    When the length agrees with the hash ids (len(hash_ids) blocks, the last
    one possibly partial), every full block stays full and the last one is
    scaled and kept at 1..scaled_block tokens, so the block structure is exact.
    """
    n_ids, factor = len(record.hash_ids), scaled_block / block
    if n_ids and (n_ids - 1) * block < record.input_length <= n_ids * block:
        last = record.input_length - (n_ids - 1) * block
        return (n_ids - 1) * scaled_block + min(max(int(last * factor + 0.5), 1), scaled_block)
    return max(1, int(record.input_length * factor + 0.5))


def check_trace_path(spec: TraceSpec, root: str = "workload") -> Path:
    """The spec's trace file; ConfigError naming `root.path` when it is not given or not a file."""
    if spec.path is None:
        raise ConfigError(f"{root}.path: expected an existing trace file (JSONL), found nothing (give it in the "
                          "config or with `kvgate run --trace FILE`)")
    if not spec.path.is_file():
        raise ConfigError(f"{root}.path: expected an existing trace file (JSONL), found {str(spec.path)!r}")
    return spec.path


def check_trace(spec: TraceSpec, root: str = "workload") -> None:
    """The trace file exists and the records the spec uses (its warm-up and measured ones) parse;
    ConfigError naming the field or the file's line otherwise: checked at load, before anything starts."""
    path = check_trace_path(spec, root)
    limit = spec.warmup_requests + (spec.limit if spec.limit is not None else MAX_TRACE_REQUESTS + 1)
    records = read_trace(path, limit)
    if not records:
        raise ConfigError(f"{root}.path: expected a trace file with at least one request, found an empty file "
                          f"{str(path)!r}")
    if len(records) - spec.warmup_requests > MAX_TRACE_REQUESTS:
        raise ConfigError(f"{root}.limit: expected a limit for a trace of more than {MAX_TRACE_REQUESTS:,} measured "
                          f"requests ({str(path)!r}): a run replays a slice of it per block, and builds it whole "
                          f"first; give limit: N (the N requests after the warm-up are measured)")


def _trace(spec: TraceSpec, sizer: TextSizer, seed: int) -> tuple:
    """One single-request session per record, warm-up ones first; equal hash ids become equal text blocks.

    Block text is a function of (seed, hash id) only, so requests sharing a
    prefix of hash ids share that prefix of text (across warm-up and measured
    requests too). The prompt is the blocks in order, the last cut so the
    prompt has the scaled input length; tokens beyond the hash ids (when a
    trace has more) are the request's own text. Warm-up requests have no
    arrival time; measured ones arrive at their timestamp less the first
    measured one's, times `time_scale`.
    """
    path = check_trace_path(spec)
    block = scaled_block_tokens(spec)
    blocks: dict[int, str] = {}

    def block_text(hash_id: int) -> str:
        if hash_id not in blocks:
            blocks[hash_id] = sizer.text(block, f"{seed}/trace/block/{hash_id}")
        return blocks[hash_id]

    warmup = spec.warmup_requests
    records = read_trace(path, None if spec.limit is None else warmup + spec.limit)
    if len(records) <= warmup:
        raise ConfigError(f"workload.warmup_requests: expected fewer than the trace's {len(records)} requests, "
                          f"found {warmup}")
    origin_ms = records[warmup].timestamp_ms
    sessions = []
    for i, record in enumerate(records):
        n_in = _scaled_input(record, spec.block_tokens, block)
        n_blocks = min(len(record.hash_ids), math.ceil(n_in / block))
        parts = [block_text(h) for h in record.hash_ids[:n_blocks]]
        if n_in > n_blocks * block:
            parts.append(sizer.text(n_in - n_blocks * block, f"{seed}/trace/tail/{i}"))
        elif n_in < n_blocks * block:
            parts[-1] = "".join(sizer.tokens(parts[-1])[: n_in - (n_blocks - 1) * block])
        n_out = max(1, int(record.output_length * block / spec.block_tokens + 0.5))
        if spec.max_output_tokens is not None:
            n_out = min(n_out, spec.max_output_tokens)
        rid = f"trace-{i}"
        sessions.append((_request(rid, rid, 0, [_message("user", "".join(parts))], n_out, sizer,
                                  arrival_s=None if i < warmup
                                  else (record.timestamp_ms - origin_ms) / 1000 * spec.time_scale),))
    return tuple(sessions)


# --------------------------------------------------------------------------- reuse


@dataclass(frozen=True)
class ReuseSummary:
    """Prompt tokens of a workload, and how many lie in blocks whose whole prefix came before."""

    prompt_tokens: int
    reused_tokens: int
    block_tokens: int

    @property
    def fraction(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def reuse_summary(workload: Workload, block_tokens: int, sizer: Optional[TextSizer] = None) -> ReuseSummary:
    """How many prompt tokens a prefix cache of `block_tokens`-token blocks could reuse.

    Each request's prompt is its message contents concatenated (no chat
    template), cut into tokens by `sizer` (default `ByteSizer`: characters)
    and into full blocks; a block counts as reused when the same block with
    the same whole prefix appeared earlier in the workload (a prefix cache's
    rule, block keys chained like the cache's). Partial last blocks never count.
    The count does not depend on the order of the requests.
    """
    sizer = sizer or ByteSizer()
    seen: set[bytes] = set()
    total = reused = 0
    for request in workload.requests:
        tokens = sizer.tokens("".join(m["content"] for m in request.messages))
        total += len(tokens)
        key = b""
        for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
            piece = "".join(tokens[start:start + block_tokens]).encode()
            key = hashlib.blake2b(key + piece, digest_size=16).digest()
            if key in seen:
                reused += block_tokens
            seen.add(key)
    return ReuseSummary(prompt_tokens=total, reused_tokens=reused, block_tokens=block_tokens)

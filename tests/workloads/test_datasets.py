"""Workloads are data: a spec and a seed build the same prompts every time, of the stated sizes and reuse."""

from __future__ import annotations

import json
import math
import re
import string
from pathlib import Path

import pytest

from cache_impl.cache.config import ConfigError
from cache_impl.engine.tokenizer import TOKENIZER_ID, ByteTokenizer
from tests.traces import TRACE_PATH, needs_real_trace, write_trace
from workloads.traffic.datasets import (
    ByteSizer,
    LongDocQASpec,
    MultiRoundQASpec,
    RandomSpec,
    SharedPrefixSpec,
    TokenizerError,
    TokenizerSizer,
    TraceSpec,
    WordSizer,
    build_workload,
    load_spec,
    reuse_summary,
    sizer_for,
)
from workloads.traffic.requests import Workload, WorkloadRequest

SPECS_DIR = Path(__file__).resolve().parents[2] / "workloads" / "specs"
BYTES, WORDS = ByteSizer(), WordSizer()

MULTI_ROUND = {
    "kind": "multi_round_qa", "users": 3, "rounds": 4, "system_prompt_tokens": 100,
    "document_tokens": 300, "question_tokens": 20, "answer_tokens": 40,
}
LONG_DOC = {
    "kind": "long_doc_qa", "documents": 3, "document_tokens": 200, "questions_per_document": 2,
    "question_tokens": 10, "system_prompt_tokens": 30, "output_tokens": 8,
}
SHARED_PREFIX = {
    "kind": "shared_prefix", "groups": 3, "prompts_per_group": 4, "prefix_tokens": 160,
    "suffix_tokens": 48, "output_tokens": 8,
}
RANDOM = {
    "kind": "random", "requests": 20,
    "input_tokens": {"distribution": "uniform", "min": 50, "max": 400},
    "output_tokens": {"distribution": "fixed", "mean": 16},
}

# A hand-written Mooncake-style trace (512 tokens per hash id): requests 1-3
# reuse request 0's blocks [1] or [1, 2]; request 0's block 3 is partial
# (1200 = 2 * 512 + 176) and request 3's is full (1536 = 3 * 512).
SMALL_TRACE = [
    {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 4]},
    {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [1, 5]},
    {"timestamp": 2000, "input_length": 1536, "output_length": 7, "hash_ids": [1, 2, 3]},
]


def contents(request: WorkloadRequest) -> str:
    return "".join(m["content"] for m in request.messages)


def hash_id_reuse(hash_ids: list[list[int]], prompt_tokens: list[int], block: int) -> int:
    """Tokens in full blocks whose whole hash-id prefix appeared in an earlier request."""
    seen, reused = set(), 0
    for ids, tokens in zip(hash_ids, prompt_tokens):
        for j in range(min(len(ids), tokens // block)):
            reused += block if tuple(ids[: j + 1]) in seen else 0
            seen.add(tuple(ids[: j + 1]))
    return reused


# --------------------------------------------------------------------------- sizers


@pytest.mark.parametrize("n", [0, 1, 7, 255, 256, 1000, 4099])
def test_byte_sizer_text_is_exactly_n_printable_ascii_characters_and_n_byte_tokens(n):
    text = BYTES.text(n, "seed")
    assert len(text) == n and set(text) <= set(string.ascii_lowercase + " ")
    assert len(ByteTokenizer().encode(text, bos=False)) == n
    assert len(BYTES.tokens(text)) == n


@pytest.mark.parametrize("n", [0, 1, 5, 300])
def test_word_sizer_text_is_n_common_words_each_followed_by_a_space(n):
    text = WORDS.text(n, 3)
    words = text.split(" ")
    assert words[-1] == "" and len(words) - 1 == n and all(w.isalpha() and w.islower() for w in words[:-1])
    assert len(WORDS.tokens(text)) == n
    assert WORDS.tokens(text + WORDS.text(4, 9)) == WORDS.tokens(text) + WORDS.tokens(WORDS.text(4, 9))


def test_sizer_for_picks_the_byte_sizer_only_for_kvgate_byte_tokenizer():
    assert isinstance(sizer_for(TOKENIZER_ID), ByteSizer)
    assert isinstance(sizer_for(None), WordSizer)
    assert isinstance(sizer_for("meta-llama/Llama-3.1-8B-Instruct"), WordSizer)


@pytest.mark.parametrize("sizer", [BYTES, WORDS], ids=["byte", "word"])
def test_texts_are_a_function_of_their_seed(sizer):
    assert sizer.text(200, "7/doc/1") == sizer.text(200, "7/doc/1")
    assert sizer.text(200, "7/doc/1") != sizer.text(200, "7/doc/2")
    assert sizer.text(200, 1) != sizer.text(200, 2)


# --------------------------------------------------------------------------- all kinds


def all_kinds(tmp_path: Path) -> list[dict]:
    trace = {"kind": "trace", "path": str(write_trace(tmp_path, SMALL_TRACE)), "length_scale": 0.25}
    return [MULTI_ROUND, LONG_DOC, SHARED_PREFIX, RANDOM, trace]


@pytest.mark.parametrize("sizer", [BYTES, WORDS], ids=["byte", "word"])
def test_same_spec_and_seed_build_an_identical_workload_and_another_seed_other_texts(tmp_path, sizer):
    for spec in all_kinds(tmp_path):
        first, again = build_workload(spec, sizer, seed=5), build_workload(load_spec(dict(spec)), sizer, seed=5)
        assert isinstance(first, Workload) and first == again, spec["kind"]
        other = build_workload(spec, sizer, seed=6)
        assert [contents(r) for r in first.requests] != [contents(r) for r in other.requests], spec["kind"]
        if spec["kind"] != "random":       # random draws its lengths from the seed too
            assert [r.prompt_tokens for r in first.requests] == [r.prompt_tokens for r in other.requests]


@pytest.mark.parametrize("sizer", [BYTES, WORDS], ids=["byte", "word"])
def test_prompt_tokens_is_the_sized_total_of_the_message_contents(tmp_path, sizer):
    for spec in all_kinds(tmp_path):
        for request in build_workload(spec, sizer, seed=0).requests:
            assert request.prompt_tokens == len(sizer.tokens(contents(request))), request.request_id
            if sizer is BYTES:
                assert request.prompt_tokens == sum(len(m["content"]) for m in request.messages)


def test_request_ids_are_unique_and_turns_count_from_zero_in_each_session(tmp_path):
    for spec in all_kinds(tmp_path):
        workload = build_workload(spec, BYTES, seed=0)
        ids = [r.request_id for r in workload.requests]
        assert len(ids) == len(set(ids))
        for session in workload.sessions:
            assert [r.turn for r in session] == list(range(len(session)))
            assert len({r.session_id for r in session}) == 1


# --------------------------------------------------------------------------- multi-round QA


def test_multi_round_history_extends_the_previous_round_with_an_answer_and_a_question():
    workload = build_workload(MULTI_ROUND, BYTES, seed=1)
    assert len(workload.sessions) == 3 and all(len(s) == 4 for s in workload.sessions)
    for session in workload.sessions:
        assert [m["role"] for m in session[0].messages] == ["system", "user"]
        for previous, current in zip(session, session[1:]):
            assert current.messages[: len(previous.messages)] == previous.messages
            added = current.messages[len(previous.messages):]
            assert [m["role"] for m in added] == ["assistant", "user"]
            assert [len(m["content"]) for m in added] == [40, 20]
        assert session[-1].prompt_tokens == 100 + 300 + 4 * 20 + 3 * 40
        assert all(r.max_tokens == 40 for r in session)     # output_tokens defaults to answer_tokens


def test_multi_round_system_prompt_is_shared_and_documents_differ_between_users():
    workload = build_workload(MULTI_ROUND, BYTES, seed=1)
    firsts = [session[0] for session in workload.sessions]
    assert len({r.messages[0]["content"] for r in firsts}) == 1
    documents = [r.messages[1]["content"][:300] for r in firsts]
    assert len(set(documents)) == 3
    # every user's later rounds reuse all of round 0: system + document + question 0 (+ answer 0)
    summary = reuse_summary(workload, block_tokens=20)
    assert summary.reused_tokens >= 2 * 100 + 3 * sum(400 + i * 60 for i in range(3)) - 3 * 3 * 20


def test_multi_round_output_tokens_sets_max_tokens():
    workload = build_workload({**MULTI_ROUND, "output_tokens": 7}, BYTES, seed=0)
    assert {r.max_tokens for r in workload.requests} == {7}


# --------------------------------------------------------------------------- long-document QA


@pytest.mark.parametrize("order, expected", [
    ("interleaved", [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]),
    ("grouped", [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]),
])
def test_long_doc_qa_asks_each_document_its_questions_in_the_chosen_order(order, expected):
    workload = build_workload({**LONG_DOC, "order": order}, BYTES, seed=0)
    assert all(len(session) == 1 for session in workload.sessions)
    assert [r.request_id for r in workload.requests] == [f"doc-{d}/question-{q}" for d, q in expected]
    documents = {}
    for request, (doc, _) in zip(workload.requests, expected):
        system, user = request.messages
        assert system["role"] == "system" and len(system["content"]) == 30 and user["role"] == "user"
        documents.setdefault(doc, set()).add(user["content"][:200])
        assert len(user["content"]) == 210 and request.max_tokens == 8
    assert all(len(texts) == 1 for texts in documents.values()) and len({t for s in documents.values() for t in s}) == 3


def test_long_doc_qa_without_system_prompt_sends_only_the_user_message():
    workload = build_workload({**LONG_DOC, "system_prompt_tokens": 0}, BYTES, seed=0)
    assert all([m["role"] for m in r.messages] == ["user"] for r in workload.requests)


# --------------------------------------------------------------------------- shared prefix


def test_shared_prefix_prompts_of_a_group_share_exactly_the_prefix_and_groups_share_nothing():
    workload = build_workload(SHARED_PREFIX, BYTES, seed=2)
    prompts: dict[int, list[str]] = {}
    for request in workload.requests:
        group = int(request.request_id.split("/")[0].removeprefix("group-"))
        prompts.setdefault(group, []).append(contents(request))
    assert len(prompts) == 3 and all(len(p) == 4 and len(set(x[:160] for x in p)) == 1 for p in prompts.values())
    suffix_starts = [x[160:176] for p in prompts.values() for x in p]
    assert len(set(suffix_starts)) == len(suffix_starts)
    assert len({p[0][:16] for p in prompts.values()}) == 3
    # in 16-token blocks: every prompt but the first of its group reuses exactly its 160-token prefix
    summary = reuse_summary(workload, block_tokens=16)
    assert summary.reused_tokens == 3 * (4 - 1) * 160 and summary.prompt_tokens == 12 * (160 + 48)


# --------------------------------------------------------------------------- random


def test_random_workload_has_no_reuse():
    workload = build_workload({**RANDOM, "requests": 60}, BYTES, seed=0)
    assert reuse_summary(workload, block_tokens=16).reused_tokens == 0
    in_words = build_workload({**RANDOM, "requests": 60}, WORDS, seed=0)
    assert reuse_summary(in_words, block_tokens=4, sizer=WORDS).reused_tokens == 0


def test_random_lengths_follow_their_distributions():
    def lengths(distribution: dict) -> list[int]:
        spec = {**RANDOM, "requests": 400, "input_tokens": distribution}
        return [r.prompt_tokens for r in build_workload(spec, WORDS, seed=0).requests]

    assert set(lengths({"distribution": "fixed", "mean": 33})) == {33}
    uniform = lengths({"distribution": "uniform", "min": 10, "max": 20})
    assert min(uniform) == 10 and max(uniform) == 20
    normal = lengths({"distribution": "normal", "mean": 200, "std": 20, "min": 190})
    assert min(normal) == 190 and 195 < sum(normal) / len(normal) < 225
    lognormal = lengths({"distribution": "lognormal", "mean": 100, "std": 50, "max": 1000})
    assert 90 < sum(lognormal) / len(lognormal) < 110 and max(lognormal) <= 1000 and max(lognormal) > 200
    assert {r.max_tokens for r in build_workload(RANDOM, WORDS, seed=0).requests} == {16}


# --------------------------------------------------------------------------- trace replay


def test_trace_equal_hash_ids_become_equal_text_blocks(tmp_path):
    workload = build_workload({"kind": "trace", "path": str(write_trace(tmp_path, SMALL_TRACE))}, BYTES, seed=0)
    blocks: dict[int, set[str]] = {}
    for row, request in zip(SMALL_TRACE, workload.requests):
        text = contents(request)
        assert len(text) == request.prompt_tokens == row["input_length"]
        for j, hash_id in enumerate(row["hash_ids"]):
            blocks.setdefault(hash_id, set()).add(text[j * 512:(j + 1) * 512])
    # block 3 is cut to 176 tokens in request 0 and whole in request 3: the cut one is its beginning
    full3, cut3 = sorted(blocks.pop(3), key=len, reverse=True)
    assert len(full3) == 512 and full3.startswith(cut3) and len(cut3) == 176
    assert all(len(texts) == 1 for texts in blocks.values())
    assert len({next(iter(texts))[:100] for texts in blocks.values()}) == len(blocks)


def test_trace_reuse_summary_matches_the_shared_hash_ids(tmp_path):
    workload = build_workload({"kind": "trace", "path": str(write_trace(tmp_path, SMALL_TRACE))}, BYTES, seed=0)
    summary = reuse_summary(workload, block_tokens=512)
    assert summary.reused_tokens == 5 * 512           # [1] three times, [1, 2] twice
    assert summary.prompt_tokens == 1200 + 1100 + 600 + 1536
    assert summary.reused_tokens == hash_id_reuse([r["hash_ids"] for r in SMALL_TRACE],
                                                  [r["input_length"] for r in SMALL_TRACE], 512)


def test_trace_time_scale_multiplies_arrivals_and_length_scale_keeps_the_block_structure(tmp_path):
    path = str(write_trace(tmp_path, SMALL_TRACE))
    workload = build_workload({"kind": "trace", "path": path, "time_scale": 0.5, "length_scale": 0.25}, BYTES, seed=0)
    assert [r.arrival_s for r in workload.requests] == [0.0, 0.25, 0.75, 1.0]
    # blocks of 128 tokens; whole blocks stay whole, the last one is scaled: 176 -> 44, 76 -> 19, 88 -> 22
    assert [r.prompt_tokens for r in workload.requests] == [2 * 128 + 44, 2 * 128 + 19, 128 + 22, 3 * 128]
    assert [r.max_tokens for r in workload.requests] == [3, 5, 1, 2]
    assert reuse_summary(workload, block_tokens=128).reused_tokens == 5 * 128
    for row, request in zip(SMALL_TRACE, workload.requests):
        assert math.ceil(request.prompt_tokens / 128) == len(row["hash_ids"])
    unscaled = build_workload({"kind": "trace", "path": path}, BYTES, seed=0)
    assert [r.arrival_s for r in unscaled.requests] == [0.0, 0.5, 1.5, 2.0]


def test_trace_limit_and_output_cap(tmp_path):
    spec = {"kind": "trace", "path": str(write_trace(tmp_path, SMALL_TRACE)), "limit": 2, "max_output_tokens": 12}
    workload = build_workload(spec, WORDS, seed=0)
    assert [r.max_tokens for r in workload.requests] == [10, 12]
    assert all(len(s) == 1 and s[0].session_id == s[0].request_id for s in workload.sessions)


def test_trace_path_in_a_spec_file_is_relative_to_the_file(tmp_path):
    write_trace(tmp_path, SMALL_TRACE)
    (tmp_path / "spec.yaml").write_text("kind: trace\npath: trace.jsonl\n")
    spec = load_spec(tmp_path / "spec.yaml")
    assert spec.path == tmp_path / "trace.jsonl" and len(build_workload(spec, BYTES, 0).requests) == 4


def test_trace_missing_file_or_bad_line_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="workload.path: expected an existing trace file"):
        build_workload({"kind": "trace", "path": str(tmp_path / "absent.jsonl")}, BYTES, 0)
    path = write_trace(tmp_path, [SMALL_TRACE[0], {**SMALL_TRACE[1], "input_length": -3}])
    with pytest.raises(ConfigError, match="trace.jsonl:2: input_length: expected an integer >= 1, found -3"):
        build_workload({"kind": "trace", "path": str(path)}, BYTES, 0)



@pytest.mark.parametrize("line, said", [
    ('{"timestamp": Infinity, "input_length": 8, "output_length": 1, "hash_ids": [1]}',
     "trace.jsonl:2: timestamp: expected a number in 0..1e+13 (ms), found inf"),
    ('{"timestamp": 1e308, "input_length": 8, "output_length": 1, "hash_ids": [1]}',
     "trace.jsonl:2: timestamp: expected a number in 0..1e+13 (ms), found 1e+308"),
])
def test_a_trace_timestamp_no_replay_can_reach_is_refused_naming_its_line(tmp_path, line, said):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(SMALL_TRACE[0]) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=re.escape(said)):
        build_workload({"kind": "trace", "path": str(path)}, BYTES, 0)


def test_a_trace_line_that_is_not_utf8_is_refused_naming_its_line_and_byte(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(json.dumps(SMALL_TRACE[0]).encode() + b"\n" + b'{"timestamp": 1\xff}\n')
    with pytest.raises(ConfigError, match=r"trace.jsonl:2: expected UTF-8 text, found byte 0xff at column 16"):
        build_workload({"kind": "trace", "path": str(path)}, BYTES, 0)

@needs_real_trace
def test_real_mooncake_trace_keeps_its_reuse_fraction_when_scaled_down():
    spec = load_spec({"kind": "trace", "path": str(TRACE_PATH), "limit": 500, "length_scale": 0.05})
    workload = build_workload(spec, BYTES, seed=0)
    requests = workload.requests
    rows = [json.loads(line) for _, line in zip(range(500), TRACE_PATH.open())]
    assert len(requests) == 500
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] == rows[-1]["timestamp"] / 1000
    block = 26                                                    # round(512 * 0.05)
    for row, request in zip(rows, requests):
        assert math.ceil(request.prompt_tokens / block) == len(row["hash_ids"])
        assert abs(request.prompt_tokens - row["input_length"] * block / 512) <= 1
    from_ids = hash_id_reuse([r["hash_ids"] for r in rows], [r.prompt_tokens for r in requests], block)
    summary = reuse_summary(workload, block_tokens=block)
    assert summary.reused_tokens == from_ids and summary.fraction > 0.1
    unscaled = hash_id_reuse([r["hash_ids"] for r in rows], [r["input_length"] for r in rows], 512)
    assert abs(summary.fraction - unscaled / sum(r["input_length"] for r in rows)) < 0.01


# --------------------------------------------------------------------------- reuse summary


def test_reuse_summary_counts_full_blocks_with_a_seen_prefix_in_any_order():
    def request(i: int, text: str) -> tuple[WorkloadRequest, ...]:
        return (WorkloadRequest(f"r{i}", f"r{i}", 0, ({"role": "user", "content": text},), 1, len(text)),)

    a, b, c = BYTES.text(40, "a"), BYTES.text(40, "b"), BYTES.text(5, "c")
    sessions = (request(0, a + b + c), request(1, a + b), request(2, b + a), request(3, a + c))
    summary = reuse_summary(Workload("w", sessions), block_tokens=10)
    # request 1 reuses 8 blocks, request 3 reuses the 4 blocks of `a`; b + a shares no prefix
    assert summary.reused_tokens == 120 and summary.prompt_tokens == 85 + 80 + 80 + 45
    assert reuse_summary(Workload("w", sessions[::-1]), block_tokens=10).reused_tokens == 120


# --------------------------------------------------------------------------- specs


@pytest.mark.parametrize("spec, message", [
    ({**MULTI_ROUND, "colour": "red"}, "workload.colour: unknown field"),
    ({**MULTI_ROUND, "document_tokens": -5}, "workload.document_tokens: expected a value >= 0, found -5"),
    ({**MULTI_ROUND, "users": "3"}, "workload.users: expected an integer, found '3'"),
    ({**MULTI_ROUND, "kind": "chat"}, "workload.kind: expected one of 'multi_round_qa', 'long_doc_qa', "
                                      "'shared_prefix', 'random', 'trace', found 'chat'"),
    ({"users": 3}, "workload.kind: expected a value (required), found nothing"),
    ({k: v for k, v in MULTI_ROUND.items() if k != "rounds"}, "workload.rounds: expected a value (required)"),
    ({**LONG_DOC, "order": "shuffled"}, "workload.order: expected one of 'grouped' or 'interleaved', found 'shuffled'"),
    ({**SHARED_PREFIX, "suffix_tokens": 0}, "workload.suffix_tokens: expected a value >= 1, found 0"),
    ({**RANDOM, "input_tokens": {"distribution": "normal", "mean": 10}},
     "workload.input_tokens: expected 'std' for distribution 'normal', found nothing"),
    ({**RANDOM, "output_tokens": {"distribution": "zipf", "mean": 10}},
     "workload.output_tokens.distribution: expected one of 'fixed', 'uniform', 'normal' or 'lognormal', found 'zipf'"),
    ({**RANDOM, "input_tokens": {"distribution": "uniform", "min": 10, "max": 5}},
     "workload.input_tokens: expected max >= min (10), found max 5"),
    ({"kind": "trace", "path": "t.jsonl", "time_scale": 0}, "workload.time_scale: expected a value > 0"),
    ({"kind": "trace", "path": "t.jsonl", "block_size": 512}, "workload.block_size: unknown field"),
])
def test_bad_spec_raises_config_error_naming_the_field(spec, message):
    with pytest.raises(ConfigError) as error:
        load_spec(spec)
    assert message in str(error.value)


def test_spec_file_that_is_not_a_mapping_is_a_config_error(tmp_path):
    (tmp_path / "list.yaml").write_text("- kind: random\n")
    with pytest.raises(ConfigError, match="workload: expected a mapping"):
        load_spec(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="workload: expected a readable YAML file"):
        load_spec(tmp_path / "absent.yaml")


def test_every_spec_field_is_documented():
    for model in (MultiRoundQASpec, LongDocQASpec, SharedPrefixSpec, RandomSpec, TraceSpec):
        assert all(field.description for field in model.model_fields.values()), model.__name__


def test_example_specs_cover_every_kind_and_build_prompts_of_a_few_thousand_tokens():
    paths = sorted(SPECS_DIR.glob("*.yaml"))
    kinds = {}
    for path in paths:
        spec = load_spec(path)
        kinds[spec.kind] = path
        assert "#" in path.read_text(), f"{path.name} has no comments"
        if spec.kind == "trace":                        # the trace is the user's, never shipped
            assert spec.path is None, f"{path.name} names a trace file of some machine: {spec.path}"
            with pytest.raises(ConfigError, match="workload.path: expected an existing trace file .JSONL., "
                                                  "found nothing"):
                build_workload(spec, BYTES, seed=0)
            continue
        workload = build_workload(spec, BYTES, seed=0)
        assert workload.requests and max(r.prompt_tokens for r in workload.requests) <= 8192, path.name
    assert set(kinds) == {"multi_round_qa", "long_doc_qa", "shared_prefix", "random", "trace"}


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A real BPE tokenizer.json (merges learned from kvgate's words), as a model directory ships it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([WORDS.text(400, i) for i in range(20)], trainer)
    directory = tmp_path_factory.mktemp("model")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, tokenizer


def test_a_tokenizer_directory_sizes_texts_in_its_own_tokens(bpe_tokenizer):
    directory, tokenizer = bpe_tokenizer
    sizer = sizer_for(str(directory))
    assert isinstance(sizer, TokenizerSizer)
    for n in (1, 37, 500):
        text = sizer.text(n, f"doc/{n}")
        assert len(tokenizer.encode(text, add_special_tokens=False).ids) == n
        pieces = sizer.tokens(text)
        assert len(pieces) == n and "".join(pieces) == text
    assert sizer.name == f"tokenizer {directory}"


def test_a_tokenizer_that_cannot_be_read_is_an_error_naming_it(tmp_path):
    with pytest.raises(TokenizerError, match="no such file or directory"):
        sizer_for(str(tmp_path / "absent"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizers reads"):
        sizer_for(str(tmp_path))
    assert isinstance(sizer_for("meta-llama/Llama-3.1-8B-Instruct"), WordSizer)    # an id: words, as before


def test_a_trace_longer_than_a_run_replays_needs_a_limit_and_one_within_it_loads(tmp_path, monkeypatch):
    import workloads.traffic.datasets as datasets

    monkeypatch.setattr(datasets, "MAX_TRACE_REQUESTS", 3)            # the bound, made small enough to write
    path = write_trace(tmp_path, SMALL_TRACE)                          # 4 requests
    with pytest.raises(ConfigError, match=r"^workload.limit: expected a limit for a trace of more than 3 measured "):
        datasets.check_trace(load_spec({"kind": "trace", "path": str(path)}))
    datasets.check_trace(load_spec({"kind": "trace", "path": str(path), "limit": 3}))
    datasets.check_trace(load_spec({"kind": "trace", "path": str(path), "warmup_requests": 1}))   # 3 measured

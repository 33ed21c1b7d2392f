"""The run directory's store, as the gates use it (the schema and the store live in kvcore.rundata)."""

from kvcore.files import append_jsonl, read_jsonl_file as read_jsonl, write_json
from kvcore.rundata import GATE_TITLES, GATES, RunStore, Unjudged, Verdict

__all__ = ["GATE_TITLES", "GATES", "RunStore", "Unjudged", "Verdict", "append_jsonl", "read_jsonl", "write_json"]

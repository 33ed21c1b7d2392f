"""The profiles are data (gates/profiles/quick.yaml, full.yaml) and `kvgate init`'s template is written from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field

from gates.config import PROFILE_NAMES, load_config, profile_defaults
from gates.template import WIDTH, _section, render_template
from kvcore.settings import ConfigError

# each profile's validated configuration as it was when the profiles were Python dicts in gates/config.py
# (storage.path as given, before it is made absolute); a deliberate change to a profile updates this file
VALIDATED = Path(__file__).parents[1] / "data" / "profiles_validated.json"


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_each_profile_validates_to_the_configuration_it_gave_as_python(name):
    validated = load_config(profile=name).model_dump(mode="json")
    assert validated["storage"]["path"] == str(Path("kvgate-storage").absolute())
    validated["storage"]["path"] = "kvgate-storage"
    assert json.loads(json.dumps(validated)) == json.loads(VALIDATED.read_text())[name]


def test_an_unknown_profile_names_the_field_and_the_profiles_there_are():
    with pytest.raises(ConfigError, match=r"^profile: expected one of \['full', 'quick'\], found 'medium'$"):
        profile_defaults("medium")


def _leaves(value, path=()):
    """(path, value) of every scalar, scalar list and list of mappings below `value`."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    else:
        yield path, value


def _at(value, path):
    for key in path:
        value = value[key]
    return value


def test_every_value_in_the_template_equals_the_quick_profiles():
    template = yaml.safe_load(render_template())
    validated = load_config(profile="quick").model_dump(mode="json")
    compared = 0
    for path, value in _leaves({k: v for k, v in template.items() if k != "claims"}):
        expected = _at(validated, path)
        if path == ("storage", "path"):
            assert str(Path(value).absolute()) == expected
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            assert len(value) == len(expected), path
            for item, full in zip(value, expected):     # the profile's items, with the defaults validation fills in
                assert {key: full[key] for key in item} == item, path
        else:
            assert value == expected, path
        compared += 1
    assert compared > 100
    assert template["claims"] == [{k: v for k, v in c.items() if v not in ("", None)}
                                  for c in validated["claims"]]


def test_the_template_says_each_thresholds_meaning_and_fits_its_width():
    text = render_template()
    assert "- {metric: error_rate, op: \"<=\", value: 0.001}  # failed requests / requests over the soak" in text
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_an_unset_section_is_written_commented_out_with_its_examples_once_per_kind():
    text = render_template()
    assert '  #   url: "http://10.0.0.6:8000/v1"' in text and "  # baseline:" in text       # one written out
    assert "  # candidate: {…}" in text and "the keys of targets.baseline" in text          # the next pointing to it
    assert "  #   model_config: /models/Llama-3.1-70B/config.json" in text               # sizing.target's example
    assert "# ttft_slo_ms: 2000" in text                                                     # an unset key's example


class _Section(BaseModel):
    """A section the template is asked to write."""

    said: int = Field(default=1, description="a key with its comment")
    silent: int = 2


def test_a_key_without_a_description_is_an_error_naming_its_path():
    with pytest.raises(KeyError, match="g9.silent: no description to write in the template"):
        _section(_Section, {}, {"said": 1, "silent": 2}, "g9.", [])

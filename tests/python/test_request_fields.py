"""The Python front end's names are the request vocabulary's (engine/request_fields.h): every
option it names is a keyword of r3.SamplingParams, and every keyword of it is named there."""
import re

import pytest

import r3
from r3._r3 import _request_fields


def _keywords():
    doc = r3.SamplingParams.__init__.__doc__
    return set(re.findall(r"(\w+): [^,)]+ = ", doc))


def test_python_names_are_the_vocabularys():
    named = set()
    for row in _request_fields():
        for name in filter(None, row["names"]["python"].split("|")):
            named.add(name)
    named.discard("prompts")  # LLM.generate's first argument, not a sampling keyword
    keywords = _keywords()
    assert named <= keywords, sorted(named - keywords)
    # n: how many samples per prompt, a request-level count rather than an option of each.
    assert keywords - named == {"n"}, sorted(keywords - named)


@pytest.mark.parametrize("name,value", [("max_tokens", 3), ("temperature", 0.5), ("top_k", 4),
                                        ("routed_experts_prompt_start", 2), ("stop", "x")])
def test_each_python_name_is_taken(name, value):
    r3.SamplingParams(**{name: value})


def test_a_wrong_type_is_refused():
    with pytest.raises(TypeError):
        r3.SamplingParams(max_tokens="many")

"""A JSON reply cut by its cap ends in one complete value (#52): what closes every prefix of a
JSON text, and a real capped reply in llama.cpp's JSON grammar."""
from __future__ import annotations

import json

import pytest

from engine.llama.json_tail import JsonTail

DOCS = [json.dumps({"name": "Felix", "age": 12, "tags": ["a", 'b\n"q', {"x": [1, -2.5e-3, True, None]}],
                    "u": "été", "o": {}, "e": []}),
        json.dumps({"u": "été"}, ensure_ascii=True),  # \u escapes
        '[1, [2, [3, {"k": "v", "l": [false]}]], false, "x"]', '{"a": {"b": {"c": []}}}',
        '  {  "spaced" :  [ 1 ,  2 ] , "t" : true , "n": 1e+5}  ']


@pytest.mark.parametrize("doc", DOCS)
def test_every_prefix_of_a_json_text_closes_into_json(doc):
    json.loads(doc)  # the document itself is JSON
    for cut in range(len(doc) + 1):
        tail = JsonTail()
        tail.feed(doc[:cut])
        json.loads(doc[:cut] + tail.closer())  # raises where the closer is wrong
    tail = JsonTail()
    tail.feed(doc)
    assert tail.closer() == "" and tail.done


def test_a_capped_json_reply_is_one_whole_value(text_runtime):
    """SmolLM2 in llama.cpp's JSON grammar rambles on (greedy, a 300-token reply was cut inside
    a string): with json_reply, whatever the cap, the reply parses, within the cap."""
    from llama_cpp.llama_grammar import JSON_GBNF

    from engine.llama.sampling import GenParams

    msgs = [{"role": "user", "content": "List three fruits as JSON."}]
    for cap in (1, 9, 30, 70):
        text_runtime.slot.reset()
        r = text_runtime.generate(msgs, GenParams(max_tokens=cap, temperature=0,
                                                  grammar=str(JSON_GBNF), json_reply=True))
        assert isinstance(json.loads(r.text), dict), (cap, r.text)
        assert r.stats.n_gen_tokens <= cap

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


def test_a_value_that_goes_round_is_seen_and_one_that_does_not_is_not():
    """#67: llama.cpp's JSON grammar lets a small model go round until the cap ({"blue": {"red":
    {"green": … ever deeper, or the same pair again and again); `looping` sees both, and never
    a long list of different items or a deep but closing document."""
    def fed(text: str) -> JsonTail:
        t = JsonTail()
        t.feed(text)
        return t

    deeper = '{\n  "blue"\n:\n{\n  "red"\n:\n{\n  "green"\n:\n{\n  "purple"\n:\n{\n  "blue"\n:\n{\n  "red"\n:\n{\n "g"\n:\n{\n "p":\n{'
    assert fed(deeper).looping() and not fed(deeper[:40]).looping()
    again = '{"answer": "yes", ' + '"answer": "yes", ' * 6
    assert fed(again).looping() and not fed('{"answer": "yes", "answer": "yes", ').looping()
    assert not fed("[" + "0, " * 200).looping()  # a row of zeros is data
    fruits = json.dumps({"fruits": [f"fruit number {i}" for i in range(40)]})[:-2]
    assert not fed(fruits).looping()
    numbers = "[" + ", ".join(str(i * 7) for i in range(60))
    assert not fed(numbers).looping()
    assert not fed('{"a": {"b": {"c": {"d": [1]}}}, "e": {"f": {"g": {"h": [2]}}}, "i": {"j": {').looping()
    assert not fed(DOCS[0]).looping()  # done: nothing to close


def test_a_json_reply_that_goes_round_is_closed_then_and_ends_as_a_stop(text_runtime):
    """The colour prompt that went {"blue": {"red": … to its 300-token cap ends, closed, well
    before it, with finish "stop"."""
    from llama_cpp.llama_grammar import JSON_GBNF

    from engine.llama.sampling import GenParams
    from engine.stops import StopReason

    text_runtime.slot.reset()
    r = text_runtime.generate([{"role": "user", "content": "Name a colour."}],
                              GenParams(max_tokens=300, temperature=0, grammar=str(JSON_GBNF),
                                        json_reply=True))
    json.loads(r.text)
    if r.stats.stop_reason == StopReason.STOP and r.stats.n_gen_tokens < 300:
        return  # ended by itself (another CPU's arithmetic), or closed as a loop: both whole
    raise AssertionError((r.stats, r.text))

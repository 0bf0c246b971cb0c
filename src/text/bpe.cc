#include "text/bpe.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>

#include "core/cancellation.h"
#include "core/error.h"
#include "text/utf8.h"

namespace r3::text {

using json = nlohmann::json;

Bpe Bpe::parse(const json& m) {
  const std::string type = m.value("type", "BPE");
  if (type != "BPE")
    throw Error("tokenizer.json: model type \"" + type + "\" is not supported by r3 (only BPE)");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0)
    throw Error("tokenizer.json: BPE dropout is not supported by r3 (it makes encoding random)");
  if (!m.contains("vocab") || !m["vocab"].is_object())
    throw Error("tokenizer.json: BPE model without a vocab object");
  if (!m.contains("merges") || !m["merges"].is_array())
    throw Error("tokenizer.json: BPE model without a merges list");
  Bpe b;
  for (auto& [tok, id] : m["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (int64_t(1) << 30))
      throw Error("tokenizer.json: vocab entry \"" + tok + "\" has a bad id");
    const int32_t i = id.get<int32_t>();
    if (size_t(i) >= b.tokens_.size()) {
      b.tokens_.resize(size_t(i) + 1);
      b.has_token_.resize(size_t(i) + 1, false);
    }
    if (b.has_token_[size_t(i)])
      throw Error("tokenizer.json: vocab id " + std::to_string(i) + " appears twice");
    b.tokens_[size_t(i)] = tok;
    b.has_token_[size_t(i)] = true;
    b.vocab_.emplace(tok, i);
  }
  int32_t rank = 0;
  for (const json& mg : m["merges"]) {
    std::string a, c;
    if (mg.is_string()) {  // "a b" (older files)
      const std::string s = mg;
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos)
        throw Error("tokenizer.json: merge \"" + s + "\" is not two tokens");
      a = s.substr(0, sp);
      c = s.substr(sp + 1);
    } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
      a = mg[0];
      c = mg[1];
    } else
      throw Error("tokenizer.json: merge " + std::to_string(rank) +
                  " is neither \"a b\" nor [a, b]");
    auto ia = b.vocab_.find(a), ic = b.vocab_.find(c), ir = b.vocab_.find(a + c);
    if (ia == b.vocab_.end() || ic == b.vocab_.end())
      throw Error("tokenizer.json: merge " + std::to_string(rank) + " (\"" + a + "\", \"" + c +
                  "\") uses a token not in the vocab");
    if (ir == b.vocab_.end())
      throw Error("tokenizer.json: merge " + std::to_string(rank) + " makes \"" + a + c +
                  "\", which is not in the vocab");
    b.merges_.emplace(pair_key(ia->second, ic->second),
                      Merge{rank, ir->second});  // the first rank wins
    ++rank;
  }
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto it = b.vocab_.find(m["unk_token"].get<std::string>());
    if (it == b.vocab_.end()) throw Error("tokenizer.json: unk_token is not in the vocab");
    b.unk_ = it->second;
  }
  b.fuse_unk_ = m.value("fuse_unk", false);
  b.byte_fallback_ = m.value("byte_fallback", false);
  b.ignore_merges_ = m.value("ignore_merges", false);
  if (m.contains("continuing_subword_prefix") && m["continuing_subword_prefix"].is_string())
    b.prefix_ = m["continuing_subword_prefix"];
  if (m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string())
    b.suffix_ = m["end_of_word_suffix"];
  return b;
}

std::optional<int32_t> Bpe::id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* Bpe::token(int32_t id) const {
  if (id < 0 || size_t(id) >= tokens_.size() || !has_token_[size_t(id)]) return nullptr;
  return &tokens_[size_t(id)];
}

void Bpe::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(std::string(word));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // The word's characters as symbols (a doubly linked list merged in place). One word of
  // megabytes (a long run without spaces) takes seconds here, so both loops poll now and then
  // whether its request was cancelled (core/cancellation.h).
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  const std::vector<std::string_view> chars = utf8_chars(word);
  bool last_unk = false;
  for (size_t i = 0; i < chars.size(); ++i) {
    if ((i + 1) % 65536 == 0) throw_if_cancelled("tokenizing");
    std::string piece(chars[i]);
    if (i > 0) piece = prefix_ + piece;
    if (i + 1 == chars.size()) piece += suffix_;
    auto it = vocab_.find(piece);
    if (it != vocab_.end()) {
      sym.push_back({it->second, 0, 0, true});
      last_unk = false;
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      std::vector<int32_t> bytes;
      for (unsigned char c : chars[i]) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", c);
        auto bt = vocab_.find(name);
        if (bt == vocab_.end()) {
          all = false;
          break;
        }
        bytes.push_back(bt->second);
      }
      if (all) {
        for (int32_t id : bytes) sym.push_back({id, 0, 0, true});
        last_unk = false;
        continue;
      }
    }
    if (!unk_)
      throw Error("tokenizer: \"" + std::string(chars[i]) +
                  "\" is not in the vocabulary and the model has no unk_token");
    if (!(fuse_unk_ && last_unk)) sym.push_back({*unk_, 0, 0, true});
    last_unk = true;
  }
  const int n = int(sym.size());
  for (int i = 0; i < n; ++i) {
    sym[size_t(i)].prev = i - 1;
    sym[size_t(i)].next = i + 1 < n ? i + 1 : -1;
  }
  // Lowest rank first, then leftmost (as Hugging Face's Word::merge_all).
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto consider = [&](int pos) {
    const int nx = sym[size_t(pos)].next;
    if (nx < 0) return;
    auto it = merges_.find(pair_key(sym[size_t(pos)].id, sym[size_t(nx)].id));
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.result});
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  size_t steps = 0;
  while (!queue.empty()) {
    if (++steps % 65536 == 0) throw_if_cancelled("tokenizing");
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = sym[size_t(c.pos)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[size_t(left.next)];
    auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.result != c.result) continue;  // stale
    left.id = c.result;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[size_t(right.next)].prev = c.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(c.pos);
  }
  for (int i = 0; i >= 0 && i < n; i = sym[size_t(i)].next) out.push_back(sym[size_t(i)].id);
}

}  // namespace r3::text

#include "text/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/cancellation.h"
#include "core/error.h"
#include "core/file_read.h"
#include "core/json_limits.h"
#include "text/utf8.h"

namespace r3::text {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
// tokenizer.json of the large releases is tens of MB.
constexpr size_t kTokenizerFileLimit = size_t(512) << 20;

json parse_file_json(const std::string& text, const std::string& where) {
  try {
    return parse_json_bounded(text, where, 64);
  } catch (const json::exception& e) {
    throw Error(where + ": malformed JSON: " + e.what());
  }
}

// A special token entry of tokenizer_config.json: "text", {"content": "text", ...} or null.
std::string token_text(const json& j) {
  if (j.is_string()) return j;
  if (j.is_object() && j.contains("content") && j["content"].is_string()) return j["content"];
  return {};
}

char32_t char_before(std::string_view s, size_t i) {
  if (i == 0) return 0;
  size_t k = i - 1;
  while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
  size_t n;
  return utf8_decode_one(s, k, &n);
}
}  // namespace

bool Tokenizer::present(const std::string& dir) {
  return fs::exists(fs::path(dir) / "tokenizer.json");
}

std::shared_ptr<Tokenizer> Tokenizer::load(const std::string& dir) {
  const fs::path tj = fs::path(dir) / "tokenizer.json",
                 tc = fs::path(dir) / "tokenizer_config.json";
  if (!fs::exists(tj))
    throw Error(dir + ": no tokenizer.json (r3 reads Hugging Face fast-tokenizer files)");
  const std::string config =
      fs::exists(tc) ? read_text_file(tc.string(), kTokenizerFileLimit, "tokenizer_config") : "";
  auto t = from_json(read_text_file(tj.string(), kTokenizerFileLimit, "tokenizer"), config, dir);
  // Newer checkpoints (GPT-OSS among them) store the chat template as its own file; transformers
  // then uses it in place of tokenizer_config.json's chat_template.
  const fs::path jinja_file = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(jinja_file))
    t->chat_template_ = read_text_file(jinja_file.string(), kTokenizerFileLimit, "chat_template");
  return t;
}

std::shared_ptr<Tokenizer> Tokenizer::from_json(const std::string& tokenizer_json,
                                                const std::string& config_json,
                                                const std::string& where) {
  auto t = std::make_shared<Tokenizer>();
  const json j = parse_file_json(tokenizer_json, where + "/tokenizer.json");
  if (!j.is_object()) throw Error(where + "/tokenizer.json: not a JSON object");
  try {
    if (j.contains("truncation") && !j["truncation"].is_null())
      throw Error(
          "\"truncation\" is set; r3 never truncates a prompt silently (remove it from the file)");
    t->normalizer_ = Normalizer::parse(j.value("normalizer", json()));
    t->pre_tokenizer_ = PreTokenizer::parse(j.value("pre_tokenizer", json()));
    if (!j.contains("model")) throw Error("no \"model\"");
    t->model_ = Bpe::parse(j["model"]);
    t->decoder_ = Decoder::parse(j.value("decoder", json()));
    t->vocab_end_ = t->model_.vocab_end();
    for (const json& a : j.value("added_tokens", json::array())) {
      AddedToken at{a.at("id").get<int32_t>(),    a.at("content").get<std::string>(),
                    a.value("special", false),    a.value("lstrip", false),
                    a.value("rstrip", false),     a.value("normalized", false),
                    a.value("single_word", false)};
      if (at.id < 0 || at.content.empty())
        throw Error("added token \"" + at.content + "\" has a bad id or no content");
      if (!is_valid_utf8(at.content))
        throw Error("added token " + std::to_string(at.id) + " is not UTF-8");
      t->vocab_end_ = std::max(t->vocab_end_, at.id + 1);
      t->added_.push_back(std::move(at));
    }
    t->added_by_id_.assign(size_t(t->vocab_end_), -1);
    t->added_by_first_byte_.assign(256, {});
    for (size_t i = 0; i < t->added_.size(); ++i) {
      t->added_by_id_[size_t(t->added_[i].id)] = int32_t(i);
      t->added_by_first_byte_[static_cast<unsigned char>(t->added_[i].content[0])].push_back(i);
    }
    for (auto& v : t->added_by_first_byte_)
      std::stable_sort(v.begin(), v.end(), [&](size_t a, size_t b) {
        return t->added_[a].content.size() > t->added_[b].content.size();
      });
    // The post-processor: only what it adds to a single sequence matters to encode.
    for (const json& p :
         component_steps(j.value("post_processor", json()), "post_processor", "processors")) {
      const std::string type = p.value("type", "");
      auto id_of = [&](const std::string& tok) {
        auto id = t->token_to_id(tok);
        if (!id) throw Error("post_processor token \"" + tok + "\" is not in the vocabulary");
        return *id;
      };
      if (type == "ByteLevel") continue;  // offsets only
      if (type == "TemplateProcessing") {
        bool after = false;
        for (const json& item : p.value("single", json::array())) {
          if (item.contains("Sequence")) {
            after = true;
            continue;
          }
          const std::string name = item.at("SpecialToken").at("id");
          for (const json& id : p.at("special_tokens").at(name).at("ids"))
            (after ? t->template_suffix_ : t->template_prefix_).push_back(id.get<int32_t>());
        }
      } else if (type == "RobertaProcessing" || type == "BertProcessing") {
        t->template_prefix_.push_back(id_of(p.at("cls").at(0)));
        t->template_suffix_.push_back(id_of(p.at("sep").at(0)));
      } else
        throw Error("post_processor \"" + type +
                    "\" is not supported by r3 (supported: TemplateProcessing, "
                    "ByteLevel, RobertaProcessing, BertProcessing, Sequence)");
    }
  } catch (const json::exception& e) {
    throw Error(where + "/tokenizer.json: " + e.what());
  } catch (const Error& e) {
    const std::string msg = e.what();
    throw Error(msg.rfind("tokenizer.json", 0) == 0 ? where + "/" + msg
                                                    : where + "/tokenizer.json: " + msg);
  }
  if (!config_json.empty()) {
    const std::string cw = where + "/tokenizer_config.json";
    const json c = parse_file_json(config_json, cw);
    if (!c.is_object()) throw Error(cw + ": not a JSON object");
    t->bos_token_ = token_text(c.value("bos_token", json()));
    t->eos_token_ = token_text(c.value("eos_token", json()));
    for (const char* k : {"bos_token", "eos_token", "unk_token", "pad_token"})
      if (std::string v = token_text(c.value(k, json())); !v.empty())
        t->special_tokens_.emplace_back(k, v);
    for (const std::string* tok : {&t->bos_token_, &t->eos_token_})
      if (!tok->empty() && !t->token_to_id(*tok))
        throw Error(cw + ": special token \"" + *tok + "\" is not in the vocabulary");
    t->clean_up_spaces_ = c.value("clean_up_tokenization_spaces", false);
    const json ct = c.value("chat_template", json());
    if (ct.is_string())
      t->chat_template_ = ct;
    else if (ct.is_array()) {
      for (const json& e : ct) {
        if (!e.is_object() || !e.contains("name") || !e.contains("template") ||
            !e["name"].is_string() || !e["template"].is_string())
          throw Error(cw + ": chat_template list entries must be {\"name\", \"template\"}");
        t->named_templates_.emplace_back(e["name"], e["template"]);
        if (e["name"] == "default") t->chat_template_ = e["template"];
      }
    } else if (!ct.is_null())
      throw Error(cw + ": chat_template must be a string or a list of {name, template}");
  }
  return t;
}

const std::string* Tokenizer::named_chat_template(const std::string& name) const {
  for (const auto& [n, tpl] : named_templates_)
    if (n == name) return &tpl;
  return nullptr;
}

std::shared_ptr<const jinja::Template> Tokenizer::parsed_chat_template() const {
  if (chat_template_.empty())
    throw Error(
        "the tokenizer has no chat template (no chat_template in tokenizer_config.json, no "
        "chat_template.jinja); "
        "pass one");
  std::lock_guard<std::mutex> lk(parsed_mu_);
  if (!parsed_) parsed_ = std::make_shared<const jinja::Template>(chat_template_);
  return parsed_;
}

size_t Tokenizer::max_token_bytes() const {
  std::lock_guard<std::mutex> lk(parsed_mu_);
  if (max_token_bytes_ == 0) {
    size_t most = 1;
    for (int32_t id = 0; id < vocab_end_; ++id) {
      const int32_t one[1] = {id};
      most = std::max(most, decode_raw(one).size());
    }
    max_token_bytes_ = most;
  }
  return max_token_bytes_;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& a : added_)
    if (a.content == token) return a.id;
  return model_.id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (id >= 0 && size_t(id) < added_by_id_.size() && added_by_id_[size_t(id)] >= 0)
    return added_[size_t(added_by_id_[size_t(id)])].content;
  if (const std::string* t = model_.token(id)) return *t;
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && size_t(id) < added_by_id_.size() && added_by_id_[size_t(id)] >= 0 &&
         added_[size_t(added_by_id_[size_t(id)])].special;
}

std::vector<Tokenizer::Section> Tokenizer::split_added(std::string_view text,
                                                       bool normalized) const {
  std::vector<Section> out;
  size_t done = 0;  // text before this is in `out`
  for (size_t i = 0; i < text.size();) {
    const AddedToken* hit = nullptr;
    for (size_t idx : added_by_first_byte_[static_cast<unsigned char>(text[i])]) {
      const AddedToken& a = added_[idx];
      if (a.normalized != normalized || text.compare(i, a.content.size(), a.content) != 0) continue;
      if (a.single_word) {
        size_t n;
        const size_t e = i + a.content.size();
        if (is_word_char(char_before(text, i)) ||
            (e < text.size() && is_word_char(utf8_decode_one(text, e, &n))))
          continue;
      }
      hit = &a;
      break;  // longest first
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t b = i, e = i + hit->content.size();
    if (hit->lstrip)
      while (b > done && is_unicode_space(char_before(text, b))) {
        --b;
        while (b > done && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
      }
    if (hit->rstrip)
      for (size_t n; e < text.size() && is_unicode_space(utf8_decode_one(text, e, &n));) e += n;
    if (b > done) out.push_back({text.substr(done, b - done), -1});
    out.push_back({text.substr(b, e - b), hit->id});
    done = i = e;
  }
  if (done < text.size()) out.push_back({text.substr(done), -1});
  return out;
}

void Tokenizer::encode_text(std::string_view text, bool first, std::vector<int32_t>& out) const {
  size_t words = 0;
  for (const std::string& word : pre_tokenizer_.split(std::string(text), first)) {
    if (++words % 4096 == 0) throw_if_cancelled("tokenizing");  // a poll per ~20 KB of text
    model_.encode_word(word, out);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (!is_valid_utf8(text)) throw Error("tokenizer: the text is not valid UTF-8");
  std::vector<int32_t> out;
  if (add_special_tokens) out = template_prefix_;
  for (const Section& raw : split_added(text, false)) {
    if (raw.added >= 0) {
      out.push_back(raw.added);
      continue;
    }
    const std::string norm =
        normalizer_.empty() ? std::string(raw.text) : normalizer_.apply(raw.text);
    const bool first = raw.text.data() == text.data();
    for (const Section& s : split_added(norm, true)) {
      if (s.added >= 0)
        out.push_back(s.added);
      else
        encode_text(s.text, first && s.text.data() == norm.data(), out);
    }
  }
  if (add_special_tokens) out.insert(out.end(), template_suffix_.begin(), template_suffix_.end());
  return out;
}

std::string Tokenizer::decode_tokens(std::span<const int32_t> ids, bool skip_special_tokens,
                                     bool raw) const {
  // Added tokens go through the decoder too, as in Hugging Face's decode (ByteLevel passes a
  // token that is not all byte-level characters through as it is).
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && size_t(id) < added_by_id_.size() && added_by_id_[size_t(id)] >= 0) {
      const AddedToken& a = added_[size_t(added_by_id_[size_t(id)])];
      if (!(a.special && skip_special_tokens)) tokens.push_back(a.content);
      continue;
    }
    // An id the tokenizer has no token for (a model's vocabulary is often padded past the
    // tokenizer's) decodes to nothing, as in Hugging Face's decode.
    if (const std::string* t = model_.token(id)) tokens.push_back(*t);
  }
  std::string out;
  if (decoder_.empty())  // Hugging Face joins the tokens with spaces when there is no decoder
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
  else
    for (const std::string& s : decoder_.decode(std::move(tokens), raw)) out += s;
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens,
                              std::optional<bool> clean_up) const {
  std::string out = decode_tokens(ids, skip_special_tokens, false);
  if (!is_valid_utf8(out)) out = utf8_lossy(out);  // decoders without a ByteLevel step
  return clean_up.value_or(clean_up_spaces_) ? clean_up_tokenization(std::move(out)) : out;
}

std::string Tokenizer::decode_raw(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return decode_tokens(ids, skip_special_tokens, true);
}

std::string clean_up_tokenization(std::string s) {
  static const std::pair<const char*, const char*> kRules[] = {
      {" .", "."},     {" ?", "?"},   {" !", "!"},   {" ,", ","},     {" ' ", "'"},
      {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (auto [from, to] : kRules) s = replace_all(s, from, to);
  return s;
}

}  // namespace r3::text

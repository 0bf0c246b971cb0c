// The chat-template parser: segments and their tokens into the tree of Nodes and Exprs
// (text/jinja_syntax.h), refusing what the renderer does not implement by name and line.
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>

#include "text/jinja.h"
#include "text/jinja_budget.h"
#include "text/jinja_syntax.h"
#include "text/utf8.h"

namespace r3::text::jinja {

const std::set<std::string> kFilters = {
    "trim",       "length",     "count",   "tojson",  "string",    "upper", "lower",
    "title",      "capitalize", "default", "d",       "first",     "last",  "join",
    "items",      "list",       "replace", "reverse", "unique",    "map",   "selectattr",
    "rejectattr", "select",     "reject",  "int",     "float",     "abs",   "round",
    "safe",       "escape",     "e",       "indent",  "wordcount", "sum"};
const std::set<std::string> kTests = {
    "defined", "undefined", "none",        "boolean", "false",    "true",     "integer",
    "float",   "number",    "string",      "mapping", "iterable", "sequence", "callable",
    "odd",     "even",      "divisibleby", "eq",      "equalto",  "ne",       "lt",
    "le",      "gt",        "ge",          "in",      "sameas",   "lower",    "upper"};

namespace {

class Parser {
 public:
  explicit Parser(std::vector<Segment> segs) : segs_(std::move(segs)) {}

 private:
  // The parser recurses once per nesting level; a template nested past kMaxTemplateNesting is
  // refused here, before its depth can exhaust the stack (here, when evaluated, or when freed).
  class Nest {
   public:
    explicit Nest(Parser& p) : p_(p) {
      if (++p_.nesting_ > kMaxTemplateNesting)
        fail(p_.line_,
             "the template nests deeper than " + std::to_string(kMaxTemplateNesting) + " levels");
    }
    ~Nest() { --p_.nesting_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    Parser& p_;
  };
  // e's depth from its operands'; chains built by loops (a + b + c ..., x|f|g, a.b.c) are bounded
  // here, as recursion bounds the rest.
  ExprP deepen(ExprP e) {
    int d = 0;
    for (const ExprP& a : e->args)
      if (a) d = std::max(d, a->depth);
    for (const auto& kv : e->kwargs) d = std::max(d, kv.second->depth);
    e->depth = d + 1;
    if (e->depth > kMaxTemplateNesting)
      fail(line_,
           "an expression nests deeper than " + std::to_string(kMaxTemplateNesting) + " levels");
    return e;
  }

 public:
  std::vector<NodeP> parse_all() {
    std::vector<NodeP> out = parse_block({});
    if (seg_ < segs_.size())
      fail(segs_[seg_].line, "unexpected {% " + first_word(segs_[seg_]) + " %}");
    return out;
  }

 private:
  static std::string first_word(const Segment& s) {
    size_t b = s.body.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return "";
    size_t e = b;
    while (e < s.body.size() &&
           (std::isalnum(static_cast<unsigned char>(s.body[e])) || s.body[e] == '_'))
      ++e;
    return s.body.substr(b, e - b);
  }

  // Statements until a {% tag %} whose first word is in `ends` (left unconsumed).
  std::vector<NodeP> parse_block(const std::set<std::string>& ends) {
    std::vector<NodeP> out;
    while (seg_ < segs_.size()) {
      const Segment& s = segs_[seg_];
      if (s.kind == Segment::Text) {
        auto n = std::make_shared<Node>();
        n->kind = Node::Text;
        n->text = s.body;
        out.push_back(n);
        ++seg_;
        continue;
      }
      start(s);
      if (s.kind == Segment::Expr) {
        auto n = std::make_shared<Node>();
        n->kind = Node::Output;
        n->line = s.line;
        n->expr = expression();
        expect_end();
        out.push_back(n);
        ++seg_;
        continue;
      }
      const std::string w = first_word(s);
      if (ends.count(w)) return out;
      ++seg_;
      out.push_back(statement(w, s.line));
    }
    if (!ends.empty()) {
      std::string names;
      for (const auto& e : ends) names += (names.empty() ? "" : " or ") + e;
      fail(segs_.empty() ? 1 : segs_.back().line, "missing {% " + names + " %}");
    }
    return out;
  }

  // The tag that closes a block: its first word must be `w`; returns with its tokens loaded.
  void close_tag(const std::string& w) {
    if (seg_ >= segs_.size() || first_word(segs_[seg_]) != w)
      fail(line_, "missing {% " + w + " %}");
    start(segs_[seg_]);
    name_token();
  }

  NodeP statement(const std::string& w, int line) {
    const Nest nest(*this);
    auto n = std::make_shared<Node>();
    n->line = line;
    name_token();  // the keyword
    if (w == "if") {
      n->kind = Node::If;
      ExprP cond = expression();
      expect_end();
      for (;;) {
        std::vector<NodeP> body = parse_block({"elif", "else", "endif"});
        n->branches.emplace_back(cond, std::move(body));
        const std::string k = first_word(segs_[seg_]);
        start(segs_[seg_]);
        name_token();
        ++seg_;
        if (k == "elif") {
          cond = expression();
          expect_end();
          continue;
        }
        if (k == "else") {
          expect_end();
          n->else_body = parse_block({"endif"});
          close_tag("endif");
          expect_end();
          ++seg_;
        } else {
          expect_end();
        }
        break;
      }
    } else if (w == "for") {
      n->kind = Node::For;
      const bool paren = accept_op("(");
      n->targets.push_back(name_token());
      while (accept_op(",")) n->targets.push_back(name_token());
      if (paren) expect_op(")");
      if (name_token() != "in") fail(line_, "expected 'in' in {% for %}");
      n->expr = or_expr();  // the iterable (a conditional here would swallow the loop filter)
      if (peek_name("if")) {
        name_token();
        n->filter = or_expr();
      }
      if (peek_name("recursive"))
        fail(line_, "recursive loops are not supported by r3's template renderer");
      expect_end();
      n->body = parse_block({"else", "endfor"});
      const std::string k = first_word(segs_[seg_]);
      start(segs_[seg_]);
      name_token();
      expect_end();
      ++seg_;
      if (k == "else") {
        n->else_body = parse_block({"endfor"});
        close_tag("endfor");
        expect_end();
        ++seg_;
      }
    } else if (w == "set") {
      const std::string target = name_token();
      if (accept_op(".")) {
        n->kind = Node::Set;
        n->targets = {target};
        n->attr = name_token();
      } else {
        n->targets = {target};
        while (accept_op(",")) n->targets.push_back(name_token());
        n->kind = Node::Set;
      }
      if (at_end()) {  // {% set x %}...{% endset %}
        if (n->targets.size() != 1 || !n->attr.empty())
          fail(line_, "a {% set %} block assigns one name");
        n->kind = Node::SetBlock;
        n->body = parse_block({"endset"});
        close_tag("endset");
        expect_end();
        ++seg_;
        return n;
      }
      expect_op("=");
      n->expr = expression();
      if (peek_op(",")) {  // set a = x, y: a tuple
        auto list = std::make_shared<Expr>();
        list->kind = Expr::ListLit;
        list->line = line_;
        list->args.push_back(n->expr);
        while (accept_op(",")) list->args.push_back(expression());
        n->expr = deepen(list);
      }
      expect_end();
    } else if (w == "macro") {
      n->kind = Node::Macro;
      n->targets = {name_token()};
      expect_op("(");
      while (!accept_op(")")) {
        std::string p = name_token();
        ExprP dflt;
        if (accept_op("=")) dflt = expression();
        n->params.emplace_back(p, dflt);
        if (!peek_op(")")) expect_op(",");
      }
      expect_end();
      n->body = parse_block({"endmacro"});
      close_tag("endmacro");
      expect_end();
      ++seg_;
    } else if (w == "break" || w == "continue") {
      n->kind = w == "break" ? Node::Break : Node::Continue;
      expect_end();
    } else if (w == "generation") {  // Hugging Face's assistant-mask marker: renders its body
      n->kind = Node::Block;
      expect_end();
      n->body = parse_block({"endgeneration"});
      close_tag("endgeneration");
      expect_end();
      ++seg_;
    } else {
      fail(line, "{% " + w + " %} is not supported by r3's chat template renderer");
    }
    return n;
  }

  // ---- expressions ----
  void start(const Segment& s) {
    toks_ = tokenize(s.body, s.line);
    tok_ = 0;
    line_ = s.line;
  }
  const Tok& peek() const { return toks_[tok_]; }
  bool at_end() const { return peek().kind == Tok::End; }
  void expect_end() {
    if (!at_end()) fail(line_, "unexpected '" + peek().v + "'");
  }
  bool peek_op(const char* op) const { return peek().kind == Tok::Op && peek().v == op; }
  bool peek_name(const char* n) const { return peek().kind == Tok::Name && peek().v == n; }
  bool accept_op(const char* op) {
    if (!peek_op(op)) return false;
    ++tok_;
    return true;
  }
  void expect_op(const char* op) {
    if (!accept_op(op))
      fail(line_,
           std::string("expected '") + op + "'" + (at_end() ? "" : " before '" + peek().v + "'"));
  }
  std::string name_token() {
    if (peek().kind != Tok::Name)
      fail(line_, "expected a name" + (at_end() ? std::string() : " before '" + peek().v + "'"));
    return toks_[tok_++].v;
  }
  ExprP make(Expr::Kind k, std::string name = {}) {
    auto e = std::make_shared<Expr>();
    e->kind = k;
    e->line = line_;
    e->name = std::move(name);
    return e;
  }
  ExprP binary(const std::string& op, ExprP a, ExprP b) {
    ExprP e = make(Expr::Binary, op);
    e->args = {std::move(a), std::move(b)};
    return deepen(e);
  }

  ExprP expression() {
    const Nest nest(*this);
    ExprP e = or_expr();
    if (peek_name("if")) {
      name_token();
      ExprP c = make(Expr::Cond);
      ExprP cond = or_expr();
      ExprP other;
      if (peek_name("else")) {
        name_token();
        other = expression();
      }
      c->args = {cond, e, other};
      return deepen(c);
    }
    return e;
  }
  ExprP or_expr() {
    ExprP e = and_expr();
    while (peek_name("or")) {
      name_token();
      e = binary("or", e, and_expr());
    }
    return e;
  }
  ExprP and_expr() {
    ExprP e = not_expr();
    while (peek_name("and")) {
      name_token();
      e = binary("and", e, not_expr());
    }
    return e;
  }
  ExprP not_expr() {
    if (peek_name("not")) {
      const Nest nest(*this);
      name_token();
      ExprP e = make(Expr::Unary, "not");
      e->args = {not_expr()};
      return deepen(e);
    }
    return compare();
  }
  ExprP compare() {
    ExprP e = math1();
    for (;;) {
      if (peek().kind == Tok::Op && (peek().v == "==" || peek().v == "!=" || peek().v == "<" ||
                                     peek().v == ">" || peek().v == "<=" || peek().v == ">=")) {
        const std::string op = toks_[tok_++].v;
        e = binary(op, e, math1());
      } else if (peek_name("in")) {
        name_token();
        e = binary("in", e, math1());
      } else if (peek_name("not") && toks_[tok_ + 1].kind == Tok::Name &&
                 toks_[tok_ + 1].v == "in") {
        tok_ += 2;
        e = binary("not in", e, math1());
      } else {
        return e;
      }
    }
  }
  ExprP math1() {
    ExprP e = concat();
    while (peek_op("+") || peek_op("-")) {
      const std::string op = toks_[tok_++].v;
      e = binary(op, e, concat());
    }
    return e;
  }
  ExprP concat() {
    ExprP e = math2();
    while (accept_op("~")) e = binary("~", e, math2());
    return e;
  }
  ExprP math2() {
    ExprP e = power();
    while (peek_op("*") || peek_op("/") || peek_op("//") || peek_op("%")) {
      const std::string op = toks_[tok_++].v;
      e = binary(op, e, power());
    }
    return e;
  }
  ExprP power() {
    ExprP e = unary();
    while (accept_op("**")) e = binary("**", e, unary());
    return e;
  }
  ExprP unary() {
    if (peek_op("-") || peek_op("+")) {
      const Nest nest(*this);
      const std::string op = toks_[tok_++].v;
      ExprP e = make(Expr::Unary, op);
      e->args = {unary()};
      return filters(deepen(e));
    }
    return filters(postfix(primary()));
  }
  void call_args(ExprP& e) {
    while (!accept_op(")")) {
      if (peek().kind == Tok::Name && toks_[tok_ + 1].kind == Tok::Op && toks_[tok_ + 1].v == "=") {
        std::string k = name_token();
        expect_op("=");
        e->kwargs.emplace_back(k, expression());
      } else {
        e->args.push_back(expression());
      }
      if (!peek_op(")")) expect_op(",");
    }
  }
  ExprP filters(ExprP e) {
    for (;;) {
      if (accept_op("|")) {
        std::string name = name_token();
        if (!kFilters.count(name))
          fail(line_, "filter '" + name + "' is not supported by r3's chat template renderer");
        ExprP f = make(Expr::Filter, name);
        f->args.push_back(e);
        if (accept_op("(")) call_args(f);
        e = deepen(f);
      } else if (peek_name("is")) {
        name_token();
        bool neg = false;
        if (peek_name("not")) {
          name_token();
          neg = true;
        }
        std::string name = peek().kind == Tok::Name ? name_token() : "";
        if (name.empty() && peek().kind == Tok::Op && (peek().v == "==" || peek().v == "!="))
          name = toks_[tok_++].v == "==" ? "eq" : "ne";
        if (name == "none" || name == "true" || name == "false") {
        } else if (!kTests.count(name)) {
          fail(line_, "test '" + name + "' is not supported by r3's chat template renderer");
        }
        ExprP t = make(Expr::Test, name);
        t->negated = neg;
        t->args.push_back(e);
        if (accept_op("("))
          call_args(t);
        else if (peek().kind == Tok::Str || peek().kind == Tok::Int || peek().kind == Tok::Float ||
                 (peek().kind == Tok::Name &&
                  !std::set<std::string>{"and", "or", "else", "if", "is", "not", "in"}.count(
                      peek().v)))
          t->args.push_back(postfix(primary()));
        e = deepen(t);
      } else {
        return e;
      }
    }
  }
  ExprP postfix(ExprP e) {
    for (;;) {
      if (accept_op(".")) {
        ExprP a = make(Expr::Attr, peek().kind == Tok::Int ? toks_[tok_++].v : name_token());
        a->args = {e};
        e = deepen(a);
      } else if (accept_op("[")) {
        // item or slice [a:b:c]
        ExprP parts[3];
        int colons = 0;
        while (!accept_op("]")) {
          if (accept_op(":")) {
            if (++colons > 2) fail(line_, "bad slice");
            continue;
          }
          parts[colons] = expression();
        }
        if (colons == 0) {
          if (!parts[0]) fail(line_, "empty subscript");
          ExprP it = make(Expr::Item);
          it->args = {e, parts[0]};
          e = deepen(it);
        } else {
          ExprP s = make(Expr::Slice);
          s->args = {e, parts[0], parts[1], parts[2]};
          e = deepen(s);
        }
      } else if (accept_op("(")) {
        ExprP c = make(Expr::Call);
        c->args.push_back(e);
        call_args(c);
        e = deepen(c);
      } else {
        return e;
      }
    }
  }
  ExprP primary() {
    const Tok t = peek();
    if (t.kind == Tok::Str) {
      std::string s;
      while (peek().kind == Tok::Str) s += toks_[tok_++].v;  // adjacent literals concatenate
      ExprP e = make(Expr::Literal);
      e->literal = Value::string(s);
      return e;
    }
    if (t.kind == Tok::Int || t.kind == Tok::Float) {
      ++tok_;
      ExprP e = make(Expr::Literal);
      if (t.kind == Tok::Float) {
        e->literal =
            Value::number(std::strtod(t.v.c_str(), nullptr));  // 1e999 is inf, as in Python
        return e;
      }
      errno = 0;
      const long long x = std::strtoll(t.v.c_str(), nullptr, 10);
      if (errno == ERANGE)
        fail(line_, "integer literal " + t.v.substr(0, 40) + " does not fit in 64 bits");
      e->literal = Value::integer(x);
      return e;
    }
    if (t.kind == Tok::Name) {
      ++tok_;
      ExprP e = make(Expr::Literal);
      if (t.v == "true" || t.v == "True")
        e->literal = Value::boolean(true);
      else if (t.v == "false" || t.v == "False")
        e->literal = Value::boolean(false);
      else if (t.v == "none" || t.v == "None")
        e->literal = Value::none();
      else
        e = make(Expr::Name, t.v);
      return e;
    }
    if (accept_op("(")) {
      ExprP e = expression();
      if (peek_op(",")) {  // a tuple: a list to r3
        ExprP l = make(Expr::ListLit);
        l->args.push_back(e);
        while (accept_op(",") && !peek_op(")")) l->args.push_back(expression());
        e = deepen(l);
      }
      expect_op(")");
      return e;
    }
    if (accept_op("[")) {
      ExprP l = make(Expr::ListLit);
      while (!accept_op("]")) {
        l->args.push_back(expression());
        if (!peek_op("]")) expect_op(",");
      }
      return deepen(l);
    }
    if (accept_op("{")) {
      ExprP d = make(Expr::DictLit);
      while (!accept_op("}")) {
        d->args.push_back(expression());
        expect_op(":");
        d->args.push_back(expression());
        if (!peek_op("}")) expect_op(",");
      }
      return deepen(d);
    }
    fail(line_, at_end() ? "unexpected end of expression" : "unexpected '" + t.v + "'");
  }

  std::vector<Segment> segs_;
  size_t seg_ = 0;
  std::vector<Tok> toks_;
  size_t tok_ = 0;
  int line_ = 0;
  int nesting_ = 0;
};

}  // namespace

std::vector<NodeP> parse(std::vector<Segment> segs) { return Parser(std::move(segs)).parse_all(); }

Template::Template(const std::string& source) {
  root_ = std::make_shared<Node>();
  root_->kind = Node::Block;
  root_->body = parse(segments(source));
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;

}  // namespace r3::text::jinja

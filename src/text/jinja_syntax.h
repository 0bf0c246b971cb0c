// The pieces of r3's chat-template language the lexer (jinja_lexer.cc), the parser
// (jinja_parser.cc) and the renderer (jinja_render.cc) share; text/jinja.h is the interface the
// rest of r3 uses. A template's source becomes segments (text and tags, Hugging Face's whitespace
// rules applied), each tag's body tokens, then a tree of Nodes and Exprs the renderer walks.
#pragma once
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "text/jinja_value.h"

namespace r3::text::jinja {

// Every error of the language: r3::Error("chat template line N: what").
[[noreturn]] inline void fail(int line, const std::string& what) {
  throw Error("chat template line " + std::to_string(line) + ": " + what);
}

struct Segment {
  enum Kind { Text, Expr, Stmt } kind;
  std::string body;
  int line;
};

// The template's text and tags, with trim_blocks, lstrip_blocks and the {%- -%} markers applied.
std::vector<Segment> segments(const std::string& src);

struct Tok {
  enum Kind { Name, Int, Float, Str, Op, End } kind;
  std::string v;
};

// The tokens of one tag's body (at template line `line`), ending with a Tok::End.
std::vector<Tok> tokenize(const std::string& s, int line);

// ---- syntax tree ----

struct Expr {
  enum Kind {
    Literal,
    Name,
    Attr,
    Item,
    Slice,
    Call,
    Filter,
    Test,
    Unary,
    Binary,
    Cond,
    ListLit,
    DictLit
  } kind;
  int line = 0;
  Value literal;
  std::string name;  // Name, Attr, Filter, Test; Unary/Binary: the operator
  std::vector<std::shared_ptr<Expr>>
      args;  // operands, call args, list items, dict keys/values interleaved
  std::vector<std::pair<std::string, std::shared_ptr<Expr>>> kwargs;
  bool negated = false;  // Test: "is not"
  int depth = 1;         // of this node's tree, bounded at parse time (kMaxTemplateNesting)
};
using ExprP = std::shared_ptr<Expr>;

struct Node {
  enum Kind { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, Block } kind;
  int line = 0;
  std::string text;
  ExprP expr;  // Output; For: iterable; Set: value
  std::vector<std::pair<ExprP, std::vector<std::shared_ptr<Node>>>> branches;  // If
  std::vector<std::shared_ptr<Node>> body, else_body;
  std::vector<std::string> targets;                   // For / Set (a.b: "a", attr in `attr`)
  std::string attr;                                   // Set ns.attr
  ExprP filter;                                       // For ... if cond
  std::vector<std::pair<std::string, ExprP>> params;  // Macro (default may be null)
};
using NodeP = std::shared_ptr<Node>;

// The filters and tests the renderer implements: the parser refuses others by name (and so do
// map/select, which name them at run time).
extern const std::set<std::string> kFilters, kTests;

// The template's top-level nodes; throws (fail) for syntax outside the subset, literals that do
// not parse, and nesting past kMaxTemplateNesting.
std::vector<NodeP> parse(std::vector<Segment> segs);

}  // namespace r3::text::jinja

// SPDX-License-Identifier: MIT OR Apache-2.0
// Chat templates: the Jinja subset that models' own templates (tokenizer_config.json's
// "chat_template", GGUF's tokenizer.chat_template) use, rendered as transformers'
// apply_chat_template renders them -- Jinja with trim_blocks and lstrip_blocks, loop controls,
// transformers' tojson (json.dumps, ensure_ascii=False), raise_exception, strftime_now and
// namespace. Checked byte for byte against transformers on the real templates of SmolLM2,
// Qwen2.5, Qwen3 and Llama 3.1 / 3.2 (tests/lm/chat_template.test.cpp).
//
//   nn::lm::ChatTemplate t(source);                   // parses; nn::Error naming line and construct
//   std::string text = t.apply(messages, true);       // messages: a JSON array of {"role", "content", ...}
//   std::string text = t.render({{"messages", m}, {"tools", tools}, {"bos_token", "<s>"}});
//
// What is there: text, {{ }}, {% %}, {# #} with "-" / "+" whitespace control; if / elif / else,
// for (one name or a tuple, an "if" filter, else, loop.index / index0 / revindex / revindex0 /
// first / last / length / previtem / nextitem), break / continue, set (a name, a namespace
// attribute, or a block), generation (transformers' tag: renders its body); literals (strings,
// numbers, true / false / none in either case, lists, dicts, tuples), attribute and item access,
// slices, calls, the operators of Jinja's grammar (if-else, or, and, not, comparisons, in, not in,
// + - ~ * / // % **, unary - +), filters (tojson, length / count, trim, join, items, first, last,
// string, lower, upper, capitalize, title, default / d, list, replace, int, float, abs, round,
// map, select, reject, selectattr, rejectattr, unique, sort, dictsort, reverse, safe, indent,
// wordcount, sum, min, max, batch-free), tests (defined, undefined, none, string, number, integer,
// float, boolean, true, false, mapping, iterable, sequence, callable, equalto / eq / ==, ne / !=,
// lt, le, gt, ge, in, odd, even, divisibleby, lower, upper, sameas), string methods (startswith,
// endswith, split, rsplit, strip, lstrip, rstrip, upper, lower, title, capitalize, replace, find,
// count, join, format-free), dict methods (items, keys, values, get), and the globals range,
// namespace, dict, raise_exception, strftime_now. Anything else -- macros, call blocks, includes,
// filter blocks, an unknown filter, test, method or tag -- is an nn::Error naming it and its line.
// Values are Python's: None renders as "None", True as "True", lists and dicts as their repr
// (tuples are lists here: printing one directly shows [..] where Python shows (..)).
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../config.hpp"

namespace nn::lm {

namespace detail::jinja {

using Json = nlohmann::ordered_json;

// A template value: JSON data (insertion-ordered objects, as Python dicts), or one of Jinja's own
// kinds: undefined, a namespace (shared, so `set ns.x` is seen by every holder), a global
// function, or a method bound to its object.
struct Value {
  enum Kind { undefined, data, ns, func, method } kind = undefined;
  Json j;                           // data; the object of a method
  std::shared_ptr<Json> space;      // ns: an object
  std::string name;                 // func / method name; undefined: what was looked up (for errors)
  static Value of(Json v) {
    Value x;
    x.kind = data;
    x.j = std::move(v);
    return x;
  }
  static Value undef(std::string what = {}) {
    Value x;
    x.name = std::move(what);
    return x;
  }
  static Value fn(std::string n) {
    Value x;
    x.kind = func;
    x.name = std::move(n);
    return x;
  }
  bool is_undefined() const { return kind == undefined; }
  bool is_none() const { return kind == data && j.is_null(); }
  bool is_string() const { return kind == data && j.is_string(); }
};

[[noreturn]] inline void fail_at(const std::string& where, int line, const std::string& msg) {
  nn::detail::fail("chat_template", where, " line ", line, ": ", msg);
}

// ---- Python's str(), repr() and json.dumps ------------------------------------------------------

inline std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // Python's repr: the shortest digits that round-trip; "1.0" for integral values below 1e16.
  std::string s = Json(d).dump();  // shortest round-trip digits; exponents as 1e+20 / 1e-07, as Python
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

inline void py_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

/// json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: None), as transformers' tojson.
inline void py_json(std::string& out, const Json& v, int indent, int level) {
  auto newline = [&](int lv) {
    out += '\n';
    out.append(static_cast<std::size_t>(indent * lv), ' ');
  };
  if (v.is_object()) {
    if (v.empty()) {
      out += "{}";
      return;
    }
    out += '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) out += indent >= 0 ? "," : ", ";
      first = false;
      if (indent >= 0) newline(level + 1);
      py_json_string(out, it.key());
      out += ": ";
      py_json(out, it.value(), indent, level + 1);
    }
    if (indent >= 0) newline(level);
    out += '}';
  } else if (v.is_array()) {
    if (v.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) out += indent >= 0 ? "," : ", ";
      if (indent >= 0) newline(level + 1);
      py_json(out, v[i], indent, level + 1);
    }
    if (indent >= 0) newline(level);
    out += ']';
  } else if (v.is_string()) {
    py_json_string(out, v.get<std::string>());
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : py_float(d);
  } else if (v.is_boolean()) {
    out += v.get<bool>() ? "true" : "false";
  } else if (v.is_null()) {
    out += "null";
  } else {
    out += v.dump();
  }
}

inline void py_repr_string(std::string& out, const std::string& s) {
  // Python's repr of a str: single quotes unless the text has ' and no ".
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  out += q;
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) (out += '\\') += static_cast<char>(c);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  out += q;
}

inline void py_repr(std::string& out, const Json& v) {
  if (v.is_string()) py_repr_string(out, v.get<std::string>());
  else if (v.is_null()) out += "None";
  else if (v.is_boolean()) out += v.get<bool>() ? "True" : "False";
  else if (v.is_number_float()) out += py_float(v.get<double>());
  else if (v.is_number()) out += v.dump();
  else if (v.is_array()) {
    out += '[';
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) out += ", ";
      py_repr(out, v[i]);
    }
    out += ']';
  } else {
    out += '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      py_repr_string(out, it.key());
      out += ": ";
      py_repr(out, it.value());
    }
    out += '}';
  }
}

/// str(value), as {{ }} prints it.
inline std::string py_str(const Value& v) {
  switch (v.kind) {
    case Value::undefined: return "";
    case Value::ns: return "<Namespace>";
    case Value::func:
    case Value::method: return "<function " + v.name + ">";
    case Value::data: break;
  }
  if (v.j.is_string()) return v.j.get<std::string>();
  std::string out;
  py_repr(out, v.j);
  return out;
}

inline bool truthy(const Value& v) {
  if (v.kind != Value::data) return v.kind != Value::undefined;
  const Json& j = v.j;
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_integer()) return j.get<std::int64_t>() != 0;
  if (j.is_number()) return j.get<double>() != 0;
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();  // json::empty() is false for any string
  if (j.is_array() || j.is_object()) return !j.empty();
  return true;
}

/// Python's ==, as far as JSON values go (1 == 1.0, True == 1).
inline bool py_equal(const Value& a, const Value& b) {
  if (a.kind != Value::data || b.kind != Value::data) return a.kind == b.kind && a.kind == Value::undefined;
  const Json &x = a.j, &y = b.j;
  auto num = [](const Json& v) { return v.is_number() || v.is_boolean(); };
  if (num(x) && num(y)) {
    auto d = [](const Json& v) { return v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>(); };
    if (x.is_number_integer() && y.is_number_integer()) return x.get<std::int64_t>() == y.get<std::int64_t>();
    return d(x) == d(y);
  }
  return x == y;
}

// ---- lexing -----------------------------------------------------------------------------------

struct Chunk {
  enum Kind { text, expr, stmt } kind = text;
  std::string s;
  int line = 1;
};

/// Cuts the template into text, {{ expression }} and {% statement %} chunks with Jinja's
/// whitespace rules (trim_blocks, lstrip_blocks, "-" / "+" markers; comments dropped; a single
/// trailing newline of the template removed; newlines kept as written).
inline std::vector<Chunk> lex(std::string_view source, const std::string& where) {
  std::vector<Chunk> out;
  // Jinja first makes every \r\n and \r a \n, and drops one trailing newline.
  std::string norm;
  norm.reserve(source.size());
  for (std::size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      norm += '\n';
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      norm += source[k];
    }
  }
  if (!norm.empty() && norm.back() == '\n') norm.pop_back();
  const std::string_view src = norm;
  std::size_t i = 0;
  int line = 1;
  bool strip_next = false;     // the previous tag ended with "-": strip leading whitespace
  bool trim_newline = false;   // the previous tag was a block or comment: drop one newline
  bool line_starting = true;   // the previous match ended a line (or this is the start)
  auto count_lines = [&](std::string_view s) {
    for (char c : s) line += c == '\n';
  };
  while (i <= src.size()) {
    std::size_t open = src.find('{', i);
    while (open != std::string_view::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open != std::string_view::npos && open + 1 >= src.size()) open = std::string_view::npos;
    std::string text(src.substr(i, open == std::string_view::npos ? std::string_view::npos : open - i));
    const int text_line = line;
    count_lines(text);
    if (strip_next) {
      const std::size_t k = text.find_first_not_of(" \t\n\r\f\v");
      const std::size_t n = k == std::string::npos ? text.size() : k;
      line_starting = n > 0 && text[n - 1] == '\n';  // what the tag's end consumed ended a line
      text.erase(0, n);
    } else if (trim_newline && !text.empty() && text[0] == '\n') {
      text.erase(0, 1);
      line_starting = true;
    }
    strip_next = trim_newline = false;
    if (open == std::string_view::npos) {
      if (!text.empty()) out.push_back({Chunk::text, text, text_line});
      break;
    }
    const char kind = src[open + 1];
    const char sign = open + 2 < src.size() ? src[open + 2] : '\0';
    if (sign == '-') {
      const std::size_t k = text.find_last_not_of(" \t\n\r\f\v");
      text.erase(k == std::string::npos ? 0 : k + 1);
    } else if (sign != '+' && kind != '{') {  // lstrip_blocks: a block or comment alone on its line
      const std::size_t nl = text.rfind('\n');
      const std::size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
          text.find_first_not_of(" \t\r\f\v", l_pos) == std::string::npos)
        text.erase(l_pos);
    }
    if (!text.empty()) out.push_back({Chunk::text, text, text_line});
    // The tag's end, skipping string literals inside {{ }} and {% %}.
    const std::size_t body = open + 2 + (sign == '-' || sign == '+' ? 1 : 0);
    const char close = kind == '{' ? '}' : kind;
    std::size_t k = body;
    std::size_t end = std::string_view::npos;
    while (k + 1 < src.size()) {
      const char c = src[k];
      if (kind != '#' && (c == '\'' || c == '"')) {
        std::size_t q = k + 1;
        while (q < src.size() && src[q] != c) q += src[q] == '\\' ? 2 : 1;
        k = q + 1;
        continue;
      }
      if (c == close && src[k + 1] == '}') {
        end = k;
        break;
      }
      ++k;
    }
    if (end == std::string_view::npos)
      fail_at(where, line, std::string("unclosed ") + (kind == '{' ? "{{" : kind == '%' ? "{%" : "{#"));
    std::size_t inner_end = end;
    const bool strip_after = end > body && src[end - 1] == '-';
    const bool keep_newline = end > body && src[end - 1] == '+';  // "+%}": no trim_blocks here
    if (strip_after || keep_newline) --inner_end;
    const std::string inner(src.substr(body, inner_end - body));
    const int tag_line = line;
    count_lines(src.substr(open, end + 2 - open));
    if (kind == '{') out.push_back({Chunk::expr, inner, tag_line});
    else if (kind == '%') out.push_back({Chunk::stmt, inner, tag_line});
    i = end + 2;
    strip_next = strip_after;
    trim_newline = kind != '{' && !keep_newline;
    // Jinja's line_starting: whether its last match ended with a newline. A tag's end only does
    // when trim_blocks or "-" swallowed one (set above, with the next text).
    line_starting = false;
    if (i >= src.size()) break;
  }
  return out;
}

// ---- expression parsing ---------------------------------------------------------------------

struct Tok {
  enum Kind { name, str, integer, real, op, end } kind = end;
  std::string s;
  std::int64_t i = 0;
  double d = 0;
};

inline std::vector<Tok> tokenize(const std::string& s, const std::string& where, int line) {
  std::vector<Tok> out;
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t k = i;
      while (k < s.size() && (std::isalnum(static_cast<unsigned char>(s[k])) || s[k] == '_')) ++k;
      out.push_back({Tok::name, s.substr(i, k - i)});
      i = k;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      std::size_t k = i;
      bool real = false;
      while (k < s.size() && (std::isdigit(static_cast<unsigned char>(s[k])) || s[k] == '_')) ++k;
      if (k + 1 < s.size() && s[k] == '.' && std::isdigit(static_cast<unsigned char>(s[k + 1]))) {
        real = true;
        ++k;
        while (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) ++k;
      }
      if (k < s.size() && (s[k] == 'e' || s[k] == 'E')) {
        std::size_t e = k + 1;
        if (e < s.size() && (s[e] == '+' || s[e] == '-')) ++e;
        if (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) {
          real = true;
          k = e;
          while (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) ++k;
        }
      }
      std::string num = s.substr(i, k - i);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      Tok t;
      t.kind = real ? Tok::real : Tok::integer;
      try {
        if (real) t.d = std::stod(num);
        else t.i = std::stoll(num);
      } catch (const std::exception&) {
        fail_at(where, line, "the number " + num + " is out of range");
      }
      out.push_back(t);
      i = k;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string v;
      std::size_t k = i + 1;
      for (; k < s.size() && s[k] != c; ++k) {
        if (s[k] != '\\' || k + 1 >= s.size()) {
          v += s[k];
          continue;
        }
        const char e = s[++k];
        switch (e) {
          case 'n': v += '\n'; break;
          case 't': v += '\t'; break;
          case 'r': v += '\r'; break;
          case '0': v += '\0'; break;
          case '\\': v += '\\'; break;
          case '\'': v += '\''; break;
          case '"': v += '"'; break;
          case '\n': break;
          case 'u':
          case 'x': {
            const std::size_t n = e == 'u' ? 4 : 2;
            if (k + n >= s.size()) fail_at(where, line, "a truncated \\" + std::string(1, e) + " escape");
            const std::string hex = s.substr(k + 1, n);
            if (hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
              fail_at(where, line, "a bad \\" + std::string(1, e) + " escape");
            const auto cp = static_cast<std::uint32_t>(std::stoul(hex, nullptr, 16));
            k += n;
            // UTF-8 of the code point
            if (cp < 0x80) v += static_cast<char>(cp);
            else if (cp < 0x800) {
              v += static_cast<char>(0xC0 | (cp >> 6));
              v += static_cast<char>(0x80 | (cp & 0x3F));
            } else {
              v += static_cast<char>(0xE0 | (cp >> 12));
              v += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
              v += static_cast<char>(0x80 | (cp & 0x3F));
            }
            break;
          }
          default: v += '\\'; v += e;
        }
      }
      if (k >= s.size()) fail_at(where, line, "an unterminated string");
      out.push_back({Tok::str, v});
      i = k + 1;
      continue;
    }
    static const char* ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "(", ")",
                                "[", "]", "{", "}", ",", ".", ":", "|", "="};
    bool found = false;
    for (const char* o : ops) {
      const std::size_t n = std::char_traits<char>::length(o);
      if (s.compare(i, n, o) == 0) {
        out.push_back({Tok::op, o});
        i += n;
        found = true;
        break;
      }
    }
    if (!found) fail_at(where, line, std::string("unexpected character '") + c + "'");
  }
  out.push_back({Tok::end, ""});
  return out;
}

struct Node;
using NodeP = std::shared_ptr<const Node>;

struct Node {
  enum Kind {
    literal, name, getattr, getitem, slice, call, filter, test, unary, binary, compare, cond, and_, or_, not_,
    list, dict, tuple
  } kind = literal;
  Json value;                 // literal
  std::string s;              // name / attribute / filter / test / operator
  std::vector<NodeP> args;    // operands, call / filter / test positional args (first: the object)
  std::vector<std::pair<std::string, NodeP>> kwargs;
  bool negate = false;        // "is not"
};

class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, std::string where, int line) : t_(std::move(toks)), where_(std::move(where)), line_(line) {}

  NodeP expression() { return cond(); }
  bool at_end() const { return t_[p_].kind == Tok::end; }
  const Tok& peek(std::size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  bool is_op(const char* o, std::size_t k = 0) const { return peek(k).kind == Tok::op && peek(k).s == o; }
  bool is_name(const char* n, std::size_t k = 0) const { return peek(k).kind == Tok::name && peek(k).s == n; }
  void expect_op(const char* o) {
    if (!is_op(o)) fail("expected '" + std::string(o) + "'");
    ++p_;
  }
  std::string expect_name() {
    if (peek().kind != Tok::name) fail("expected a name");
    return t_[p_++].s;
  }
  void expect_end() {
    if (!at_end()) fail("unexpected '" + describe(peek()) + "'");
  }
  [[noreturn]] void fail(const std::string& msg) const { fail_at(where_, line_, msg); }
  static std::string describe(const Tok& t) {
    return t.kind == Tok::end ? "end of tag" : t.kind == Tok::str ? "'" + t.s + "' (a string)" : t.kind == Tok::integer ? std::to_string(t.i) : t.s;
  }

  // A target of for / set: a name or a tuple of names.
  std::vector<std::string> targets() {
    std::vector<std::string> names{expect_name()};
    while (is_op(",")) {
      ++p_;
      names.push_back(expect_name());
    }
    return names;
  }

  NodeP cond(bool allow_cond = true) {
    const Depth guard(*this);
    NodeP a = or_expr();
    while (allow_cond && is_name("if")) {
      ++p_;
      auto n = std::make_shared<Node>();
      n->kind = Node::cond;
      NodeP c = or_expr();
      NodeP b;
      if (is_name("else")) {
        ++p_;
        b = cond();
      }
      n->args = {c, a, b};
      a = n;
    }
    return a;
  }

 private:
  static NodeP make(Node::Kind k, std::string s, std::vector<NodeP> args) {
    auto n = std::make_shared<Node>();
    n->kind = k;
    n->s = std::move(s);
    n->args = std::move(args);
    return n;
  }
  NodeP or_expr() {
    NodeP a = and_expr();
    while (is_name("or")) {
      ++p_;
      a = make(Node::or_, "or", {a, and_expr()});
    }
    return a;
  }
  NodeP and_expr() {
    NodeP a = not_expr();
    while (is_name("and")) {
      ++p_;
      a = make(Node::and_, "and", {a, not_expr()});
    }
    return a;
  }
  NodeP not_expr() {
    const Depth guard(*this);
    if (is_name("not")) {
      ++p_;
      return make(Node::not_, "not", {not_expr()});
    }
    return compare();
  }
  NodeP compare() {
    NodeP a = math();
    for (;;) {
      std::string op;
      if (peek().kind == Tok::op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" || peek().s == ">" ||
                                     peek().s == "<=" || peek().s == ">=")) {
        op = t_[p_++].s;
      } else if (is_name("in")) {
        ++p_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        p_ += 2;
        op = "not in";
      } else {
        return a;
      }
      a = make(Node::compare, op, {a, math()});
    }
  }
  // The left-associative arithmetic levels, loosest first (Jinja's parse_math1, parse_concat,
  // parse_math2, parse_pow); below them the unary operators.
  NodeP math(std::size_t level = 0) {
    static const std::vector<std::vector<std::string>> levels = {{"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}};
    if (level == levels.size()) return unary();
    NodeP a = math(level + 1);
    for (;;) {
      const auto& ops = levels[level];
      const auto it = std::find_if(ops.begin(), ops.end(), [&](const std::string& o) { return is_op(o.c_str()); });
      if (it == ops.end()) return a;
      ++p_;
      a = make(Node::binary, *it, {a, math(level + 1)});
    }
  }
  NodeP unary() {
    if (is_op("-") || is_op("+")) {
      const std::string op = t_[p_++].s;
      return filters(make(Node::unary, op, {unary_no_filter()}));
    }
    return filters(postfix(primary()));
  }
  NodeP unary_no_filter() {
    const Depth guard(*this);
    if (is_op("-") || is_op("+")) {
      const std::string op = t_[p_++].s;
      return make(Node::unary, op, {unary_no_filter()});
    }
    return postfix(primary());
  }
  NodeP primary() {
    const Tok& t = peek();
    if (t.kind == Tok::str) {
      std::string s;
      while (peek().kind == Tok::str) s += t_[p_++].s;  // adjacent strings join
      auto n = std::make_shared<Node>();
      n->value = s;
      return n;
    }
    if (t.kind == Tok::integer || t.kind == Tok::real) {
      ++p_;
      auto n = std::make_shared<Node>();
      n->value = t.kind == Tok::integer ? Json(t.i) : Json(t.d);
      return n;
    }
    if (t.kind == Tok::name) {
      ++p_;
      auto n = std::make_shared<Node>();
      if (t.s == "true" || t.s == "True") n->value = true;
      else if (t.s == "false" || t.s == "False") n->value = false;
      else if (t.s == "none" || t.s == "None") n->value = nullptr;
      else {
        n->kind = Node::name;
        n->s = t.s;
      }
      return n;
    }
    if (is_op("(")) {
      ++p_;
      if (is_op(")")) {
        ++p_;
        return make(Node::tuple, "", {});
      }
      NodeP e = cond();
      if (is_op(",")) {
        std::vector<NodeP> items{e};
        while (is_op(",")) {
          ++p_;
          if (is_op(")")) break;
          items.push_back(cond());
        }
        expect_op(")");
        return make(Node::tuple, "", items);
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      ++p_;
      std::vector<NodeP> items;
      while (!is_op("]")) {
        items.push_back(cond());
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op("]");
      return make(Node::list, "", items);
    }
    if (is_op("{")) {
      ++p_;
      std::vector<NodeP> items;  // key, value, key, value, ...
      while (!is_op("}")) {
        items.push_back(cond());
        expect_op(":");
        items.push_back(cond());
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op("}");
      return make(Node::dict, "", items);
    }
    fail("unexpected '" + describe(t) + "'");
  }
  void call_args(Node& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().kind == Tok::name && is_op("=", 1)) {
        const std::string k = t_[p_].s;
        p_ += 2;
        n.kwargs.emplace_back(k, cond());
      } else {
        n.args.push_back(cond());
      }
      if (!is_op(",")) break;
      ++p_;
    }
    expect_op(")");
  }
  NodeP postfix(NodeP a) {
    for (;;) {
      if (is_op(".")) {
        ++p_;
        if (peek().kind == Tok::integer) {  // x.0 is x[0]
          auto n = std::make_shared<Node>();
          n->value = t_[p_++].i;
          a = make(Node::getitem, "", {a, n});
          continue;
        }
        a = make(Node::getattr, expect_name(), {a});
      } else if (is_op("[")) {
        ++p_;
        NodeP parts[3];
        bool is_slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!is_op(":") && !is_op("]")) parts[k] = cond();
          if (k < 2 && is_op(":")) {
            ++p_;
            is_slice = true;
          } else {
            break;
          }
        }
        expect_op("]");
        a = is_slice ? make(Node::slice, "", {a, parts[0], parts[1], parts[2]}) : make(Node::getitem, "", {a, parts[0]});
        if (!is_slice && !parts[0]) fail("an empty subscript");
      } else if (is_op("(")) {
        auto n = std::make_shared<Node>();
        n->kind = Node::call;
        n->args.push_back(a);
        call_args(*n);
        a = n;
      } else {
        return a;
      }
    }
  }
  NodeP filters(NodeP a) {
    for (;;) {
      if (is_op("|")) {
        ++p_;
        auto n = std::make_shared<Node>();
        n->kind = Node::filter;
        n->s = expect_name();
        while (is_op(".")) {  // dotted filter names are not Jinja's builtins; keep the name for the error
          ++p_;
          n->s += "." + expect_name();
        }
        n->args.push_back(a);
        if (is_op("(")) call_args(*n);
        a = n;
      } else if (is_name("is")) {
        ++p_;
        auto n = std::make_shared<Node>();
        n->kind = Node::test;
        if (is_name("not")) {
          ++p_;
          n->negate = true;
        }
        // Test names may be keywords ("none", "true", "in") or operators ("==").
        if (peek().kind == Tok::name || (peek().kind == Tok::op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" ||
                                                                    peek().s == ">" || peek().s == "<=" || peek().s == ">=")))
          n->s = t_[p_++].s;
        else
          fail("expected a test name after 'is'");
        n->args.push_back(a);
        if (is_op("(")) {
          call_args(*n);
        } else if (peek().kind == Tok::str || peek().kind == Tok::integer || peek().kind == Tok::real ||
                   (peek().kind == Tok::name && !is_name("and") && !is_name("or") && !is_name("else") && !is_name("if") &&
                    !is_name("is") && !is_name("in") && !is_name("not"))) {
          n->args.push_back(postfix(primary()));  // "is divisibleby 3", "is sameas false"
        }
        a = n;
      } else if (is_op("(")) {
        auto n = std::make_shared<Node>();
        n->kind = Node::call;
        n->args.push_back(a);
        call_args(*n);
        a = n;
      } else {
        return a;
      }
    }
  }

  // Nesting bound: a template is input, and "((((..." must not exhaust the stack.
  struct Depth {
    ExprParser& p;
    explicit Depth(ExprParser& q) : p(q) {
      if (++p.depth_ > kMaxDepth) p.fail("expression nested more than " + std::to_string(kMaxDepth) + " deep");
    }
    ~Depth() { --p.depth_; }
  };
  static constexpr int kMaxDepth = 200;

  std::vector<Tok> t_;
  std::size_t p_ = 0;
  std::string where_;
  int line_;
  int depth_ = 0;
};

// ---- statements -------------------------------------------------------------------------------

struct Stmt;
using StmtP = std::shared_ptr<const Stmt>;
using Body = std::vector<StmtP>;

struct Stmt {
  enum Kind { text, output, if_, for_, set, set_attr, set_block, brk, cont, generation } kind = text;
  int line = 1;
  std::string str;                                   // text
  NodeP expr;                                        // output / set value / for iterable / set_attr object
  std::vector<std::pair<NodeP, Body>> branches;      // if: (condition or null for else, body)
  std::vector<std::string> names;                    // for / set targets; set_attr: {attribute}
  NodeP filter;                                      // for ... if filter
  Body body, else_body;                              // for / set_block / generation
};

class Parser {
 public:
  Parser(std::vector<Chunk> chunks, std::string where) : c_(std::move(chunks)), where_(std::move(where)) {}

  Body parse() {
    std::string stop;
    Body b = block({}, stop);
    if (!stop.empty()) fail_at(where_, line_, "unexpected {% " + stop + " %}");
    return b;
  }

 private:
  static std::pair<std::string, std::string> split_tag(const std::string& s) {
    std::size_t b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return {"", ""};
    std::size_t e = b;
    while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
    return {s.substr(b, e - b), s.substr(e)};
  }
  ExprParser expr_parser(const std::string& s, int line) const { return ExprParser(tokenize(s, where_, line), where_, line); }

  // Parses statements until one of `ends` (tag names); `stop` gets the tag that ended the block
  // (empty at the end of the template), and p_ is past it.
  Body block(const std::vector<std::string>& ends, std::string& stop, std::string* stop_rest = nullptr) {
    Body out;
    while (p_ < c_.size()) {
      const Chunk& ch = c_[p_++];
      line_ = ch.line;
      if (ch.kind == Chunk::text) {
        auto s = std::make_shared<Stmt>();
        s->kind = Stmt::text;
        s->str = ch.s;
        out.push_back(s);
        continue;
      }
      if (ch.kind == Chunk::expr) {
        ExprParser ep = expr_parser(ch.s, ch.line);
        auto s = std::make_shared<Stmt>();
        s->kind = Stmt::output;
        s->line = ch.line;
        s->expr = ep.expression();
        ep.expect_end();
        out.push_back(s);
        continue;
      }
      auto [tag, rest] = split_tag(ch.s);
      if (std::find(ends.begin(), ends.end(), tag) != ends.end()) {
        stop = tag;
        if (stop_rest) *stop_rest = rest;
        return out;
      }
      out.push_back(statement(tag, rest, ch.line));
    }
    stop.clear();
    return out;
  }

  StmtP statement(const std::string& tag, const std::string& rest, int line) {
    if (++depth_ > 200) fail_at(where_, line, "blocks nested more than 200 deep");
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{depth_};
    auto s = std::make_shared<Stmt>();
    s->line = line;
    if (tag == "if") {
      s->kind = Stmt::if_;
      std::string cond_src = rest;
      for (;;) {
        ExprParser ep = expr_parser(cond_src, line);
        NodeP c = ep.expression();
        ep.expect_end();
        std::string stop, stop_rest;
        Body b = block({"elif", "else", "endif"}, stop, &stop_rest);
        s->branches.emplace_back(c, std::move(b));
        if (stop == "elif") {
          cond_src = stop_rest;
          continue;
        }
        if (stop == "else") {
          Body e = block({"endif"}, stop);
          s->branches.emplace_back(nullptr, std::move(e));
        }
        if (stop != "endif") fail_at(where_, line, "{% if %} without {% endif %}");
        return s;
      }
    }
    if (tag == "for") {
      s->kind = Stmt::for_;
      ExprParser ep = expr_parser(rest, line);
      s->names = ep.targets();
      // "for x in iterable [if filter]": the iterable takes no if-else, the "if" is the filter.
      if (!ep.is_name("in")) ep.fail("expected 'in' in {% for %}");
      ep.expect_name();
      s->expr = ep.cond(false);
      if (ep.is_name("if")) {
        ep.expect_name();
        s->filter = ep.expression();
      }
      if (ep.is_name("recursive")) ep.fail("recursive loops are not supported");
      ep.expect_end();
      std::string stop;
      s->body = block({"else", "endfor"}, stop);
      if (stop == "else") s->else_body = block({"endfor"}, stop);
      if (stop != "endfor") fail_at(where_, line, "{% for %} without {% endfor %}");
      return s;
    }
    if (tag == "set") {
      ExprParser ep = expr_parser(rest, line);
      std::string first = ep.expect_name();
      if (ep.is_op(".")) {  // set ns.attr = value
        ep.expect_op(".");
        s->kind = Stmt::set_attr;
        s->names = {first, ep.expect_name()};
        ep.expect_op("=");
        s->expr = ep.expression();
        ep.expect_end();
        return s;
      }
      s->names = {first};
      while (ep.is_op(",")) {
        ep.expect_op(",");
        s->names.push_back(ep.expect_name());
      }
      if (ep.at_end()) {  // {% set x %}...{% endset %}
        if (s->names.size() != 1) ep.fail("a block set takes one name");
        s->kind = Stmt::set_block;
        std::string stop;
        s->body = block({"endset"}, stop);
        if (stop != "endset") fail_at(where_, line, "{% set %} without {% endset %}");
        return s;
      }
      s->kind = Stmt::set;
      ep.expect_op("=");
      s->expr = ep.expression();
      if (ep.is_op(",")) {  // set a, b = x, y
        auto tup = std::make_shared<Node>();
        tup->kind = Node::tuple;
        tup->args.push_back(s->expr);
        while (ep.is_op(",")) {
          ep.expect_op(",");
          tup->args.push_back(ep.expression());
        }
        s->expr = tup;
      }
      ep.expect_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      s->kind = tag == "break" ? Stmt::brk : Stmt::cont;
      return s;
    }
    if (tag == "generation") {
      s->kind = Stmt::generation;
      std::string stop;
      s->body = block({"endgeneration"}, stop);
      if (stop != "endgeneration") fail_at(where_, line, "{% generation %} without {% endgeneration %}");
      return s;
    }
    if (tag.empty()) fail_at(where_, line, "an empty {% %} tag");
    if (tag.rfind("end", 0) == 0 || tag == "elif" || tag == "else") fail_at(where_, line, "unexpected {% " + tag + " %}");
    fail_at(where_, line, "unsupported tag {% " + tag + " %}" +
                              (tag == "macro" || tag == "call" || tag == "include" || tag == "import" || tag == "extends" ||
                                       tag == "block" || tag == "filter" || tag == "raw" || tag == "with" || tag == "do"
                                   ? " (not in nn's Jinja subset)"
                                   : ""));
  }

  std::vector<Chunk> c_;
  std::size_t p_ = 0;
  std::string where_;
  int line_ = 1;
  int depth_ = 0;
};

}  // namespace detail::jinja

/// A chat template (Jinja), parsed once, rendered as transformers renders it.
class ChatTemplate {
 public:
  using Json = nlohmann::ordered_json;

  ChatTemplate() = default;
  /// Parses `source`; `name` (a file, "tokenizer_config.json chat_template") names it in errors.
  explicit ChatTemplate(std::string source, std::string name = "chat_template") : source_(std::move(source)), name_(std::move(name)) {
    body_ = std::make_shared<detail::jinja::Body>(
        detail::jinja::Parser(detail::jinja::lex(source_, name_), name_).parse());
  }

  bool empty() const { return !body_; }

  /// Bounds on one render: a template is input, and must not hang or fill memory (an nn::Error
  /// says which bound it passed).
  std::size_t max_steps = 20'000'000;            // statements run plus loop turns
  std::size_t max_output = std::size_t{256} << 20;  // bytes of rendered text
  /// The local time strftime_now() formats (Llama 3's "Today Date"); unset, the clock's now, as
  /// transformers does. Set it for renders that must not change with the day (tests, recorded
  /// prompts).
  std::optional<std::tm> now;
  const std::string& source() const { return source_; }

  /// Renders with the variables of `context` (an object: messages, tools, add_generation_prompt,
  /// bos_token, eos_token, and any template option such as enable_thinking).
  std::string render(const Json& context) const {
    if (!body_) nn::detail::fail("chat_template", name_, ": no template");
    if (!context.is_object()) nn::detail::fail("chat_template", name_, ": the context must be a JSON object");
    Renderer r{*this, {}};
    r.scopes.emplace_back();
    for (auto it = context.begin(); it != context.end(); ++it) r.scopes.back()[it.key()] = detail::jinja::Value::of(it.value());
    std::string out;
    try {
      r.run(*body_, out);
    } catch (const nn::Error&) {
      throw;
    } catch (const std::exception& e) {  // a JSON type error, an allocation refused, ...
      detail::jinja::fail_at(name_, r.line, std::string("cannot render: ") + e.what());
    }
    return out;
  }

  /// apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False) with
  /// `extra` variables (bos_token, eos_token, enable_thinking, date_string, ...) beside them. As
  /// transformers does, tools and documents are always defined (None when not given), and a
  /// message's reasoning under "reasoning_content", "thinking" or "reasoning" is passed as both
  /// "thinking" (first) and "reasoning_content" (last).
  std::string apply(const Json& messages, bool add_generation_prompt, const Json& extra = Json::object(),
                    const Json& tools = nullptr) const {
    if (!messages.is_array()) nn::detail::fail("chat_template", name_, ": messages must be a JSON array");
    Json ctx = extra.is_object() ? extra : Json::object();
    Json msgs = Json::array();
    for (const Json& m : messages) {
      if (!m.is_object()) nn::detail::fail("chat_template", name_, ": each message must be a JSON object, got ", m.dump().substr(0, 80));
      const Json* reasoning = nullptr;
      for (const char* k : {"reasoning_content", "thinking", "reasoning"})
        if (auto it = m.find(k); !reasoning && it != m.end() && !it->is_null()) reasoning = &*it;
      if (!reasoning) {
        msgs.push_back(m);
        continue;
      }
      Json a = Json::object();
      a["thinking"] = *reasoning;
      for (auto it = m.begin(); it != m.end(); ++it) a[it.key()] = it.value();
      a.erase("reasoning_content");
      a["reasoning_content"] = *reasoning;
      msgs.push_back(std::move(a));
    }
    ctx["messages"] = std::move(msgs);
    ctx["tools"] = tools;
    if (!ctx.contains("documents")) ctx["documents"] = nullptr;
    ctx["add_generation_prompt"] = add_generation_prompt;
    return render(ctx);
  }

 private:
  using Value = detail::jinja::Value;
  using Node = detail::jinja::Node;
  using Stmt = detail::jinja::Stmt;

  struct LoopSignal {
    enum Kind { none, brk, cont } kind = none;
  };

  struct Renderer {
    const ChatTemplate& t;
    std::vector<std::map<std::string, Value, std::less<>>> scopes;
    int line = 1;
    std::size_t steps = 0;

    [[noreturn]] void fail(const std::string& msg) const { detail::jinja::fail_at(t.name_, line, msg); }

    [[noreturn]] std::int64_t overflow() const { fail("integer overflow (past 64 bits)"); }

    void step() {
      if (++steps > t.max_steps) fail("the template ran more than " + std::to_string(t.max_steps) + " statements and loop turns");
    }

    Value lookup(const std::string& name) const {
      for (auto it = scopes.rbegin(); it != scopes.rend(); ++it)
        if (auto f = it->find(name); f != it->end()) return f->second;
      static const char* globals[] = {"range", "namespace", "dict", "raise_exception", "strftime_now", "lipsum", "cycler", "joiner"};
      for (const char* g : globals)
        if (name == g) return Value::fn(name);
      return Value::undef(name);
    }

    // ---- statements ----

    LoopSignal run(const detail::jinja::Body& body, std::string& out) {
      for (const auto& sp : body) {
        const Stmt& s = *sp;
        line = s.line;
        // A template is input: bound its work and output rather than hang or exhaust memory.
        step();
        if (out.size() > t.max_output) fail("the rendered text passed " + std::to_string(t.max_output) + " bytes");
        switch (s.kind) {
          case Stmt::text: out += s.str; break;
          case Stmt::output: out += detail::jinja::py_str(eval(*s.expr)); break;
          case Stmt::if_:
            for (const auto& [c, b] : s.branches)
              if (!c || detail::jinja::truthy(eval(*c))) {
                if (LoopSignal sig = run(b, out); sig.kind != LoopSignal::none) return sig;
                break;
              }
            break;
          case Stmt::for_:
            run_for(s, out);
            break;
          case Stmt::set: {
            Value v = eval(*s.expr);
            if (s.names.size() == 1) {
              scopes.back()[s.names[0]] = std::move(v);
            } else {
              const auto items = iterate(v);
              if (items.size() != s.names.size())
                fail("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(s.names.size()) + " names");
              for (std::size_t i = 0; i < items.size(); ++i) scopes.back()[s.names[i]] = items[i];
            }
            break;
          }
          case Stmt::set_attr: {
            Value ns = lookup(s.names[0]);
            if (ns.kind != Value::ns) fail("cannot set attribute '" + s.names[1] + "' of '" + s.names[0] + "': not a namespace");
            if (!s.names[1].empty() && s.names[1][0] == '_') fail("namespace attributes cannot start with '_'");
            Value v = eval(*s.expr);
            if (v.kind != Value::data && v.kind != Value::undefined) fail("a namespace attribute holds data only");
            (*ns.space)[s.names[1]] = v.kind == Value::data ? v.j : Json();
            break;
          }
          case Stmt::set_block: {
            std::string inner;
            scopes.emplace_back();
            run(s.body, inner);
            scopes.pop_back();
            scopes.back()[s.names[0]] = Value::of(inner);
            break;
          }
          case Stmt::brk: return {LoopSignal::brk};
          case Stmt::cont: return {LoopSignal::cont};
          case Stmt::generation:
            if (LoopSignal sig = run(s.body, out); sig.kind != LoopSignal::none) return sig;
            break;
        }
      }
      return {};
    }

    void run_for(const Stmt& s, std::string& out) {
      Value seq = eval(*s.expr);
      std::vector<Value> items = iterate(seq);
      if (s.filter) {
        std::vector<Value> kept;
        for (const Value& v : items) {
          scopes.emplace_back();
          bind(s, v);
          if (detail::jinja::truthy(eval(*s.filter))) kept.push_back(v);
          scopes.pop_back();
        }
        items = std::move(kept);
      }
      if (items.empty()) {
        scopes.emplace_back();
        run(s.else_body, out);
        scopes.pop_back();
        return;
      }
      const auto n = static_cast<std::int64_t>(items.size());
      for (std::int64_t i = 0; i < n; ++i) {
        step();
        scopes.emplace_back();
        bind(s, items[static_cast<std::size_t>(i)]);
        Json loop = {{"index", i + 1}, {"index0", i}, {"revindex", n - i}, {"revindex0", n - i - 1}, {"first", i == 0},
                     {"last", i == n - 1}, {"length", n}, {"depth", 1}, {"depth0", 0}};
        const Value& prev = items[static_cast<std::size_t>(std::max<std::int64_t>(i - 1, 0))];
        const Value& next = items[static_cast<std::size_t>(std::min(i + 1, n - 1))];
        if (i > 0 && prev.kind == Value::data) loop["previtem"] = prev.j;
        if (i + 1 < n && next.kind == Value::data) loop["nextitem"] = next.j;
        scopes.back()["loop"] = Value::of(std::move(loop));
        const LoopSignal sig = run(s.body, out);
        scopes.pop_back();
        if (sig.kind == LoopSignal::brk) break;
      }
    }

    void bind(const Stmt& s, const Value& v) {
      if (s.names.size() == 1) {
        scopes.back()[s.names[0]] = v;
        return;
      }
      const auto parts = iterate(v);
      if (parts.size() != s.names.size())
        fail("cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(s.names.size()) + " loop names");
      for (std::size_t k = 0; k < parts.size(); ++k) scopes.back()[s.names[k]] = parts[k];
    }

    // The items a for loop (or list()) goes over: a list's elements, a dict's keys, a string's
    // characters (UTF-8 code points).
    std::vector<Value> iterate(const Value& v) const {
      std::vector<Value> out;
      if (v.kind == Value::undefined) return out;  // Jinja iterates an undefined value as empty
      if (v.kind != Value::data) fail("cannot iterate over " + detail::jinja::py_str(v));
      if (v.j.is_array()) {
        for (const auto& x : v.j) out.push_back(Value::of(x));
      } else if (v.j.is_object()) {
        for (auto it = v.j.begin(); it != v.j.end(); ++it) out.push_back(Value::of(it.key()));
      } else if (v.j.is_string()) {
        const std::string s = v.j.get<std::string>();
        for (std::size_t i = 0; i < s.size();) {
          std::size_t n = 1;
          const auto c = static_cast<unsigned char>(s[i]);
          if (c >= 0xF0) n = 4;
          else if (c >= 0xE0) n = 3;
          else if (c >= 0xC0) n = 2;
          out.push_back(Value::of(s.substr(i, n)));
          i += n;
        }
      } else {
        fail("cannot iterate over " + detail::jinja::py_str(v));
      }
      return out;
    }

    // ---- expressions ----

    const Json& data(const Value& v, const char* what) const {
      if (v.kind == Value::undefined) fail(std::string(what) + ": '" + v.name + "' is undefined");
      if (v.kind != Value::data) fail(std::string(what) + ": expected data, got " + detail::jinja::py_str(v));
      return v.j;
    }
    std::string str_arg(const Value& v, const char* what) const {
      const Json& j = data(v, what);
      if (!j.is_string()) fail(std::string(what) + ": expected a string, got " + detail::jinja::py_str(v));
      return j.get<std::string>();
    }
    std::int64_t int_arg(const Value& v, const char* what) const {
      const Json& j = data(v, what);
      if (j.is_boolean()) return j.get<bool>() ? 1 : 0;
      if (!j.is_number_integer()) fail(std::string(what) + ": expected an integer, got " + detail::jinja::py_str(v));
      return j.get<std::int64_t>();
    }

    Value attr(const Value& obj, const std::string& name) const {
      if (obj.kind == Value::undefined) fail("'" + obj.name + "' is undefined, so it has no attribute '" + name + "'");
      if (obj.kind == Value::ns) {
        auto it = obj.space->find(name);
        return it == obj.space->end() ? Value::undef(name) : Value::of(*it);
      }
      if (obj.kind != Value::data) return Value::undef(name);
      static const char* str_methods[] = {"startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip", "upper",
                                          "lower", "title", "capitalize", "replace", "find", "count", "join", "splitlines"};
      static const char* dict_methods[] = {"items", "keys", "values", "get"};
      auto is_method = [&](const auto& list) { return std::find(std::begin(list), std::end(list), name) != std::end(list); };
      if ((obj.j.is_string() && is_method(str_methods)) || (obj.j.is_object() && is_method(dict_methods))) {
        Value m;
        m.kind = Value::method;
        m.name = name;
        m.j = obj.j;
        return m;
      }
      if (obj.j.is_object()) {
        auto it = obj.j.find(name);
        return it == obj.j.end() ? Value::undef(name) : Value::of(*it);
      }
      return Value::undef(name);
    }

    Value item(const Value& obj, const Value& key) const {
      if (obj.kind == Value::undefined) fail("'" + obj.name + "' is undefined, so it cannot be subscripted");
      if (obj.kind == Value::ns) return key.is_string() ? attr(obj, key.j.get<std::string>()) : Value::undef();
      if (obj.kind != Value::data) return Value::undef();
      const Json& j = obj.j;
      if (j.is_object()) {
        if (!key.is_string()) return Value::undef();
        auto it = j.find(key.j.get<std::string>());
        return it == j.end() ? Value::undef(key.j.get<std::string>()) : Value::of(*it);
      }
      if ((j.is_array() || j.is_string()) && key.kind == Value::data && (key.j.is_number_integer() || key.j.is_boolean())) {
        if (j.is_string()) {
          const auto chars = iterate(obj);
          std::int64_t i = int_arg(key, "index");
          if (i < 0) i += static_cast<std::int64_t>(chars.size());
          return i < 0 || i >= static_cast<std::int64_t>(chars.size()) ? Value::undef() : chars[static_cast<std::size_t>(i)];
        }
        std::int64_t i = int_arg(key, "index");
        if (i < 0) i += static_cast<std::int64_t>(j.size());
        return i < 0 || i >= static_cast<std::int64_t>(j.size()) ? Value::undef() : Value::of(j[static_cast<std::size_t>(i)]);
      }
      if (key.is_string()) return attr(obj, key.j.get<std::string>());
      return Value::undef();
    }

    Value slice(const Value& obj, const Value& a, const Value& b, const Value& c) const {
      std::vector<Value> items;
      const bool is_str = obj.is_string();
      if (obj.kind == Value::data && (obj.j.is_array() || is_str)) items = iterate(obj);
      else fail("cannot slice " + detail::jinja::py_str(obj));
      const auto n = static_cast<std::int64_t>(items.size());
      const std::int64_t step = c.kind == Value::undefined || c.is_none() ? 1 : int_arg(c, "slice step");
      if (step == 0) fail("slice step cannot be zero");
      // Python's slice.indices
      auto norm = [&](const Value& v, std::int64_t dflt, bool is_start) {
        if (v.kind == Value::undefined || v.is_none()) return dflt;
        std::int64_t x = int_arg(v, "slice bound");
        if (x < 0) x += n;
        if (step > 0) return std::clamp<std::int64_t>(x, 0, n);
        (void)is_start;
        return std::clamp<std::int64_t>(x, -1, n - 1);
      };
      const std::int64_t start = norm(a, step > 0 ? 0 : n - 1, true);
      const std::int64_t stop = norm(b, step > 0 ? n : -1, false);
      Json out = is_str ? Json("") : Json::array();
      for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        const Value& v = items[static_cast<std::size_t>(i)];
        if (is_str) out.get_ref<std::string&>() += v.j.get<std::string>();
        else out.push_back(v.j);
      }
      return Value::of(std::move(out));
    }

    Value eval(const Node& n) {
      using K = Node::Kind;
      switch (n.kind) {
        case K::literal: return Value::of(n.value);
        case K::name: return lookup(n.s);
        case K::getattr: return attr(eval(*n.args[0]), n.s);
        case K::getitem: return item(eval(*n.args[0]), eval(*n.args[1]));
        case K::slice: {
          auto opt = [&](std::size_t k) { return n.args[k] ? eval(*n.args[k]) : Value::undef(); };
          return slice(eval(*n.args[0]), opt(1), opt(2), opt(3));
        }
        case K::list: {
          Json a = Json::array();
          for (const auto& x : n.args) a.push_back(data(eval(*x), "list item"));
          return Value::of(std::move(a));
        }
        case K::tuple: {
          Json a = Json::array();
          for (const auto& x : n.args) a.push_back(data(eval(*x), "tuple item"));
          return Value::of(std::move(a));
        }
        case K::dict: {
          Json o = Json::object();
          for (std::size_t k = 0; k + 1 < n.args.size(); k += 2) o[str_arg(eval(*n.args[k]), "dict key")] = data(eval(*n.args[k + 1]), "dict value");
          return Value::of(std::move(o));
        }
        case K::not_: return Value::of(!detail::jinja::truthy(eval(*n.args[0])));
        case K::and_: {
          Value a = eval(*n.args[0]);
          return detail::jinja::truthy(a) ? eval(*n.args[1]) : a;
        }
        case K::or_: {
          Value a = eval(*n.args[0]);
          return detail::jinja::truthy(a) ? a : eval(*n.args[1]);
        }
        case K::cond: {
          if (detail::jinja::truthy(eval(*n.args[0]))) return eval(*n.args[1]);
          return n.args[2] ? eval(*n.args[2]) : Value::undef();
        }
        case K::unary: {
          const Value operand = eval(*n.args[0]);
          const Json& v = data(operand, "unary operator");
          if (!v.is_number()) fail("unary '" + n.s + "' needs a number");
          if (n.s == "+") return Value::of(v);
          if (v.is_number_integer() && v.get<std::int64_t>() == INT64_MIN) fail("integer overflow");
          return Value::of(v.is_number_integer() ? Json(-v.get<std::int64_t>()) : Json(-v.get<double>()));
        }
        case K::binary: return binary(n.s, eval(*n.args[0]), eval(*n.args[1]));
        case K::compare: return Value::of(compare(n.s, eval(*n.args[0]), eval(*n.args[1])));
        case K::call: return call(n);
        case K::filter: return filter(n);
        case K::test: {
          const bool r = test(n);
          return Value::of(n.negate ? !r : r);
        }
      }
      return Value::undef();
    }

    Value binary(const std::string& op, const Value& a, const Value& b) const {
      if (op == "~") return Value::of(detail::jinja::py_str(a) + detail::jinja::py_str(b));
      const Json& x = data(a, ("operator " + op).c_str());
      const Json& y = data(b, ("operator " + op).c_str());
      if (op == "+" && x.is_string() && y.is_string()) return Value::of(x.get<std::string>() + y.get<std::string>());
      if (op == "+" && x.is_array() && y.is_array()) {
        Json r = x;
        for (const auto& e : y) r.push_back(e);
        return Value::of(std::move(r));
      }
      if (op == "*" && (x.is_string() || x.is_array()) && y.is_number_integer()) {
        const std::size_t unit = x.is_string() ? x.get_ref<const std::string&>().size() : x.size();
        if (y.get<std::int64_t>() > 0 && unit > 0 && static_cast<std::uint64_t>(y.get<std::int64_t>()) > t.max_output / unit)
          fail("a repetition longer than the output bound");
        Json r = x.is_string() ? Json("") : Json::array();
        for (std::int64_t k = 0; k < y.get<std::int64_t>(); ++k)
          if (x.is_string()) r.get_ref<std::string&>() += x.get<std::string>();
          else
            for (const auto& e : x) r.push_back(e);
        return Value::of(std::move(r));
      }
      auto num = [](const Json& v) { return v.is_number() || v.is_boolean(); };
      if (!num(x) || !num(y))
        fail("unsupported operand types for " + op + ": " + detail::jinja::py_str(a).substr(0, 40) + " and " +
             detail::jinja::py_str(b).substr(0, 40));
      auto as_i = [](const Json& v) { return v.is_boolean() ? std::int64_t{v.get<bool>()} : v.get<std::int64_t>(); };
      auto as_d = [](const Json& v) { return v.is_boolean() ? double(v.get<bool>()) : v.get<double>(); };
      const bool ints = !x.is_number_float() && !y.is_number_float();
      if (op == "/") {
        if (as_d(y) == 0) fail("division by zero");
        return Value::of(as_d(x) / as_d(y));
      }
      if (ints) {
        const std::int64_t p = as_i(x), q = as_i(y);
        std::int64_t r = 0;
        // Python's integers do not overflow; ours are 64-bit: past that is an error, not UB.
        if (op == "+") return Value::of(__builtin_add_overflow(p, q, &r) ? overflow() : r);
        if (op == "-") return Value::of(__builtin_sub_overflow(p, q, &r) ? overflow() : r);
        if (op == "*") return Value::of(__builtin_mul_overflow(p, q, &r) ? overflow() : r);
        if ((op == "//" || op == "%") && p == INT64_MIN && q == -1) overflow();
        if (op == "//" || op == "%") {
          if (q == 0) fail("division by zero");
          std::int64_t d = p / q, m = p % q;
          if (m != 0 && ((m < 0) != (q < 0))) {
            --d;
            m += q;
          }
          return Value::of(op == "//" ? d : m);
        }
        if (op == "**") {
          if (q < 0) return Value::of(std::pow(double(p), double(q)));
          std::int64_t acc = 1;
          for (std::int64_t k = 0; k < q; ++k)
            if (__builtin_mul_overflow(acc, p, &acc)) overflow();
          return Value::of(acc);
        }
      }
      const double p = as_d(x), q = as_d(y);
      if (op == "+") return Value::of(p + q);
      if (op == "-") return Value::of(p - q);
      if (op == "*") return Value::of(p * q);
      if (op == "//") return Value::of(std::floor(p / q));
      if (op == "%") return Value::of(p - std::floor(p / q) * q);
      if (op == "**") return Value::of(std::pow(p, q));
      fail("unknown operator " + op);
    }

    bool contains(const Value& hay, const Value& needle) const {
      const Json& h = data(hay, "operator in");
      if (h.is_string()) return needle.is_string() && h.get<std::string>().find(needle.j.get<std::string>()) != std::string::npos;
      if (h.is_object()) return needle.is_string() && h.contains(needle.j.get<std::string>());
      if (h.is_array()) {
        for (const auto& e : h)
          if (detail::jinja::py_equal(Value::of(e), needle)) return true;
        return false;
      }
      fail("operator in: " + detail::jinja::py_str(hay) + " is not a container");
    }

    bool compare(const std::string& op, const Value& a, const Value& b) const {
      if (op == "==") return detail::jinja::py_equal(a, b);
      if (op == "!=") return !detail::jinja::py_equal(a, b);
      if (op == "in") return contains(b, a);
      if (op == "not in") return !contains(b, a);
      const Json& x = data(a, ("operator " + op).c_str());
      const Json& y = data(b, ("operator " + op).c_str());
      int c;
      if (x.is_string() && y.is_string()) c = x.get<std::string>().compare(y.get<std::string>());
      else if ((x.is_number() || x.is_boolean()) && (y.is_number() || y.is_boolean())) {
        const double p = x.is_boolean() ? x.get<bool>() : x.get<double>(), q = y.is_boolean() ? y.get<bool>() : y.get<double>();
        c = p < q ? -1 : p > q ? 1 : 0;
      } else {
        fail("'" + op + "' not supported between " + detail::jinja::py_str(a).substr(0, 40) + " and " + detail::jinja::py_str(b).substr(0, 40));
      }
      if (op == "<") return c < 0;
      if (op == ">") return c > 0;
      if (op == "<=") return c <= 0;
      return c >= 0;
    }

    std::vector<Value> args_of(const Node& n, std::size_t from = 1) {
      std::vector<Value> a;
      for (std::size_t k = from; k < n.args.size(); ++k) a.push_back(eval(*n.args[k]));
      return a;
    }
    std::optional<Value> kwarg(const Node& n, const char* name) {
      for (const auto& [k, v] : n.kwargs)
        if (k == name) return eval(*v);
      return std::nullopt;
    }

    Value call(const Node& n) {
      Value f = eval(*n.args[0]);
      std::vector<Value> a = args_of(n);
      if (f.kind == Value::method) return method(f, a, n);
      if (f.kind != Value::func) {
        const Node& callee = *n.args[0];
        fail("'" + (callee.kind == Node::name || callee.kind == Node::getattr ? callee.s : detail::jinja::py_str(f)) + "' is not callable" +
             (f.kind == Value::undefined ? " (undefined)" : ""));
      }
      const std::string& name = f.name;
      if (name == "raise_exception") nn::detail::fail("chat_template", t.name_, " line ", line, ": the template raised: ", a.empty() ? "" : detail::jinja::py_str(a[0]));
      if (name == "namespace" || name == "dict") {
        auto space = std::make_shared<Json>(Json::object());
        for (const Value& v : a) {  // dict(mapping) / namespace(mapping)
          const Json& m = data(v, name.c_str());
          if (!m.is_object()) fail(name + "(): a positional argument must be a mapping");
          for (auto it = m.begin(); it != m.end(); ++it) (*space)[it.key()] = it.value();
        }
        for (const auto& [k, v] : n.kwargs) {
          if (name == "namespace" && !k.empty() && k[0] == '_') fail("namespace attributes cannot start with '_'");
          Value x = eval(*v);
          (*space)[k] = x.kind == Value::data ? x.j : Json();
        }
        if (name == "dict") return Value::of(std::move(*space));
        Value ns;
        ns.kind = Value::ns;
        ns.space = std::move(space);
        return ns;
      }
      if (name == "range") {
        std::int64_t start = 0, stop = 0, step = 1;
        if (a.size() == 1) stop = int_arg(a[0], "range");
        else if (a.size() >= 2) {
          start = int_arg(a[0], "range");
          stop = int_arg(a[1], "range");
          if (a.size() >= 3) step = int_arg(a[2], "range");
        } else {
          fail("range() takes 1 to 3 arguments");
        }
        if (step == 0) fail("range() step cannot be zero");
        Json r = Json::array();
        for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
          r.push_back(i);
          if (r.size() > t.max_steps) fail("range() longer than the step bound");
        }
        return Value::of(std::move(r));
      }
      if (name == "strftime_now") {
        const std::string fmt = a.empty() ? "%Y-%m-%d" : str_arg(a[0], "strftime_now");
        std::tm tm{};
        if (t.now) {
          tm = *t.now;
        } else {
          const std::time_t clock = std::time(nullptr);
#if defined(_WIN32)
          localtime_s(&tm, &clock);
#else
          localtime_r(&clock, &tm);
#endif
        }
        char buf[256];
        const std::size_t len = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
        return Value::of(std::string(buf, len));
      }
      fail("unsupported function '" + name + "'");
    }

    static std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right) {
      std::size_t b = 0, e = s.size();
      if (left)
        while (b < e && chars.find(s[b]) != std::string::npos) ++b;
      if (right)
        while (e > b && chars.find(s[e - 1]) != std::string::npos) --e;
      return s.substr(b, e - b);
    }

    // Python's str.split(sep) / split() (whitespace runs), with maxsplit.
    static Json py_split(const std::string& s, const std::optional<std::string>& sep, std::int64_t maxsplit) {
      Json out = Json::array();
      if (sep) {
        std::size_t b = 0;
        for (std::int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
          const std::size_t k = s.find(*sep, b);
          if (k == std::string::npos) break;
          out.push_back(s.substr(b, k - b));
          b = k + sep->size();
        }
        out.push_back(s.substr(b));
        return out;
      }
      const std::string ws = " \t\n\r\f\v";
      std::size_t i = s.find_first_not_of(ws);
      std::int64_t n = 0;
      while (i != std::string::npos) {
        if (maxsplit >= 0 && n == maxsplit) {
          out.push_back(strip_chars(s.substr(i), ws, false, true));
          break;
        }
        const std::size_t e = s.find_first_of(ws, i);
        out.push_back(s.substr(i, e == std::string::npos ? std::string::npos : e - i));
        ++n;
        i = e == std::string::npos ? e : s.find_first_not_of(ws, e);
      }
      return out;
    }

    static std::string case_map(std::string s, int mode) {  // 0 lower, 1 upper, 2 title, 3 capitalize (ASCII)
      bool start = true;
      for (std::size_t i = 0; i < s.size(); ++i) {
        char& c = s[i];
        const bool alpha = std::isalpha(static_cast<unsigned char>(c));
        if (mode == 0) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        else if (mode == 1) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
        else if (mode == 2) c = static_cast<char>(start ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        else c = static_cast<char>(i == 0 ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        start = !alpha;
      }
      return s;
    }

    Value method(const Value& m, const std::vector<Value>& a, const Node& n) {
      const Json& self = m.j;
      const std::string& name = m.name;
      auto arg_str = [&](std::size_t k, const char* what) { return str_arg(a.at(k), what); };
      if (self.is_object()) {
        if (name == "items") {
          Json r = Json::array();
          for (auto it = self.begin(); it != self.end(); ++it) r.push_back(Json::array({it.key(), it.value()}));
          return Value::of(std::move(r));
        }
        if (name == "keys" || name == "values") {
          Json r = Json::array();
          for (auto it = self.begin(); it != self.end(); ++it) r.push_back(name == "keys" ? Json(it.key()) : it.value());
          return Value::of(std::move(r));
        }
        if (name == "get") {
          if (a.empty()) fail("get() needs a key");
          auto it = a[0].is_string() ? self.find(a[0].j.get<std::string>()) : self.end();
          if (it != self.end()) return Value::of(*it);
          return a.size() > 1 ? a[1] : Value::of(nullptr);
        }
      }
      const std::string s = self.get<std::string>();
      const std::string ws = " \t\n\r\f\v";
      if (name == "startswith" || name == "endswith") {
        if (a.empty()) fail(name + "() needs an argument");
        std::vector<std::string> options;
        if (a[0].kind == Value::data && a[0].j.is_array())
          for (const auto& e : a[0].j) options.push_back(e.get<std::string>());
        else
          options.push_back(arg_str(0, name.c_str()));
        for (const auto& o : options)
          if (name == "startswith" ? s.compare(0, o.size(), o) == 0 && s.size() >= o.size()
                                   : s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0)
            return Value::of(true);
        return Value::of(false);
      }
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        const std::string chars = a.empty() || a[0].is_none() ? ws : arg_str(0, name.c_str());
        return Value::of(strip_chars(s, chars, name != "rstrip", name != "lstrip"));
      }
      if (name == "split" || name == "rsplit") {
        std::optional<std::string> sep;
        if (!a.empty() && !a[0].is_none()) sep = arg_str(0, "split");
        if (auto kw = kwarg(n, "sep"); kw && !kw->is_none()) sep = str_arg(*kw, "split");
        if (sep && sep->empty()) fail("split(): empty separator");
        std::int64_t maxsplit = a.size() > 1 ? int_arg(a[1], "split") : -1;
        if (auto kw = kwarg(n, "maxsplit")) maxsplit = int_arg(*kw, "split");
        if (name == "rsplit" && maxsplit >= 0) {
          if (!sep) fail("rsplit() with maxsplit needs a separator in nn's subset");
          Json all = py_split(s, sep, -1);
          if (static_cast<std::int64_t>(all.size()) <= maxsplit + 1) return Value::of(std::move(all));
          const std::size_t head = all.size() - static_cast<std::size_t>(maxsplit);
          std::string first;
          for (std::size_t k = 0; k < head; ++k) first += (k ? *sep : std::string()) + all[k].get<std::string>();
          Json r = Json::array({first});
          for (std::size_t k = head; k < all.size(); ++k) r.push_back(all[k]);
          return Value::of(std::move(r));
        }
        return Value::of(py_split(s, sep, maxsplit));
      }
      if (name == "splitlines") {
        Json r = Json::array();
        std::size_t b = 0;
        for (std::size_t k = 0; k < s.size(); ++k)
          if (s[k] == '\n' || s[k] == '\r') {
            r.push_back(s.substr(b, k - b));
            if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
            b = k + 1;
          }
        if (b < s.size()) r.push_back(s.substr(b));
        return Value::of(std::move(r));
      }
      if (name == "upper") return Value::of(case_map(s, 1));
      if (name == "lower") return Value::of(case_map(s, 0));
      if (name == "title") return Value::of(case_map(s, 2));
      if (name == "capitalize") return Value::of(case_map(s, 3));
      if (name == "replace") {
        if (a.size() < 2) fail("replace() needs two arguments");
        const std::string from = arg_str(0, "replace"), to = arg_str(1, "replace");
        std::int64_t count = a.size() > 2 ? int_arg(a[2], "replace") : -1;
        std::string r;
        std::size_t b = 0;
        if (from.empty()) fail("replace(): an empty pattern");
        for (std::size_t k; count != 0 && (k = s.find(from, b)) != std::string::npos; --count) {
          r += s.substr(b, k - b) + to;
          b = k + from.size();
        }
        return Value::of(r + s.substr(b));
      }
      if (name == "find") {
        const std::size_t k = s.find(arg_str(0, "find"));
        return Value::of(k == std::string::npos ? std::int64_t{-1} : static_cast<std::int64_t>(k));
      }
      if (name == "count") {
        const std::string sub = arg_str(0, "count");
        if (sub.empty()) fail("count(): an empty pattern");
        std::int64_t c = 0;
        for (std::size_t k = s.find(sub); k != std::string::npos; k = s.find(sub, k + sub.size())) ++c;
        return Value::of(c);
      }
      if (name == "join") {
        std::string r;
        bool first = true;
        for (const Value& v : iterate(a.at(0))) {
          if (!first) r += s;
          first = false;
          r += str_arg(v, "join");
        }
        return Value::of(r);
      }
      fail("unsupported method '" + name + "'");
    }

    // Filter / test arguments, with a test named by a string (select('equalto', x)).
    bool run_test(const std::string& name, const Value& v, const std::vector<Value>& a) const {
      auto arg = [&](std::size_t k) -> const Value& {
        if (k >= a.size()) fail("test '" + name + "' needs an argument");
        return a[k];
      };
      if (name == "defined") return v.kind != Value::undefined;
      if (name == "undefined") return v.kind == Value::undefined;
      if (name == "none") return v.is_none();
      if (name == "string") return v.is_string();
      if (name == "mapping") return v.kind == Value::data && v.j.is_object();
      if (name == "iterable") return v.kind == Value::data && (v.j.is_array() || v.j.is_object() || v.j.is_string());
      if (name == "sequence") return v.kind == Value::data && (v.j.is_array() || v.j.is_object() || v.j.is_string());
      if (name == "number") return v.kind == Value::data && v.j.is_number();
      if (name == "integer") return v.kind == Value::data && v.j.is_number_integer();
      if (name == "float") return v.kind == Value::data && v.j.is_number_float();
      if (name == "boolean") return v.kind == Value::data && v.j.is_boolean();
      if (name == "true") return v.kind == Value::data && v.j.is_boolean() && v.j.get<bool>();
      if (name == "false") return v.kind == Value::data && v.j.is_boolean() && !v.j.get<bool>();
      if (name == "callable") return v.kind == Value::func || v.kind == Value::method;
      if (name == "equalto" || name == "eq" || name == "==") return detail::jinja::py_equal(v, arg(0));
      if (name == "ne" || name == "!=") return !detail::jinja::py_equal(v, arg(0));
      if (name == "sameas") return detail::jinja::py_equal(v, arg(0)) && v.kind == arg(0).kind &&
                                   (v.kind != Value::data || v.j.type() == arg(0).j.type());
      if (name == "lt" || name == "<") return compare("<", v, arg(0));
      if (name == "le" || name == "<=") return compare("<=", v, arg(0));
      if (name == "gt" || name == ">" || name == "greaterthan") return compare(">", v, arg(0));
      if (name == "ge" || name == ">=") return compare(">=", v, arg(0));
      if (name == "lessthan") return compare("<", v, arg(0));
      if (name == "in") return contains(arg(0), v);
      if (name == "odd" || name == "even") {
        const std::int64_t i = int_arg(v, name.c_str());
        return ((i % 2) != 0) == (name == "odd");
      }
      if (name == "divisibleby") {
        const std::int64_t d = int_arg(arg(0), "divisibleby");
        return d != 0 && int_arg(v, "divisibleby") % d == 0;
      }
      if (name == "lower" || name == "upper") {
        if (!v.is_string()) return false;
        const std::string s = v.j.get<std::string>();
        return s == case_map(s, name == "lower" ? 0 : 1);
      }
      fail("unsupported test '" + name + "'");
    }

    bool test(const Node& n) {
      Value v = eval(*n.args[0]);
      return run_test(n.s, v, args_of(n));
    }

    Value filter(const Node& n) {
      const std::string& f = n.s;
      Value v = eval(*n.args[0]);
      std::vector<Value> a = args_of(n);
      auto list_of = [&](const Value& x) {
        Json r = Json::array();
        for (const Value& e : iterate(x)) r.push_back(e.j);
        return r;
      };
      if (f == "tojson") {
        const Json& j = v.kind == Value::undefined ? Json() : data(v, "tojson");
        std::int64_t indent = -1;
        if (!a.empty() && !a[0].is_none()) indent = int_arg(a[0], "tojson");
        if (auto k = kwarg(n, "indent"); k && !k->is_none()) indent = int_arg(*k, "tojson");
        if (auto k = kwarg(n, "ensure_ascii"); k && detail::jinja::truthy(*k)) fail("tojson(ensure_ascii=True) is not supported");
        if (auto k = kwarg(n, "sort_keys"); k && detail::jinja::truthy(*k)) fail("tojson(sort_keys=True) is not supported");
        if (kwarg(n, "separators")) fail("tojson(separators=...) is not supported");
        std::string out;
        detail::jinja::py_json(out, j, static_cast<int>(indent), 0);
        return Value::of(out);
      }
      if (f == "length" || f == "count") {
        if (v.kind == Value::undefined) return Value::of(std::int64_t{0});
        const Json& j = data(v, "length");
        if (j.is_string()) return Value::of(static_cast<std::int64_t>(iterate(v).size()));
        if (!j.is_array() && !j.is_object()) fail("length of " + detail::jinja::py_str(v) + " (not a sequence)");
        return Value::of(static_cast<std::int64_t>(j.size()));
      }
      if (f == "trim") {
        const std::string chars = a.empty() || a[0].is_none() ? std::string(" \t\n\r\f\v") : str_arg(a[0], "trim");
        return Value::of(strip_chars(detail::jinja::py_str(v), chars, true, true));
      }
      if (f == "string") return Value::of(detail::jinja::py_str(v));
      if (f == "lower" || f == "upper" || f == "title" || f == "capitalize")
        return Value::of(case_map(detail::jinja::py_str(v), f == "lower" ? 0 : f == "upper" ? 1 : f == "title" ? 2 : 3));
      if (f == "safe" || f == "e" || f == "escape") {
        if (f != "safe") fail("filter '" + f + "' (HTML escaping) is not in nn's Jinja subset");
        return v;
      }
      if (f == "default" || f == "d") {
        const bool boolean = (a.size() > 1 && detail::jinja::truthy(a[1])) || (kwarg(n, "boolean") && detail::jinja::truthy(*kwarg(n, "boolean")));
        if (v.kind == Value::undefined || (boolean && !detail::jinja::truthy(v))) return a.empty() ? Value::of("") : a[0];
        return v;
      }
      if (f == "items") {
        if (v.kind == Value::undefined) return Value::of(Json::array());
        const Json& j = data(v, "items");
        if (!j.is_object()) fail("items of " + detail::jinja::py_str(v) + " (not a mapping)");
        Json r = Json::array();
        for (auto it = j.begin(); it != j.end(); ++it) r.push_back(Json::array({it.key(), it.value()}));
        return Value::of(std::move(r));
      }
      if (f == "list") return Value::of(list_of(v));
      if (f == "first" || f == "last") {
        const auto items = iterate(v);
        if (items.empty()) return Value::undef(f);
        return f == "first" ? items.front() : items.back();
      }
      if (f == "reverse") {
        if (v.is_string()) {
          auto items = iterate(v);
          std::string r;
          for (auto it = items.rbegin(); it != items.rend(); ++it) r += it->j.get<std::string>();
          return Value::of(r);
        }
        Json r = list_of(v);
        std::reverse(r.begin(), r.end());
        return Value::of(std::move(r));
      }
      if (f == "join") {
        const std::string sep = a.empty() ? std::string() : str_arg(a[0], "join");
        std::optional<std::string> attribute;
        if (auto k = kwarg(n, "attribute")) attribute = str_arg(*k, "join");
        std::string r;
        bool first = true;
        for (const Value& e : iterate(v)) {
          if (!first) r += sep;
          first = false;
          r += detail::jinja::py_str(attribute ? attr(e, *attribute) : e);
        }
        return Value::of(r);
      }
      if (f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") {
        const bool by_attr = f == "selectattr" || f == "rejectattr";
        const bool keep_if = f == "select" || f == "selectattr";
        std::size_t k = 0;
        std::optional<std::string> attribute;
        if (by_attr) attribute = str_arg(a.at(k++), f.c_str());
        std::optional<std::string> test_name;
        if (k < a.size()) test_name = str_arg(a[k++], f.c_str());
        const std::vector<Value> rest(a.begin() + static_cast<std::ptrdiff_t>(std::min(k, a.size())), a.end());
        Json r = Json::array();
        for (const Value& e : iterate(v)) {
          const Value subject = attribute ? attr(e, *attribute) : e;
          const bool pass = test_name ? run_test(*test_name, subject, rest) : detail::jinja::truthy(subject);
          if (pass == keep_if) r.push_back(e.j);
        }
        return Value::of(std::move(r));
      }
      if (f == "map") {
        Json r = Json::array();
        if (auto k = kwarg(n, "attribute")) {
          const std::string at = str_arg(*k, "map");
          for (const Value& e : iterate(v)) {
            Value x = attr(e, at);
            if (x.kind == Value::undefined) {
              if (auto d = kwarg(n, "default")) x = *d;
            }
            r.push_back(x.kind == Value::data ? x.j : Json());
          }
          return Value::of(std::move(r));
        }
        if (a.empty()) fail("map() needs a filter name or attribute=");
        const std::string fname = str_arg(a[0], "map");
        for (const Value& e : iterate(v)) {
          // Apply the named filter with the remaining arguments.
          auto node = std::make_shared<Node>();
          node->kind = Node::filter;
          node->s = fname;
          auto lit = std::make_shared<Node>();
          lit->value = e.j;
          node->args.push_back(lit);
          for (std::size_t k = 1; k < n.args.size() - 1; ++k) node->args.push_back(n.args[k + 1]);
          Value x = filter(*node);
          r.push_back(x.kind == Value::data ? x.j : Json());
        }
        return Value::of(std::move(r));
      }
      if (f == "unique") {
        Json r = Json::array();
        for (const Value& e : iterate(v)) {
          bool seen = false;
          for (const auto& x : r) seen = seen || detail::jinja::py_equal(Value::of(x), e);
          if (!seen) r.push_back(e.j);
        }
        return Value::of(std::move(r));
      }
      if (f == "replace") {
        if (a.size() < 2) fail("replace needs two arguments");
        Value m;
        m.kind = Value::method;
        m.name = "replace";
        m.j = detail::jinja::py_str(v);
        return method(m, a, n);
      }
      if (f == "int") {
        if (v.kind == Value::data && v.j.is_number()) return Value::of(v.j.is_number_float() ? static_cast<std::int64_t>(v.j.get<double>()) : v.j.get<std::int64_t>());
        if (v.is_string()) try {
            return Value::of(static_cast<std::int64_t>(std::stoll(v.j.get<std::string>())));
          } catch (...) {
          }
        return a.empty() ? Value::of(std::int64_t{0}) : a[0];
      }
      if (f == "float") {
        if (v.kind == Value::data && v.j.is_number()) return Value::of(v.j.get<double>());
        if (v.is_string()) try {
            return Value::of(std::stod(v.j.get<std::string>()));
          } catch (...) {
          }
        return a.empty() ? Value::of(0.0) : a[0];
      }
      if (f == "abs") {
        const Json& j = data(v, "abs");
        if (j.is_number_integer()) {
          if (j.get<std::int64_t>() == INT64_MIN) fail("integer overflow");
          return Value::of(std::llabs(j.get<std::int64_t>()));
        }
        return Value::of(std::fabs(j.get<double>()));
      }
      if (f == "sum" || f == "min" || f == "max") {
        const auto items = iterate(v);
        if (f == "sum") {
          Value acc = Value::of(std::int64_t{0});
          for (const Value& e : items) acc = binary("+", acc, e);
          return acc;
        }
        if (items.empty()) return Value::undef(f);
        Value best = items[0];
        for (const Value& e : items)
          if (compare(f == "min" ? "<" : ">", e, best)) best = e;
        return best;
      }
      if (f == "indent") {
        const std::int64_t w = a.empty() ? 4 : int_arg(a[0], "indent");
        const bool first = a.size() > 1 && detail::jinja::truthy(a[1]);
        const std::string pad(static_cast<std::size_t>(std::max<std::int64_t>(w, 0)), ' ');
        const std::string s = detail::jinja::py_str(v);
        std::string r;
        for (std::size_t k = 0; k < s.size(); ++k) {
          r += s[k];
          if (s[k] == '\n' && k + 1 < s.size() && s[k + 1] != '\n') r += pad;
        }
        return Value::of(first ? pad + r : r);
      }
      if (f == "wordcount") return Value::of(static_cast<std::int64_t>(py_split(detail::jinja::py_str(v), std::nullopt, -1).size()));
      if (f == "sort" || f == "dictsort") {
        Json r = f == "dictsort" ? filter_items(v) : list_of(v);
        std::stable_sort(r.begin(), r.end(), [&](const Json& x, const Json& y) {
          const Json& p = f == "dictsort" ? x[0] : x;
          const Json& q = f == "dictsort" ? y[0] : y;
          return compare("<", Value::of(p), Value::of(q));
        });
        if (!a.empty() && detail::jinja::truthy(a[0])) std::reverse(r.begin(), r.end());
        return Value::of(std::move(r));
      }
      fail("unsupported filter '" + f + "'");
    }

    Json filter_items(const Value& v) const {
      const Json& j = data(v, "dictsort");
      if (!j.is_object()) fail("dictsort of a non-mapping");
      Json r = Json::array();
      for (auto it = j.begin(); it != j.end(); ++it) r.push_back(Json::array({it.key(), it.value()}));
      return r;
    }
  };

  std::string source_;
  std::string name_ = "chat_template";
  std::shared_ptr<const detail::jinja::Body> body_;
};

}  // namespace nn::lm

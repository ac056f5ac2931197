// SPDX-License-Identifier: MIT OR Apache-2.0
// A small backtracking regex over Unicode code points, enough for tokenizer pre-tokenizer
// patterns (\p{L}, \p{N}, \s, classes, alternation, counted repeats, lookahead, (?i:...)).
//
// Why not std::regex: it has no \p{..} classes and works on bytes or wchar_t. The semantics
// follow Oniguruma (what Hugging Face `tokenizers` uses): leftmost-first alternation, greedy
// quantifiers with backtracking, \s = White_Space, \d = Nd, \w = word characters (below), ^ and
// $ are line anchors (Ruby syntax). Case-insensitive matching folds ASCII letters, plus U+017F (long s)
// with s and U+212A (Kelvin sign) with k, which are the only non-ASCII simple case folds onto
// ASCII; non-ASCII letters in a (?i) pattern match only themselves. Lookbehind, backreferences,
// possessive quantifiers, atomic groups and nested classes are not supported and are reported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "unicode.hpp"

namespace nn::lm::detail {

/// A set of code points: a union of atoms, each a set of ranges and general categories,
/// possibly complemented. ASCII membership is precomputed into a bitmap.
struct CharSet {
  struct Atom {
    std::vector<std::pair<char32_t, char32_t>> ranges;
    std::uint32_t cats = 0;  // bit per Gc
    bool negated = false;
    bool contains(char32_t c, Gc g) const {
      bool in = (cats >> static_cast<unsigned>(g)) & 1u;
      for (std::size_t i = 0; !in && i < ranges.size(); ++i) in = c >= ranges[i].first && c <= ranges[i].second;
      return in != negated;
    }
  };
  std::vector<Atom> atoms;
  bool negated = false;
  std::uint64_t ascii[2] = {0, 0};

  bool contains_slow(char32_t c, Gc g) const {
    bool in = false;
    for (std::size_t i = 0; !in && i < atoms.size(); ++i) in = atoms[i].contains(c, g);
    return in != negated;
  }
  void finish() {
    ascii[0] = ascii[1] = 0;
    for (char32_t c = 0; c < 128; ++c)
      if (contains_slow(c, general_category(c))) ascii[c >> 6] |= std::uint64_t{1} << (c & 63);
  }
  bool contains(char32_t c, Gc g) const {
    if (c < 128) return (ascii[c >> 6] >> (c & 63)) & 1u;
    return contains_slow(c, g);
  }
};

inline constexpr std::uint32_t gc_bit(Gc g) { return 1u << static_cast<unsigned>(g); }
inline constexpr std::uint32_t kLetterBits = gc_bit(Gc::Lu) | gc_bit(Gc::Ll) | gc_bit(Gc::Lt) | gc_bit(Gc::Lm) | gc_bit(Gc::Lo);
inline constexpr std::uint32_t kMarkBits = gc_bit(Gc::Mn) | gc_bit(Gc::Mc) | gc_bit(Gc::Me);
inline constexpr std::uint32_t kNumberBits = gc_bit(Gc::Nd) | gc_bit(Gc::Nl) | gc_bit(Gc::No);
inline constexpr std::uint32_t kPunctBits = gc_bit(Gc::Pc) | gc_bit(Gc::Pd) | gc_bit(Gc::Ps) | gc_bit(Gc::Pe) |
                                            gc_bit(Gc::Pi) | gc_bit(Gc::Pf) | gc_bit(Gc::Po);
inline constexpr std::uint32_t kSymbolBits = gc_bit(Gc::Sm) | gc_bit(Gc::Sc) | gc_bit(Gc::Sk) | gc_bit(Gc::So);
inline constexpr std::uint32_t kSepBits = gc_bit(Gc::Zs) | gc_bit(Gc::Zl) | gc_bit(Gc::Zp);
inline constexpr std::uint32_t kOtherBits = gc_bit(Gc::Cn) | gc_bit(Gc::Cc) | gc_bit(Gc::Cf) | gc_bit(Gc::Cs) | gc_bit(Gc::Co);

inline CharSet::Atom space_atom(bool neg) {
  return {{{9, 13}, {0x85, 0x85}}, kSepBits, neg};
}
// Oniguruma's \w (checked against tokenizers over every code point): letters, marks, Nd, Pc,
// letter numbers (Nl), the Latin-1 digits and fractions it counts as alphanumeric, and the
// circled / squared Latin letters (So, but Alphabetic).
inline constexpr std::uint32_t kWordBits = kLetterBits | kMarkBits | gc_bit(Gc::Nd) | gc_bit(Gc::Pc) | gc_bit(Gc::Nl);
inline constexpr std::pair<char32_t, char32_t> kWordExtra[] = {
    {0xB2, 0xB3}, {0xB9, 0xB9}, {0xBC, 0xBE}, {0x24B6, 0x24E9}, {0x1F130, 0x1F149}, {0x1F150, 0x1F169}, {0x1F170, 0x1F189}};
inline CharSet::Atom word_atom(bool neg) {
  return {{std::begin(kWordExtra), std::end(kWordExtra)}, kWordBits, neg};
}
inline bool is_word_char(char32_t c, Gc g) {
  if ((kWordBits >> static_cast<unsigned>(g)) & 1u) return true;
  for (const auto& [lo, hi] : kWordExtra)
    if (c >= lo && c <= hi) return true;
  return false;
}

class Regex {
 public:
  Regex() = default;
  /// Compiles `pattern`; a syntax error or unsupported construct throws nn::Error under `where`.
  explicit Regex(std::string_view pattern, std::string where = "regex") : pattern_(pattern) {
    std::size_t i = 0;
    while (i < pattern.size()) pat_.push_back(utf8_next(pattern, i));
    Parser p{*this, std::move(where)};
    Node root = p.parse_alt();
    if (p.pos != pat_.size()) p.error("unbalanced ')'");
    auto prog = std::make_shared<Program>();
    compile(root, *prog);
    prog->code.push_back({Op::match, 0, 0, false});
    prog_ = std::move(prog);
    pat_.clear();
  }

  const std::string& pattern() const { return pattern_; }

  /// End of the match starting exactly at `pos` of cps[0, n), or SIZE_MAX when none.
  std::size_t match_at(const char32_t* cps, const Gc* gcs, std::size_t n, std::size_t pos) const {
    return run(*prog_, cps, gcs, n, pos);
  }

  /// Calls f(begin, end) for every non-empty leftmost-first match, scanning left to right and
  /// resuming after each match (Oniguruma's find_iter without empty matches).
  template <class F>
  void find_all(const char32_t* cps, const Gc* gcs, std::size_t n, F&& f) const {
    std::size_t pos = 0;
    while (pos < n) {
      const std::size_t e = run(*prog_, cps, gcs, n, pos);
      if (e != SIZE_MAX && e > pos) {
        f(pos, e);
        pos = e;
      } else {
        ++pos;
      }
    }
  }

 private:
  // rep: a greedy run of one set (sets[a], at least b, at most c or unbounded when c < 0),
  // which backtracks by giving back one character at a time through a single stack entry
  // instead of one entry per character: \p{L}+ and \s+ are most of the work.
  enum class Op : std::uint8_t { cls, split, jmp, match, look, bol, eol, bos, eos, wordb, nwordb, rep };
  struct Inst {
    Op op;
    std::int32_t a, b;
    bool neg;
    std::int32_t c = 0;
  };
  struct Program {
    std::vector<Inst> code;
    std::vector<CharSet> sets;
    std::vector<std::shared_ptr<Program>> subs;  // lookahead bodies
  };

  struct Node {
    enum Kind : std::uint8_t { set, concat, alt, repeat, look, assert_, empty } kind = empty;
    CharSet cs;
    std::vector<Node> kids;
    int min = 0, max = 0;  // repeat; max < 0: unbounded
    bool greedy = true;
    bool neg = false;      // look
    Op assertion = Op::bol;
  };

  struct Parser {
    Regex& re;
    std::string where;
    std::size_t pos = 0;
    std::vector<bool> icase{false};

    [[noreturn]] void error(const std::string& what) const {
      nn::detail::fail(where, "pattern ", '"', re.pattern_, '"', ": ", what, " (at code point ", pos, ")");
    }
    bool more() const { return pos < re.pat_.size(); }
    char32_t peek() const { return re.pat_[pos]; }
    bool eat(char32_t c) {
      if (more() && peek() == c) {
        ++pos;
        return true;
      }
      return false;
    }

    Node parse_alt() {
      Node first = parse_concat();
      if (!more() || peek() != U'|') return first;
      Node n;
      n.kind = Node::alt;
      n.kids.push_back(std::move(first));
      while (eat(U'|')) n.kids.push_back(parse_concat());
      return n;
    }

    Node parse_concat() {
      Node n;
      n.kind = Node::concat;
      const bool saved_icase = icase.back();
      while (more() && peek() != U'|' && peek() != U')') {
        if (auto atom = parse_repeat()) n.kids.push_back(std::move(*atom));
      }
      icase.back() = saved_icase;  // an inline (?i) lasts to the end of its alternative's group
      return n;
    }

    std::unique_ptr<Node> parse_repeat() {
      auto atom = parse_atom();
      if (!atom) return nullptr;
      while (more()) {
        int mn = 0, mx = 0;
        const char32_t c = peek();
        if (c == U'*') mn = 0, mx = -1, ++pos;
        else if (c == U'+') mn = 1, mx = -1, ++pos;
        else if (c == U'?') mn = 0, mx = 1, ++pos;
        else if (c == U'{' && parse_braces(mn, mx)) {}
        else break;
        if (atom->kind == Node::assert_ || atom->kind == Node::look) error("quantifier after an assertion");
        Node r;
        r.kind = Node::repeat;
        r.min = mn;
        r.max = mx;
        if (eat(U'?')) r.greedy = false;
        else if (more() && peek() == U'+') error("possessive quantifiers are not supported");
        if (nullable(*atom) && mx < 0) error("an unbounded repeat of something that can match empty");
        r.kids.push_back(std::move(*atom));
        *atom = std::move(r);
      }
      return atom;
    }

    // {n}, {n,}, {n,m}; anything else is a literal '{' (as Oniguruma reads it).
    bool parse_braces(int& mn, int& mx) {
      std::size_t p = pos + 1;
      auto num = [&](int& v) {
        std::size_t s = p;
        v = 0;
        while (p < re.pat_.size() && re.pat_[p] >= U'0' && re.pat_[p] <= U'9') v = v * 10 + static_cast<int>(re.pat_[p++] - U'0');
        return p > s;
      };
      if (!num(mn)) return false;
      if (p < re.pat_.size() && re.pat_[p] == U'}') {
        mx = mn;
      } else if (p < re.pat_.size() && re.pat_[p] == U',') {
        ++p;
        if (!num(mx)) mx = -1;
        if (p >= re.pat_.size() || re.pat_[p] != U'}') return false;
      } else {
        return false;
      }
      if (mx >= 0 && mx < mn) error("bad repeat bounds");
      if (mn > 1000 || mx > 1000) error("repeat bound too large");
      pos = p + 1;
      return true;
    }

    static bool nullable(const Node& n) {
      switch (n.kind) {
        case Node::set: return false;
        case Node::concat:
          for (const auto& k : n.kids)
            if (!nullable(k)) return false;
          return true;
        case Node::alt:
          for (const auto& k : n.kids)
            if (nullable(k)) return true;
          return false;
        case Node::repeat: return n.min == 0 || nullable(n.kids[0]);
        default: return true;
      }
    }

    Node literal(char32_t c) {
      Node n;
      n.kind = Node::set;
      CharSet::Atom a;
      add_char(a, c);
      n.cs.atoms.push_back(std::move(a));
      n.cs.finish();
      return n;
    }

    void add_char(CharSet::Atom& a, char32_t c) {
      a.ranges.push_back({c, c});
      if (!icase.back()) return;
      if (c >= U'a' && c <= U'z') a.ranges.push_back({c - 32, c - 32});
      if (c >= U'A' && c <= U'Z') a.ranges.push_back({c + 32, c + 32});
      if (c == U's' || c == U'S' || c == 0x17F) a.ranges.push_back({U's', U's'}), a.ranges.push_back({U'S', U'S'}), a.ranges.push_back({0x17F, 0x17F});
      if (c == U'k' || c == U'K' || c == 0x212A) a.ranges.push_back({U'k', U'k'}), a.ranges.push_back({U'K', U'K'}), a.ranges.push_back({0x212A, 0x212A});
    }
    void add_range(CharSet::Atom& a, char32_t lo, char32_t hi) {
      a.ranges.push_back({lo, hi});
      if (!icase.back()) return;
      for (char32_t c = lo; c <= hi && c < 128; ++c) add_char(a, c);
    }

    std::unique_ptr<Node> parse_atom() {
      const char32_t c = peek();
      ++pos;
      switch (c) {
        case U'(': return std::make_unique<Node>(parse_group());
        case U'[': {
          Node n;
          n.kind = Node::set;
          n.cs = parse_class();
          return std::make_unique<Node>(std::move(n));
        }
        case U'.': {
          Node n;
          n.kind = Node::set;
          n.cs.atoms.push_back({{{U'\n', U'\n'}}, 0, true});
          n.cs.finish();
          return std::make_unique<Node>(std::move(n));
        }
        case U'^': return std::make_unique<Node>(assertion(Op::bol));
        case U'$': return std::make_unique<Node>(assertion(Op::eol));
        case U'\\': return parse_escape_atom();
        case U'*': case U'+': case U'?': error("nothing to repeat");
        default: return std::make_unique<Node>(literal(c));
      }
    }

    static Node assertion(Op op) {
      Node n;
      n.kind = Node::assert_;
      n.assertion = op;
      return n;
    }

    Node parse_group() {
      if (eat(U'?')) {
        if (!more()) error("unterminated group");
        const char32_t c = peek();
        if (c == U':') {
          ++pos;
          return group_body(icase.back());
        }
        if (c == U'=' || c == U'!') {
          ++pos;
          Node n;
          n.kind = Node::look;
          n.neg = c == U'!';
          n.kids.push_back(group_body(icase.back()));
          return n;
        }
        if (c == U'<' && pos + 1 < re.pat_.size() && (re.pat_[pos + 1] == U'=' || re.pat_[pos + 1] == U'!'))
          error("lookbehind is not supported");
        if (c == U'<' || c == U'\'') {  // named group: matched as a plain group
          const char32_t close = c == U'<' ? U'>' : U'\'';
          while (more() && peek() != close) ++pos;
          if (!eat(close)) error("unterminated group name");
          return group_body(icase.back());
        }
        // Flags: (?i) (?-i) (?i:...) (?-i:...); other flags are rejected.
        bool on = true, flag = icase.back();
        while (more() && peek() != U':' && peek() != U')') {
          const char32_t f = peek();
          ++pos;
          if (f == U'-') on = false;
          else if (f == U'i') flag = on;
          else error(std::string("unsupported group flag"));
        }
        if (eat(U':')) return group_body(flag);
        if (!eat(U')')) error("unterminated group");
        icase.back() = flag;  // (?i) applies to the rest of the enclosing group
        return Node{};
      }
      return group_body(icase.back());
    }

    Node group_body(bool ic) {
      icase.push_back(ic);
      Node n = parse_alt();
      icase.pop_back();
      if (!eat(U')')) error("missing ')'");
      return n;
    }

    // A category name after \p or \P: one-letter or two-letter general categories and the long
    // names of the seven major classes.
    std::uint32_t category_bits(const std::u32string& name) {
      static const char* const names[kGcCount] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                                  "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                                  "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
      std::string s;
      for (char32_t c : name) s += static_cast<char>(c < 128 ? c : '?');
      if (s == "L" || s == "Letter") return kLetterBits;
      if (s == "M" || s == "Mark") return kMarkBits;
      if (s == "N" || s == "Number") return kNumberBits;
      if (s == "P" || s == "Punctuation") return kPunctBits;
      if (s == "S" || s == "Symbol") return kSymbolBits;
      if (s == "Z" || s == "Separator") return kSepBits;
      if (s == "C" || s == "Other") return kOtherBits;
      if (s == "L&" || s == "LC") return gc_bit(Gc::Lu) | gc_bit(Gc::Ll) | gc_bit(Gc::Lt);
      for (int i = 0; i < kGcCount; ++i)
        if (s == names[i]) return 1u << i;
      error("unsupported property \\p{" + s + "}");
    }

    // After a backslash: a class escape (\s \d \w \p{..} and negations) into `a`, returning
    // true; or false with `lit` set to the escaped literal code point.
    bool parse_escape(CharSet::Atom& a, char32_t& lit, bool in_class) {
      if (!more()) error("trailing backslash");
      const char32_t c = peek();
      ++pos;
      switch (c) {
        case U's': a = space_atom(false); return true;
        case U'S': a = space_atom(true); return true;
        case U'd': a = {{}, gc_bit(Gc::Nd), false}; return true;
        case U'D': a = {{}, gc_bit(Gc::Nd), true}; return true;
        case U'w': a = word_atom(false); return true;
        case U'W': a = word_atom(true); return true;
        case U'h': a = {{{U'0', U'9'}, {U'a', U'f'}, {U'A', U'F'}}, 0, false}; return true;
        case U'H': a = {{{U'0', U'9'}, {U'a', U'f'}, {U'A', U'F'}}, 0, true}; return true;
        case U'p': case U'P': {
          bool neg = c == U'P';
          std::u32string name;
          if (eat(U'{')) {
            if (eat(U'^')) neg = !neg;
            while (more() && peek() != U'}') name += re.pat_[pos++];
            if (!eat(U'}')) error("unterminated \\p{");
          } else {
            if (!more()) error("\\p without a name");
            name += re.pat_[pos++];
          }
          a = {{}, category_bits(name), neg};
          return true;
        }
        case U'n': lit = U'\n'; return false;
        case U'r': lit = U'\r'; return false;
        case U't': lit = U'\t'; return false;
        case U'f': lit = U'\f'; return false;
        case U'v': lit = U'\v'; return false;
        case U'a': lit = 7; return false;
        case U'e': lit = 27; return false;
        case U'b':
          if (in_class) {
            lit = 8;
            return false;
          }
          break;
        case U'x': case U'u': {
          char32_t v = 0;
          int digits = 0;
          const bool brace = c == U'x' && eat(U'{');
          const int maxd = brace ? 8 : c == U'x' ? 2 : 4;
          while (more() && digits < maxd) {
            const char32_t h = peek();
            int d = h >= U'0' && h <= U'9' ? static_cast<int>(h - U'0')
                    : h >= U'a' && h <= U'f' ? static_cast<int>(h - U'a' + 10)
                    : h >= U'A' && h <= U'F' ? static_cast<int>(h - U'A' + 10) : -1;
            if (d < 0) break;
            v = v * 16 + static_cast<char32_t>(d);
            ++digits;
            ++pos;
          }
          if (brace && !eat(U'}')) error("unterminated \\x{");
          if (digits == 0) error("bad hex escape");
          lit = v;
          return false;
        }
        default: break;
      }
      if ((c >= U'0' && c <= U'9') || (c >= U'A' && c <= U'Z') || (c >= U'a' && c <= U'z'))
        error(std::string("unsupported escape \\") + static_cast<char>(c));
      lit = c;  // an escaped punctuation character stands for itself
      return false;
    }

    std::unique_ptr<Node> parse_escape_atom() {
      if (more()) {
        const char32_t c = peek();
        Op op{};
        bool is_assert = true;
        switch (c) {
          case U'b': op = Op::wordb; break;
          case U'B': op = Op::nwordb; break;
          case U'A': op = Op::bos; break;
          case U'z': op = Op::eos; break;
          case U'Z': op = Op::eol; break;  // end, or before a final newline (close enough: a line end)
          default: is_assert = false;
        }
        if (is_assert) {
          ++pos;
          return std::make_unique<Node>(assertion(op));
        }
      }
      CharSet::Atom a;
      char32_t lit = 0;
      if (!parse_escape(a, lit, false)) return std::make_unique<Node>(literal(lit));
      Node n;
      n.kind = Node::set;
      n.cs.atoms.push_back(std::move(a));
      n.cs.finish();
      return std::make_unique<Node>(std::move(n));
    }

    CharSet parse_class() {
      CharSet cs;
      if (eat(U'^')) cs.negated = true;
      CharSet::Atom lits;  // literal characters and ranges collect into one atom
      bool first = true;
      while (true) {
        if (!more()) error("unterminated character class");
        char32_t c = peek();
        if (c == U']' && !first) {
          ++pos;
          break;
        }
        first = false;
        if (c == U'[') error("nested character classes are not supported");
        if (c == U'&' && pos + 1 < re.pat_.size() && re.pat_[pos + 1] == U'&') error("class intersection is not supported");
        ++pos;
        char32_t lo = c;
        if (c == U'\\') {
          CharSet::Atom a;
          if (parse_escape(a, lo, true)) {
            cs.atoms.push_back(std::move(a));
            continue;
          }
        }
        // A range lo-hi (a '-' before ']' is a literal).
        if (more() && peek() == U'-' && pos + 1 < re.pat_.size() && re.pat_[pos + 1] != U']') {
          ++pos;
          char32_t hi = re.pat_[pos++];
          if (hi == U'\\') {
            CharSet::Atom a;
            if (parse_escape(a, hi, true)) error("a class escape cannot end a range");
          }
          if (hi < lo) error("bad range in character class");
          add_range(lits, lo, hi);
        } else {
          add_char(lits, lo);
        }
      }
      if (!lits.ranges.empty()) cs.atoms.push_back(std::move(lits));
      cs.finish();
      return cs;
    }
  };

  static void compile(const Node& n, Program& p) {
    auto emit = [&](Op op, std::int32_t a = 0, std::int32_t b = 0, bool neg = false) {
      p.code.push_back({op, a, b, neg});
      return static_cast<std::int32_t>(p.code.size() - 1);
    };
    auto here = [&] { return static_cast<std::int32_t>(p.code.size()); };
    switch (n.kind) {
      case Node::empty: return;
      case Node::set:
        p.sets.push_back(n.cs);
        emit(Op::cls, static_cast<std::int32_t>(p.sets.size() - 1));
        return;
      case Node::assert_: emit(n.assertion); return;
      case Node::concat:
        for (const auto& k : n.kids) compile(k, p);
        return;
      case Node::alt: {
        // split L1, next; L1: a; jmp end; next: split L2, next2; ...
        std::vector<std::int32_t> jumps;
        for (std::size_t i = 0; i < n.kids.size(); ++i) {
          if (i + 1 < n.kids.size()) {
            const std::int32_t s = emit(Op::split);
            p.code[static_cast<std::size_t>(s)].a = here();
            compile(n.kids[i], p);
            jumps.push_back(emit(Op::jmp));
            p.code[static_cast<std::size_t>(s)].b = here();
          } else {
            compile(n.kids[i], p);
          }
        }
        for (auto j : jumps) p.code[static_cast<std::size_t>(j)].a = here();
        return;
      }
      case Node::look: {
        auto sub = std::make_shared<Program>();
        compile(n.kids[0], *sub);
        sub->code.push_back({Op::match, 0, 0, false});
        p.subs.push_back(std::move(sub));
        emit(Op::look, static_cast<std::int32_t>(p.subs.size() - 1), 0, n.neg);
        return;
      }
      case Node::repeat: {
        const Node& body = n.kids[0];
        if (n.greedy && body.kind == Node::set) {
          p.sets.push_back(body.cs);
          emit(Op::rep, static_cast<std::int32_t>(p.sets.size() - 1), n.min, false);
          p.code.back().c = n.max;
          return;
        }
        for (int i = 0; i < n.min; ++i) compile(body, p);
        // A split's preferred branch is `a`: the body when greedy, the exit when lazy.
        auto split_to = [&](std::int32_t s, std::int32_t body_at, std::int32_t exit_at) {
          p.code[static_cast<std::size_t>(s)].a = n.greedy ? body_at : exit_at;
          p.code[static_cast<std::size_t>(s)].b = n.greedy ? exit_at : body_at;
        };
        if (n.max < 0) {
          const std::int32_t s = emit(Op::split);
          const std::int32_t body_at = here();
          compile(body, p);
          emit(Op::jmp, s);
          split_to(s, body_at, here());
        } else {
          std::vector<std::int32_t> splits;
          for (int i = n.min; i < n.max; ++i) {
            splits.push_back(emit(Op::split));
            compile(body, p);
          }
          const std::int32_t exit_at = here();
          for (auto s : splits) split_to(s, s + 1, exit_at);
        }
        return;
      }
    }
  }

  struct Frame {
    std::int32_t pc;
    std::size_t pos;
    std::size_t lo;  // a rep's give-back frame: retry at pos - 1 while pos - 1 >= lo; else SIZE_MAX
  };

  static std::size_t run(const Program& p, const char32_t* cps, const Gc* gcs, std::size_t n, std::size_t start) {
    // Explicit backtracking stack; thread_local so matching never allocates after warm-up.
    thread_local std::vector<Frame> stack_storage;
    const std::size_t base = stack_storage.size();
    auto& st = stack_storage;
    st.push_back({0, start, SIZE_MAX});
    std::size_t result = SIZE_MAX;
    while (st.size() > base) {
      std::int32_t pc = st.back().pc;
      std::size_t pos = st.back().pos;
      if (st.back().lo == SIZE_MAX) {
        st.pop_back();
      } else {  // give back one more character of a rep
        --pos;
        if (pos <= st.back().lo) st.pop_back();
        else st.back().pos = pos;
      }
      while (true) {
        const Inst& in = p.code[static_cast<std::size_t>(pc)];
        bool ok = true;
        switch (in.op) {
          case Op::cls:
            ok = pos < n && p.sets[static_cast<std::size_t>(in.a)].contains(cps[pos], gcs[pos]);
            if (ok) ++pos, ++pc;
            break;
          case Op::split: {
            // Peephole: when the preferred branch must start with a character of one set and
            // the next character is not in it, go straight to the other branch (no frame).
            const Inst& first = p.code[static_cast<std::size_t>(in.a)];
            if ((first.op == Op::cls || (first.op == Op::rep && first.b > 0)) &&
                (pos >= n || !p.sets[static_cast<std::size_t>(first.a)].contains(cps[pos], gcs[pos]))) {
              pc = in.b;
              break;
            }
            st.push_back({in.b, pos, SIZE_MAX});
            pc = in.a;
            break;
          }
          case Op::rep: {
            const CharSet& cs = p.sets[static_cast<std::size_t>(in.a)];
            const std::size_t lim = in.c < 0 ? n : std::min(n, pos + static_cast<std::size_t>(in.c));
            std::size_t e = pos;
            while (e < lim && cs.contains(cps[e], gcs[e])) ++e;
            const std::size_t lo = pos + static_cast<std::size_t>(in.b);
            ok = e >= lo;
            if (ok) {
              if (e > lo) st.push_back({pc + 1, e, lo});
              pos = e;
              ++pc;
            }
            break;
          }
          case Op::jmp: pc = in.a; break;
          case Op::match:
            result = pos;
            st.resize(base);
            return result;
          case Op::look: {
            const bool m = run(*p.subs[static_cast<std::size_t>(in.a)], cps, gcs, n, pos) != SIZE_MAX;
            ok = m != in.neg;
            ++pc;
            break;
          }
          case Op::bol: ok = pos == 0 || cps[pos - 1] == U'\n'; ++pc; break;
          case Op::eol: ok = pos == n || cps[pos] == U'\n'; ++pc; break;
          case Op::bos: ok = pos == 0; ++pc; break;
          case Op::eos: ok = pos == n; ++pc; break;
          case Op::wordb: case Op::nwordb: {
            const bool l = pos > 0 && is_word_char(cps[pos - 1], gcs[pos - 1]);
            const bool r = pos < n && is_word_char(cps[pos], gcs[pos]);
            ok = (l != r) == (in.op == Op::wordb);
            ++pc;
            break;
          }
        }
        if (!ok) break;
      }
    }
    return result;
  }

  std::string pattern_;
  std::vector<char32_t> pat_;  // only while parsing
  std::shared_ptr<const Program> prog_;
};

}  // namespace nn::lm::detail

// SPDX-License-Identifier: MIT OR Apache-2.0
// Static configuration: the numbers, flags and strings a module or an optimizer is configured
// with (a LoRA scale, a dropout p, Adam's betas). They are part of the structure, as the module
// seed says: a compiled step hashes them and records again when one changes, and a checkpoint
// writes an optimizer's and checks them on resume. A module lists them in NN_MODULE with
// NN_STATIC(...), an optimizer in NN_OPTIMIZER(...); both go through the one visitor here.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace nn {

/// One configuration value as a hash or a checkpoint sees it.
struct StaticValue {
  enum class Kind { number, integer, boolean, text } kind = Kind::number;
  double number = 0;
  std::int64_t integer = 0;
  std::string_view text;

  /// As a checkpoint's metadata writes it: numbers with 17 significant digits (exact round
  /// trip), flags as "true" / "false".
  std::string str() const {
    switch (kind) {
      case Kind::number: {
        char buf[40];
        std::snprintf(buf, sizeof buf, "%.17g", number);
        return buf;
      }
      case Kind::integer: return std::to_string(integer);
      case Kind::boolean: return integer ? "true" : "false";
      case Kind::text: return std::string(text);
    }
    return {};
  }
};

/// Receives configuration fields one by one: field(name, value). Names are the member names as
/// written, without a trailing underscore ("scale_" is reported as "scale").
struct StaticSink {
  virtual void field(std::string_view name, const StaticValue& v) = 0;

 protected:
  ~StaticSink() = default;
};

namespace detail {

/// 64-bit FNV-1a over bytes; used for structure and hyperparameter hashes (allocation-free).
struct Fnv {
  std::uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  template <class T>
  void pod(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    bytes(&v, sizeof v);
  }
};

/// A sink that hashes names and values.
struct HashSink final : StaticSink {
  Fnv fnv;
  void field(std::string_view name, const StaticValue& v) override {
    fnv.bytes(name.data(), name.size());
    fnv.pod(v.kind);
    switch (v.kind) {
      case StaticValue::Kind::number: {
        const double d = v.number == 0 ? 0.0 : v.number;  // -0.0 and 0.0 configure the same
        fnv.pod(d);
        break;
      }
      case StaticValue::Kind::text: fnv.bytes(v.text.data(), v.text.size()); break;
      default: fnv.pod(v.integer);
    }
  }
};

/// Whether a member can be static configuration: a number, a flag, an enum or a string.
template <class T>
constexpr bool static_ok() {
  using U = std::remove_cvref_t<T>;
  return std::is_arithmetic_v<U> || std::is_enum_v<U> || std::is_same_v<U, std::string>;
}

template <class T>
StaticValue static_value(const T& v) {
  StaticValue out;
  if constexpr (std::is_same_v<T, bool>) {
    out.kind = StaticValue::Kind::boolean;
    out.integer = v ? 1 : 0;
  } else if constexpr (std::is_floating_point_v<T>) {
    out.kind = StaticValue::Kind::number;
    out.number = static_cast<double>(v);
  } else if constexpr (std::is_integral_v<T>) {
    out.kind = StaticValue::Kind::integer;
    out.integer = static_cast<std::int64_t>(v);
  } else if constexpr (std::is_enum_v<T>) {
    out.kind = StaticValue::Kind::integer;
    out.integer = static_cast<std::int64_t>(v);
  } else {
    out.kind = StaticValue::Kind::text;
    out.text = v;
  }
  return out;
}

/// The next name of a stringized list "a_, b_, c" from `pos`, trailing underscore dropped.
inline std::string_view next_static_name(std::string_view names, std::size_t& pos) {
  while (pos < names.size() && (names[pos] == ' ' || names[pos] == ',')) ++pos;
  std::size_t end = names.find(',', pos);
  if (end == std::string_view::npos) end = names.size();
  std::string_view name = names.substr(pos, end - pos);
  pos = end;
  while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
  if (name.size() > 1 && name.back() == '_') name.remove_suffix(1);
  return name;
}

/// What NN_STATIC(a, b) expands to inside NN_MODULE: the names as written and references to
/// the members.
template <class... T>
struct Statics {
  const char* names;
  std::tuple<T&...> refs;
  static constexpr std::size_t count = sizeof...(T);

  void visit(StaticSink& sink) const {
    std::size_t pos = 0;
    std::string_view all(names);
    std::apply([&](const auto&... v) { (sink.field(next_static_name(all, pos), static_value(v)), ...); }, refs);
  }
};
template <class... T>
Statics<T...> statics(const char* names, T&... refs) {
  return {names, std::tie(refs...)};
}

/// What NN_UNCHECKED(a, b) expands to: members that are deliberately neither reflected nor
/// configuration (caches, bookkeeping). Only counted, so the field check knows they are meant.
template <class... T>
struct Unchecked {
  static constexpr std::size_t count = sizeof...(T);
};
template <class... T>
Unchecked<T...> unchecked(T&...) {
  return {};
}

template <class T>
struct is_statics : std::false_type {};
template <class... T>
struct is_statics<Statics<T...>> : std::true_type {};
template <class T>
struct is_unchecked : std::false_type {};
template <class... T>
struct is_unchecked<Unchecked<T...>> : std::true_type {};

}  // namespace detail
}  // namespace nn

/// Static configuration of a module, listed in its NN_MODULE: NN_MODULE(LoraLinear, ...,
/// NN_STATIC(scale_, rslora_)). Numbers, flags, enums and strings; hashed into the structure a
/// compiled step checks on every call, so changing one records the step again.
#define NN_STATIC(...) ::nn::detail::statics(#__VA_ARGS__, __VA_ARGS__)
/// Members a module deliberately keeps outside its tree and its configuration (a cached table,
/// RNG bookkeeping): listed so the field check accepts them. A compiled step does not see them
/// change: their values are baked into a recorded step.
#define NN_UNCHECKED(...) ::nn::detail::unchecked(__VA_ARGS__)
